"""The process holds what the plan says on the host: resident set growth from before the model
exists to after two steps (a fresh process each: tests/e2e/host_rss_child.py) within 5% + 64 MiB
of the plan's host figure, by every path a model comes in; the user's fp32 module is no second
copy of the weights; a reference model beside its policy is its weights once; a host budget is held."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import megacompile
from megacompile.errors import HostMemoryError
from tests import models

MiB = 2 ** 20
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
CHILD = os.path.join(os.path.dirname(__file__), "host_rss_child.py")


def measured(path: str, folder) -> dict:
    child = subprocess.run([sys.executable, CHILD, path, "small", str(folder)], capture_output=True, text=True,
                           cwd=ROOT, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    print(report)
    return report


def assert_as_planned(r: dict) -> None:
    predicted, growth = r["predicted_host_bytes"], r["growth_bytes"]
    assert r["plan_host_bytes"] == predicted
    assert abs(growth - predicted) <= 0.05 * predicted + 64 * MiB, (growth / MiB, predicted / MiB)


def test_compile_holds_one_copy_of_the_weights(tmp_path):
    r = measured("compile", tmp_path)
    assert_as_planned(r)
    assert r["host_parts"]["the model's own weights"] == 0
    assert r["predicted_host_bytes"] == 14 * r["params"] + r["host_parts"]["frozen weights and buffers"]


def test_a_reference_beside_its_policy_is_its_weights_once_on_the_policys_device(tmp_path):
    # A frozen model compiled with share_device (a post-training reference): its fp32 weights once
    # (4 B/param, no moments, gradients or compute copies; the module's own tensors lent to them),
    # and no second device arena: the growth less the one arena is what the two plans say.
    r = measured("reference", tmp_path)
    assert_as_planned(r)
    parts, n = r["host_parts"], r["params"]
    assert parts["exp_avg+exp_avg_sq"] == 8 * n and parts["fp32 masters"] == 4 * n     # the policy's alone
    assert 0 <= parts["frozen weights and buffers"] - 4 * n < MiB                       # the reference's weights
    assert parts["the model's own weights"] == 0


@pytest.mark.slow     # 13 s; the plain path's resident set above is the default tier's
def test_host_budget_is_held_with_the_disk_tier(tmp_path):
    r = measured("disk", tmp_path)
    assert_as_planned(r)
    assert r["placement"] != "all in host RAM"
    assert r["growth_bytes"] <= r["host_budget_bytes"] + 64 * MiB


# 55-85 s each on two cores: from_pretrained (how a user's checkpoint comes in) in the slow tier, the
# others with -m long (compile_bf16's stand-in in CI: test_a_bf16_module_is_the_compute_copy_... below)
@pytest.mark.parametrize("path", [pytest.param("from_pretrained", marks=pytest.mark.slow)]
                         + [pytest.param(p, marks=pytest.mark.long) for p in ("accum", "moe", "compile_bf16")])
def test_resident_set_as_planned(tmp_path, path):
    r = measured(path, tmp_path)
    assert_as_planned(r)
    if path == "compile_bf16":
        assert r["host_parts"]["the model's own weights"] == 0


@pytest.mark.slow     # 30 s: the checkpoint is written in a process of its own first
def test_a_trainer_checkpoint_is_read_in_holding_the_host_state_and_one_tensor_more(tmp_path):
    """A Trainer checkpoint taken in: while prepare() reads its weights and optimizer.pt (8 bytes per
    parameter, through a memory map) into the host state, the process holds the plan's host figure
    and at most about its largest tensor more; after the steps, what the plan says."""
    r = measured("trainer", tmp_path)
    assert_as_planned(r)
    predicted = r["predicted_host_bytes"]
    assert r["load_peak_growth_bytes"] <= 1.05 * predicted + 64 * MiB + r["largest_tensor_bytes"], (
        r["load_peak_growth_bytes"] / MiB, predicted / MiB)


def test_module_parameters_are_the_masters_and_read_as_trained():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = megacompile.compile(model, 1.0, device="cpu")
    ids = models.batch(96, 2, 16)
    engine.prepare(input_ids=ids, labels=ids)
    host = engine.host
    for name, p in model.named_parameters():
        assert p.data_ptr() == host.master(name).data_ptr(), name       # a view, not a copy
        assert torch.equal(p.detach(), before[name])
    for _ in range(2):
        engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    trained = engine.state_dict()
    for key, t in model.state_dict().items():
        assert torch.equal(t, trained[key]), key
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before["model.layers.0.mlp.up_proj.weight"])
    assert engine.memory_stats()["host_parts"]["the model's own weights"] == 0


def test_a_bf16_module_is_the_compute_copy_and_reads_as_the_masters_rounded():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32).to(torch.bfloat16)
    engine = megacompile.compile(model, 1.0, device="cpu", compute_dtype=torch.bfloat16)
    ids = models.batch(96, 2, 16)
    for _ in range(2):
        engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    host = engine.host
    for name, p in model.named_parameters():
        assert p.data_ptr() == host.source(name).data_ptr(), name
        assert torch.equal(p.detach(), host.master(name).to(torch.bfloat16)), name
    assert engine.plan.host_cost.module_bytes == 0


def test_a_module_the_state_cannot_share_is_counted():
    # fp32 compute keeps no compute copy: a bf16 module's weights stay its own, and the plan says so.
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32).to(torch.bfloat16)
    engine = megacompile.compile(model, 1.0, device="cpu", compute_dtype=torch.float32)
    ids = models.batch(96, 2, 16)
    engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    own = sum(p.numel() * 2 for p in model.parameters())
    assert engine.host_cost.module_bytes == own
    assert engine.memory_stats()["host_parts"]["the model's own weights"] == own
    assert engine.plan.host_bytes == engine.host.nbytes + own
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), engine.host.master(name).to(torch.bfloat16)), name


def test_a_host_budget_too_small_is_refused_naming_the_smallest_that_fits(tmp_path):
    import re
    ids = models.batch(96, 2, 16)
    engine = megacompile.compile(models.hf_llama(layers=2, d=32), 1.0, device="cpu", host_budget=1e-5,
                                 nvme_dir=str(tmp_path / "a"))
    with pytest.raises(HostMemoryError, match="smallest host budget that fits") as refused:
        engine.prepare(input_ids=ids, labels=ids)
    assert engine.host is None
    smallest = float(re.search(r"smallest host budget that fits is ([0-9.]+) GiB", str(refused.value)).group(1))
    fits = megacompile.compile(models.hf_llama(layers=2, d=32), 1.0, device="cpu", host_budget=smallest,
                               nvme_dir=str(tmp_path / "b"))
    fits.prepare(input_ids=ids, labels=ids)
    assert fits.host_cost.ram_bytes <= smallest * 2 ** 30


def test_loading_into_the_module_loads_the_engine():
    # The module's parameters are the masters' views: model.load_state_dict goes through the engine,
    # so the masters, the compute copies and the module agree, and training goes on from there.
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    other = models.hf_llama(layers=2, d=32).state_dict()
    engine = megacompile.compile(model, 1.0, device="cpu", compute_dtype=torch.bfloat16)
    ids = models.batch(96, 2, 16)
    engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    model.load_state_dict(other)
    for name, t in engine.state_dict().items():
        assert torch.equal(t, other[name]), name
        if name in engine.host.slots:
            assert torch.equal(engine.host.source(name), other[name].to(torch.bfloat16)), name
    fresh = megacompile.compile(models.hf_llama(layers=2, d=32), 1.0, device="cpu", compute_dtype=torch.bfloat16)
    fresh.load_state_dict(other)
    assert engine.step(input_ids=ids, labels=ids) == fresh.step(input_ids=ids, labels=ids)


def test_a_module_compiled_again_is_the_newer_engines_alone():
    # The second engine's masters are what the module's tensors now view: the first engine's
    # synchronize and state_dict hook must not write its own masters into them.
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32)
    ids = models.batch(96, 2, 16)
    first = megacompile.compile(model, 1.0, device="cpu", compute_dtype=torch.bfloat16)
    first.step(input_ids=ids, labels=ids)
    first.synchronize()
    second = megacompile.compile(model, 1.0, device="cpu", compute_dtype=torch.bfloat16)
    second.step(input_ids=ids, labels=ids)
    second.step(input_ids=ids, labels=ids)
    first.step(input_ids=ids, labels=ids)
    first.synchronize()
    trained = second.state_dict()
    for key, t in model.state_dict().items():
        assert torch.equal(t, trained[key]), key
    for name in second.host.slots:
        assert torch.equal(second.host.source(name), second.host.master(name).to(torch.bfloat16)), name
