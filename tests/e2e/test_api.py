"""The user-facing surface: forward-only calls, meta-device models, plans and dumps, bf16 compute."""
from __future__ import annotations

import json

import pytest
import torch

import megacompile
from tests import models
from tests.e2e.harness import assert_same_weights, clone, float64_noise, weight_bytes

GiB = 2 ** 30


def _ids(t=16, seed=0):
    return models.batch(96, 2, t, seed=seed)


def test_forward_only_matches_eager_under_a_tight_budget():
    torch.manual_seed(0)
    model = models.hf_llama(layers=6, d=64).eval()
    budget = weight_bytes(model) * 0.5 / GiB
    engine = megacompile.compile(model, hbm_budget=budget, device="cpu")
    out = engine(input_ids=_ids())
    with torch.no_grad():
        expected = model(input_ids=_ids()).logits
    torch.testing.assert_close(out.logits, expected, rtol=1e-5, atol=1e-6)
    assert engine.memory_stats()["device_peak_bytes"] <= budget * GiB
    assert not any(n.op.value in ("backward", "offload") for n in engine._last.plan.program.nodes)


def test_meta_model_plans_without_weights_then_trains_after_loading():
    torch.manual_seed(0)
    real = models.NanoGPT(vocab=96, d=64, layers=3)
    with torch.device("meta"):
        meta = models.NanoGPT(vocab=96, d=64, layers=3)
    engine = megacompile.compile(meta, hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.MegacompileError, match="load_state_dict"):
        engine.step(idx=_ids(), targets=_ids())
    assert engine.plan.predicted_peak_bytes > 0          # planned with no weight in memory
    with pytest.raises(megacompile.MegacompileError, match="wrong shapes"):
        engine.load_state_dict({**real.state_dict(), "lm_head.weight": torch.zeros(3, 3)})
    engine.load_state_dict(real.state_dict())
    expected = clone(real)
    opt = torch.optim.AdamW(expected.parameters())
    _, loss = expected(_ids(), _ids())
    loss.backward()
    opt.step()
    assert engine.step(idx=_ids(), targets=_ids()) == pytest.approx(loss.item(), rel=1e-6)


def test_plan_prints_and_dumps(tmp_path):
    engine = megacompile.compile(models.hf_gpt2(layers=4, d=64), hbm_budget=1.0, device="cpu",
                                 dump_dir=str(tmp_path / "passes"))
    engine.step(input_ids=_ids(), labels=_ids())
    text = str(engine.plan)
    for word in ("prefetch", "wait", "forward", "backward", "offload", "optimizer_step", "free",
                 "predicted device peak", "measured"):
        assert word in text
    engine.plan.dump(str(tmp_path / "plan"))
    data = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert data["device_peak_bytes"] == engine.plan.predicted_peak_bytes
    assert data["measured_device_peak_bytes"] == engine.memory_stats()["device_peak_bytes"]
    assert data["passes"] == ["lower", "remat", "offload", "boundary", "layer_major", "transfers", "optimizer",
                              "lifetimes", "arena"]
    assert sorted(p.name for p in (tmp_path / "passes").iterdir()) == [
        "00_lower.txt", "01_remat.txt", "02_offload.txt", "03_boundary.txt", "04_layer_major.txt", "05_transfers.txt",
        "06_optimizer.txt", "07_lifetimes.txt", "08_arena.txt"]
    assert data["device_peak_bytes"] <= data["device_arena_bytes"] <= data["budget_bytes"]
    assert data["arena_tensor_count"] == len(data["arena_tensors"]) > 0


def test_state_dict_has_the_models_names_tied_ones_included():
    model = models.hf_gpt2(layers=2, d=64)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    engine.step(input_ids=_ids(), labels=_ids())
    state = engine.state_dict()
    assert list(state) == list(model.state_dict())
    assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    assert all(v.dtype == torch.float32 for k, v in state.items() if model.state_dict()[k].is_floating_point())


def test_blocks_share_one_template_whatever_the_depth():
    shallow = megacompile.compile(models.hf_llama(layers=2, d=32), hbm_budget=1.0, device="cpu")
    deep = megacompile.compile(models.hf_llama(layers=12, d=32), hbm_budget=1.0, device="cpu")
    for engine in (shallow, deep):
        engine.step(input_ids=_ids(), labels=_ids())
    nodes = [sum(t.n_fx_nodes for t in e.plan.captured.templates) for e in (shallow, deep)]
    assert [len(e.plan.captured.templates) for e in (shallow, deep)] == [3, 3]
    assert nodes[0] == nodes[1]       # traced work does not grow with depth


def test_bf16_compute_keeps_fp32_masters_and_tracks_eager_bf16():
    torch.manual_seed(0)
    model = models.hf_llama(layers=4, d=64)
    eager = clone(model).to(torch.bfloat16)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", compute_dtype=torch.bfloat16)
    loss = engine.step(input_ids=_ids(), labels=_ids())
    expected = eager(input_ids=_ids(), labels=_ids()).loss.item()
    # same bf16 weights, same graph: the first loss agrees to bf16 resolution
    assert loss == pytest.approx(expected, rel=1e-2)
    assert all(v.dtype == torch.float32 for v in engine.state_dict().values() if v.is_floating_point())
    assert engine.plan.captured.compute_dtype == torch.bfloat16


def test_fused_plan_dump_names_the_kernels(tmp_path):
    torch.manual_seed(0)
    engine = megacompile.compile(models.hf_llama(layers=2, d=32), hbm_budget=1.0, device="cpu", fuse=True)
    ids = models.batch(96, 2, 8)
    engine.step(input_ids=ids, labels=ids)
    engine.plan.dump(str(tmp_path))
    report = (tmp_path / "fusion.txt").read_text()
    for kernel in ("rms_norm", "swiglu", "rope", "fused_linear_cross_entropy"):
        assert kernel in report
    unfused = megacompile.compile(models.hf_llama(layers=2, d=32), hbm_budget=1.0, device="cpu")
    unfused.step(input_ids=ids, labels=ids)
    assert not unfused.plan.fused and engine.plan.fused


def test_frozen_parameters_stay_put_and_the_rest_trains_as_eager():
    torch.manual_seed(0)
    model = models.hf_llama(layers=3, d=64)
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    initial = clone(model)

    def train(m):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for seed in range(3):
            ids = _ids(seed=seed)
            opt.zero_grad()
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    reference = clone(model)
    eager = train(reference)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=1e-3, kernel="torch"))
    for seed in range(3):
        ids = _ids(seed=seed)
        assert engine.step(input_ids=ids, labels=ids) == pytest.approx(eager[seed], rel=1e-5)
    state = engine.state_dict()
    frozen = model.model.embed_tokens.weight
    assert torch.equal(state["model.embed_tokens.weight"], frozen.detach())
    assert_same_weights(engine, reference, noise=float64_noise(train, initial, reference))
