"""The cost model and planning without weights.

Prediction against measurement is a figure, not a test: benchmarks/budget_sweep.py (cpu backend)
and `python -m megacompile.acceptance` (a GPU) print measured beside predicted step times. A timed
assert fails on a loaded machine whatever the code does, so none is here.
"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import megacompile
from megacompile.calibrate import cpu_profile
from megacompile.cli import main
from megacompile.cost import get_profile
from tests import models

GiB = 2 ** 30
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


@pytest.mark.slow     # 12 s
def test_more_budget_never_predicts_a_slower_step():
    model = models.hf_llama(layers=6, d=64)
    ids = models.batch(96, 4, 32)
    minimum = megacompile.plan(model, 64.0, hardware="cpu", inputs={"input_ids": ids, "labels": ids}).minimum_budget_bytes
    previous = None
    for factor in (1.0, 1.2, 1.5, 2.0, 3.0, 5.0):
        plan = megacompile.plan(model, minimum * factor / GiB, hardware="cpu", inputs={"input_ids": ids, "labels": ids})
        assert plan.predicted_peak_bytes <= plan.budget_bytes
        if previous is not None:
            assert plan.prediction.step_s <= previous + 1e-12
        previous = plan.prediction.step_s


def test_plan_from_a_config_allocates_no_weights():
    plan = megacompile.plan(SMALL_LLAMA, hbm_budget=1.0, hardware="h100", batch=2, seq=64)
    params = sum(e.numel for e in plan.captured.state.values() if e.trainable)
    buffers = sum(e.numel * e.dtype.itemsize for e in plan.captured.state.values() if e.is_buffer)
    # fp32 master, m, v + the bf16 copy, which the gradient lands in (one micro-batch per step)
    assert plan.host_bytes == params * (12 + 2) + buffers
    assert plan.prediction.step_s > 0 and plan.prediction.tflops_6nd > 0
    # Attention is not in 6ND, and the embedding's gather does no matmul: the hardware does more than
    # 6 x (parameters but the embedding) x tokens.
    embedding = sum(e.numel for name, e in plan.captured.state.items() if "embed_tokens" in name)
    assert plan.prediction.hardware_flops > 6 * (params - embedding) * plan.prediction.tokens
    weights = sum(n.op.value == "prefetch" for n in plan.program.nodes)
    assert weights <= 2 * len(plan.captured.stages)                  # at most twice over the link


def test_plan_command_prints_a_summary_and_json(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    assert main(["plan", "--config", str(config), "--hbm-budget", "1", "--hardware", "h200", "--batch", "2",
                 "--seq", "64", "--json"]) == 0
    captured = capsys.readouterr()      # --json: the document on stdout, the text on stderr
    data, out = json.loads(captured.out), captured.err.splitlines()
    for key in ("fits", "device_peak_bytes", "host_bytes", "h2d_bytes_per_step", "d2h_bytes_per_step",
                "predicted_step_s", "predicted_tflops_6nd", "hardware_flops_per_model_flops"):
        assert key in data
    assert data["fits"] is True and data["device_peak_bytes"] <= GiB
    assert any("verdict        fits" in line for line in out)


def test_plan_command_says_when_it_does_not_fit(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    assert main(["plan", "--config", str(config), "--hbm-budget", "0.0001", "--batch", "2", "--seq", "64",
                 "--trace", str(tmp_path / "step.json"), "--plot", str(tmp_path / "img"),
                 "--json"]) == 3      # scripts can tell from the exit status
    captured = capsys.readouterr()
    assert json.loads(captured.out)["fits"] is False
    assert any("does NOT fit" in line for line in captured.err.splitlines())
    # the smallest plan's predicted step and memory picture, for the reader to see what it would take
    trace = json.loads((tmp_path / "step.json").read_text())
    assert {e["pid"] for e in trace["traceEvents"]} == {1}
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "img" / "memory.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_profile_is_measured_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path))
    first = cpu_profile()
    assert first.peak_fp32 > 1e8 and first.h2d_bw > 1e8 and first.op_overhead_s > 0
    assert list(tmp_path.glob("cpu_profile-*.json"))
    assert get_profile("cpu") == first


def test_unknown_hardware_is_named():
    with pytest.raises(megacompile.MegacompileError, match="unknown hardware 'tpu'.*h100"):
        get_profile("tpu")


def test_baseline_schedules_cost_what_their_systems_do():
    inputs = {"input_ids": models.batch(512, 2, 64), "labels": models.batch(512, 2, 64)}
    ours = megacompile.plan(SMALL_LLAMA, 1.0, hardware="h100", batch=2, seq=64)
    megatrain = megacompile.plan(SMALL_LLAMA, 1.0, hardware="h100", batch=2, seq=64, style="megatrain")
    zero3 = megacompile.plan(SMALL_LLAMA, 1.0, hardware="h100", batch=2, seq=64, style="zero3")
    del inputs
    blocks = 4
    fetches = lambda p: sum(n.op.value == "prefetch" for n in p.program.nodes)  # noqa: E731
    assert fetches(megatrain) == 3 * blocks + 2 + 1      # blocks 3x; prologue 2x; epilogue once
    assert sum(n.op.value == "recompute" for n in megatrain.program.nodes) == 2 * blocks
    # 3 forwards + 1 backward per block: about 10ND of 6ND for the blocks, plus attention
    ratio = megatrain.prediction.hardware_flops_per_model_flop
    assert ratio > ours.prediction.hardware_flops_per_model_flop + 0.5
    assert zero3.program.facts["choice"].prefetch_depth == 0
    assert ours.prediction.step_s < min(megatrain.prediction.step_s, zero3.prediction.step_s)


@pytest.mark.slow    # a search per micro-batch size; run.yaml's global_batch stays in the default tier
def test_plan_command_splits_a_global_batch_into_micro_batches(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    assert main(["plan", "--config", str(config), "--hbm-budget", "0.075", "--global-batch", "8", "--seq", "64",
                 "--hardware", "h100", "--json"]) == 0
    captured = capsys.readouterr()
    data, out = json.loads(captured.out), captured.err.splitlines()
    micro = data["grad_accum"]
    assert data["fits"] and 8 % micro == 0
    assert any(line.strip().startswith("micro-batch") for line in out)
    # each split as it was planned, the chosen one with the plan's own prediction
    splits = [line.split() for line in out if line.strip().startswith("split")]
    assert [s[1:6] for s in splits] == [["8", "rows", "x", "1", "accumulated"], ["4", "rows", "x", "2", "accumulated"],
                                        ["2", "rows", "x", "4", "accumulated"], ["1", "row", "x", "8", "accumulated"]]
    chosen = " ".join(next(s for s in splits if s[4] == str(micro)))
    assert f"{data['predicted_tokens_per_s']:,.0f} tok/s predicted" in chosen and "planned in" in chosen
    assert [(s["micro_batch"], s["micro_batches"]) for s in data["splits"]] == [(8, 1), (4, 2), (2, 4), (1, 8)]
    fastest = max((s for s in data["splits"] if s["fits"]), key=lambda s: s["predicted_tokens_per_s"])
    assert (fastest["micro_batches"], fastest["predicted_tokens_per_s"]) == (micro, data["predicted_tokens_per_s"])
    # the chosen split is the fastest of those that fit
    from megacompile.planner.from_config import plan_global_batch
    best, accumulate = plan_global_batch(SMALL_LLAMA, 0.075, 8, hardware="h100", seq=64)
    for batch in (8, 4, 2, 1):
        try:
            other = megacompile.plan(SMALL_LLAMA, 0.075, hardware="h100", batch=batch, seq=64)
        except megacompile.BudgetTooSmallError:
            continue
        assert other.prediction.tokens_per_s <= best.prediction.tokens_per_s


def test_a_calibrated_profile_plans(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    before = torch.random.get_rng_state()
    assert main(["calibrate", "--device", "cpu", "--out", str(profile)]) == 0
    assert torch.equal(torch.random.get_rng_state(), before), "calibrating drew from the model's random stream"
    measured = json.loads(profile.read_text())
    assert measured["peak_fp32"] > 0 and measured["h2d_bw"] > 0
    plan = megacompile.plan(SMALL_LLAMA, 1.0, hardware=str(profile), batch=2, seq=64)
    assert plan.hardware.name == measured["name"] and plan.prediction.step_s > 0
    (tmp_path / "broken.json").write_text("{}")
    with pytest.raises(megacompile.MegacompileError, match="cannot read the hardware profile"):
        get_profile(str(tmp_path / "broken.json"))


MID_LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 4096, "max_position_embeddings": 2048}


def test_host_budget_bounds_the_offloaded_activations():
    free = megacompile.plan(MID_LLAMA, 3, hardware="gh200", batch=8, seq=2048)
    assert free.stash_bytes > 0, "the budget must make offloading worth it for this test to mean anything"
    room = free.stash_bytes // 2
    host_budget = (free.host_bytes + room) / GiB
    held = megacompile.plan(MID_LLAMA, 3, hardware="gh200", batch=8, seq=2048, host_budget=host_budget)
    assert 0 < held.host_bytes + held.stash_bytes <= held.host_budget_bytes
    assert held.stash_bytes <= room
    assert held.prediction.step_s >= free.prediction.step_s     # fewer choices never predict faster
    assert held.to_json()["host_budget_bytes"] == int(host_budget * GiB)


def test_host_budget_below_the_masters_is_named(tmp_path, capsys):
    with pytest.raises(megacompile.HostMemoryError, match="host RAM budget of 0.001 GiB cannot hold the fp32 masters"):
        megacompile.plan(SMALL_LLAMA, 1.0, hardware="h100", batch=2, seq=64, host_budget=0.001)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    assert main(["plan", "--config", str(config), "--hbm-budget", "1", "--batch", "2", "--seq", "64",
                 "--host-budget", "0.001", "--json"]) == 3
    captured = capsys.readouterr()
    assert "does NOT fit: the host RAM budget" in captured.err
    assert json.loads(captured.out)["fits"] is False
    with pytest.raises(megacompile.MegacompileError, match="host_budget is the host RAM"):
        megacompile.compile(models.NanoGPT(), hbm_budget=1.0, device="cpu", host_budget=-1)
    engine = megacompile.compile(models.NanoGPT(), hbm_budget=1.0, device="cpu", host_budget=1e-4)
    ids = models.batch(96, 2, 16)
    with pytest.raises(megacompile.HostMemoryError, match="cannot hold the fp32 masters"):
        engine.step(idx=ids, targets=ids)
    assert engine.host is None, "nothing is allocated for a plan that cannot fit"


def test_the_prediction_says_how_much_of_its_wait_is_on_the_hosts_updates():
    """On the H200 the 3B step at its smallest budget was bound by the host AdamW (0.60 s a step),
    which the next forward waits on block by block: the plan says so apart from the copies."""
    from dataclasses import replace

    from megacompile.cost import PROFILES, predict
    from megacompile.planner.plan_summary import waiting
    plan = megacompile.plan(SMALL_LLAMA, hbm_budget=1.0, hardware="h200", batch=2, seq=64)
    fast, slow = (replace(PROFILES["h200"], host_adam_params_per_s=rate) for rate in (1e15, 1e6))
    quick, bound = (predict(plan.program, plan.captured, hw) for hw in (fast, slow))
    assert quick.exposed_update_s == 0 and quick.exposed_transfer_s == quick.exposed_s
    # A host this slow takes seconds an update: the next step's forward waits on nearly all of them.
    assert bound.exposed_update_s > 0.9 * bound.host_s and bound.step_s > bound.host_s
    assert bound.exposed_update_s + bound.exposed_transfer_s == pytest.approx(bound.exposed_s)
    assert bound.to_dict()["predicted_exposed_update_s"] == bound.exposed_update_s
    assert "on the host's AdamW updates" in waiting(bound) and "on the host" not in waiting(quick)
