"""compile(..., share_device=engine): a frozen reference model beside its policy on one device.

The two take turns on one backend: one budget, one device arena (the larger plan's), one lock; the
reference's forward is eager's exactly and leaves the policy's training as it would be alone; its
host state is its weights once, placed in the host budget the policy's leaves; a budget, device or
owner that does not agree is refused with the project's own error."""
from __future__ import annotations

import copy

import pytest
import torch

import megacompile
from megacompile.errors import ArgumentError, CaptureError, HostMemoryError, MegacompileError
from tests import models

GiB = 2 ** 30


def _pair(budget: float = 1.0, **reference_kwargs):
    torch.manual_seed(0)
    policy_model = models.hf_llama(layers=2, d=32)
    frozen = copy.deepcopy(policy_model).requires_grad_(False).eval()
    policy = megacompile.compile(policy_model, budget, device="cpu")
    reference = megacompile.compile(frozen, budget, device="cpu", share_device=policy, **reference_kwargs)
    return policy, reference, frozen


def _eager_pair():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    return model, copy.deepcopy(model).requires_grad_(False).eval()


def test_a_reference_runs_exactly_on_its_policys_device_and_leaves_its_training_as_alone():
    ids = models.batch(96, 2, 16)
    eager_policy, eager_reference = _eager_pair()
    opt = torch.optim.AdamW(eager_policy.parameters(), lr=1e-3)
    want_losses, want_ref = [], []
    for _ in range(3):
        with torch.no_grad():
            want_ref.append(eager_reference(input_ids=ids, labels=ids).logits)
        loss = eager_policy(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        want_losses.append(loss.item())

    policy, reference, _ = _pair()
    got_losses = []
    for i in range(3):
        out = reference(input_ids=ids, labels=ids)
        torch.testing.assert_close(out.logits, want_ref[i], rtol=1e-5, atol=1e-6)   # the model as it was, every time
        got_losses.append(policy.step(input_ids=ids, labels=ids))
    assert got_losses == pytest.approx(want_losses, rel=1e-5)
    reference(input_ids=ids, labels=ids)          # the device's last run is the reference's

    assert reference.backend is policy.backend
    arena = policy.backend.arena
    plans = [policy.plan, reference.plan]
    assert arena.size == max(p.arena.size for p in plans) and arena.regrown <= 1
    # The reference holds its weights once: no masters, moments or gradients of its own.
    assert set(reference.host.parts()) == {"frozen weights and buffers"}
    assert reference.host_cost.ram_bytes == reference.host.nbytes
    stats = reference.memory_stats()
    assert stats["device_peak_bytes"] <= stats["device_budget_bytes"] == policy.budget_bytes
    # Each engine's record of its own last run, not the device's last.
    assert policy.memory_stats()["device_peak_bytes"] == policy.plan.predicted_peak_bytes
    policy.close()
    reference.close()


def test_the_reference_host_state_is_placed_in_what_the_policys_leaves():
    ids = models.batch(96, 2, 16)
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    n = sum(p.numel() for p in model.parameters())
    # Room for the policy's 16 B/param (fp32 compute: masters, moments, gradients) and not 4 more.
    budget = 18 * n / GiB
    policy = megacompile.compile(model, 1.0, device="cpu", host_budget=budget)
    policy.prepare(input_ids=ids, labels=ids)
    alone = megacompile.compile(copy.deepcopy(model).requires_grad_(False), 1.0, device="cpu", host_budget=budget)
    alone(input_ids=ids)          # fits alone
    shared = megacompile.compile(copy.deepcopy(model).requires_grad_(False), 1.0, device="cpu", host_budget=budget,
                                 share_device=policy)
    with pytest.raises(HostMemoryError, match="engines sharing its device hold"):
        shared(input_ids=ids)
    for e in (policy, alone, shared):
        e.close()


def test_disagreeing_settings_and_a_closed_owner_are_refused():
    torch.manual_seed(0)
    model = models.hf_llama(layers=1, d=32)
    policy = megacompile.compile(model, 1.0, device="cpu")
    frozen = copy.deepcopy(model).requires_grad_(False)
    with pytest.raises(ArgumentError, match="the one hbm_budget of both engines"):
        megacompile.compile(frozen, 2.0, device="cpu", share_device=policy)
    with pytest.raises(ArgumentError, match="share_device takes the Engine"):
        megacompile.compile(frozen, 1.0, device="cpu", share_device=model)
    ids = models.batch(96, 2, 8)
    reference = megacompile.compile(frozen, 1.0, share_device=policy)      # the owner's device by default
    assert reference.device == policy.device
    with pytest.raises(CaptureError, match="no trainable parameters"):    # a frozen model runs forward only
        reference.step(input_ids=ids, labels=ids)
    with policy.device_share.lock:     # a call of the other engine in flight (another thread's)
        with pytest.raises(MegacompileError, match="one sharing its device"):
            reference(input_ids=ids)
    reference(input_ids=ids)
    policy.close()
    with pytest.raises(MegacompileError, match="shared device was closed"):
        reference(input_ids=ids)
    reference.close()        # harmless after the owner's
    with pytest.raises(ArgumentError, match="that engine is closed"):
        megacompile.compile(frozen, 1.0, device="cpu", share_device=policy)


def test_share_frozen_holds_the_owners_frozen_weights_once_and_checks_what_is_loaded_into_them():
    ids = models.batch(96, 2, 16)
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    for name, p in model.named_parameters():        # a LoRA policy's shape: the base frozen, a part trained
        p.requires_grad_(name.startswith("lm_head"))
    frozen = copy.deepcopy(model).requires_grad_(False).eval()
    with torch.no_grad():
        want = frozen(input_ids=ids).logits
    policy = megacompile.compile(model, 1.0, device="cpu")
    policy.prepare(input_ids=ids, labels=ids)
    reference = megacompile.compile(frozen, 1.0, share_device=policy, share_frozen=True)
    torch.testing.assert_close(reference(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    host, owner = reference.host, policy.host
    base = {n for n in owner.consts if not n.startswith("lm_head")}
    assert host.borrowed == frozenset(owner.consts) and base
    for name in base:
        assert host.consts[name] is owner.consts[name]      # the same tensor, not a copy
    # Its own: the weights the policy trains (a reference keeps them as they were), held frozen here.
    head = sum(p.numel() * 4 for n, p in frozen.named_parameters() if n.startswith("lm_head"))
    assert reference.host.nbytes == reference.host_cost.ram_bytes == head
    assert set(reference.host.parts()) == {"frozen weights and buffers"}
    policy.step(input_ids=ids, labels=ids)             # the policy trains; the shared base does not move
    torch.testing.assert_close(reference(input_ids=ids).logits, want, rtol=1e-5, atol=1e-6)
    # A load into a shared weight is a check: the same values pass, others are refused, nothing written.
    key = "model.layers.0.mlp.up_proj.weight"
    same = frozen.state_dict()[key].clone()
    reference.load_state_dict({key: same}, strict=False)
    before = owner.consts[key].clone()
    with pytest.raises(MegacompileError, match=f"frozen weight {key} differs from the one the engine it is shared "
                                               "with holds.*nothing was loaded"):
        reference.load_state_dict({key: same + 1}, strict=False)
    assert torch.equal(owner.consts[key], before)
    with pytest.raises(ArgumentError, match="True only with share_device"):
        megacompile.compile(copy.deepcopy(frozen), 1.0, device="cpu", share_frozen=True)
    policy.close()
    reference.close()
