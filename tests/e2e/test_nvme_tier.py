"""The disk tier end to end: parity with the AdamW moments and fp32 masters on disk (against the
same run all in RAM, bit for bit, and against eager torch AdamW to 1e-5); a dropped step whose
gradients landed in the compute copies leaves them as they were; a state file deleted under a
running engine stops it with an error naming the file; the plan says where the state lives."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import megacompile
from megacompile.cli import main
from megacompile.cost.host_memory import LEVELS, host_cost, host_costs
from megacompile.errors import StorageError
from megacompile.acceptance.parity import moment_error
from tests import models
from tests.e2e.atomic import Poisoned, assert_bit_equal, assert_same_state, engine, inputs, masters, snapshot
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_noise

GiB = 2 ** 30
STEPS = 10


@pytest.fixture
def tier_env(monkeypatch):
    # Pieces of 4096 parameters: every owner streams in several pieces; checksums verified on read.
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "4096")
    monkeypatch.setenv("MEGACOMPILE_TIER_VERIFY", "1")


def _moments(engine) -> dict[str, torch.Tensor]:
    return {f"{k}:{n}": engine.host.view(k, n).clone() for n in engine.host.slots for k in ("exp_avg", "exp_avg_sq")}


def test_parity_with_masters_and_moments_on_disk(tmp_path, tier_env):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=3, heads=2)
    batches = [models.batch(96, b=2, t=16, seed=i) for i in range(STEPS)]
    reference = clone(model)
    eager_moments, moments = {}, {}
    eager = eager_losses(reference, batches, "nanogpt", first_moments=eager_moments)
    off = megacompile_run(clone(model), batches, "nanogpt", 64.0, first_moments=moments)
    costs = host_costs(off.engine.plan.captured, torch.float32)
    assert costs[2].ram_bytes < costs[1].ram_bytes < costs[0].ram_bytes
    on = megacompile_run(clone(model), batches, "nanogpt", 64.0, nvme_dir=str(tmp_path / "tier"),
                         host_budget=costs[2].ram_bytes / GiB)
    assert on.engine.host_cost.placement == LEVELS[2]          # masters and moments on disk
    assert on.engine.host.nbytes == costs[2].ram_bytes         # what the plan counted is what was allocated
    assert all(b.master is None and b.exp_avg is None for b in on.engine.host.owners.values())
    assert on.engine.host.disk.tier.bytes_read > 0
    assert on.losses == off.losses                              # bit-exact, tier on vs off
    assert_bit_equal(masters(on.engine), masters(off.engine))
    assert_bit_equal(_moments(on.engine), _moments(off.engine))
    torch.testing.assert_close(torch.tensor(on.losses), torch.tensor(eager), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(on.engine, reference, noise=weight_noise(model, batches, "nanogpt", reference))


def test_moments_on_disk_resume_through_a_checkpoint(tmp_path, tier_env):
    """The checkpoint reads the tier's state through HostState; resuming into a fresh tier
    continues exactly."""
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=2)
    batches = [models.batch(96, b=2, t=16, seed=i) for i in range(4)]
    straight = megacompile_run(clone(model), batches, "nanogpt", 64.0)
    budget = host_costs(straight.engine.plan.captured, torch.float32)[1].ram_bytes / GiB
    first = megacompile_run(clone(model), batches[:2], "nanogpt", 64.0, nvme_dir=str(tmp_path / "a"),
                            host_budget=budget)
    assert first.engine.host_cost.placement == LEVELS[1]
    first.engine.save_checkpoint(str(tmp_path / "ckpt.pt"))
    resumed = megacompile.compile(clone(model), 64.0, device="cpu", nvme_dir=str(tmp_path / "b"), host_budget=budget,
                                  optimizer=first.engine.optimizer)
    resumed.prepare(idx=batches[0], targets=batches[0])
    resumed.load_checkpoint(str(tmp_path / "ckpt.pt"))
    losses = [resumed.step(idx=ids, targets=ids) for ids in batches[2:]]
    assert losses == straight.losses[2:]
    assert_bit_equal(masters(resumed), masters(straight.engine))


def test_a_dropped_step_puts_back_the_compute_copies_its_gradients_landed_in():
    """bf16 compute, one micro-batch per step: gradients land in the bf16 copies the device
    fetches. A step dropped for a NaN gradient or loss restores those copies from the masters,
    and the next step is bit-exact with a run that never saw the poison."""
    torch.manual_seed(0)
    model = Poisoned()
    ours, reference = (engine(copy.deepcopy(model), compute_dtype=torch.bfloat16) for _ in range(2))
    for e in (ours, reference):
        e.step(**inputs(1))
    assert any(b.grad is b.compute for b in ours.host.owners.values())
    for n, poison in enumerate(({"grad_poison": 0.0}, {"loss_scale": float("nan")})):
        before = snapshot(ours)
        with pytest.warns(RuntimeWarning, match="skipped"):
            ours.step(**inputs(2 + n, **poison))
        assert_same_state(before, snapshot(ours), grads=False)       # compute copies included
        for e in (ours, reference):
            e.step(**inputs(100 + n))
        assert_bit_equal(masters(ours), masters(reference))


def test_a_state_file_deleted_under_the_run_is_named(tmp_path, tier_env):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=2)
    ids = models.batch(96, 2, 16)
    probe = megacompile_run(clone(model), [ids], "nanogpt", 64.0)
    budget = host_costs(probe.engine.plan.captured, torch.float32)[1].ram_bytes / GiB
    e = megacompile.compile(model, 64.0, device="cpu", nvme_dir=str(tmp_path), host_budget=budget)
    e.step(idx=ids, targets=ids)
    e.synchronize()
    victim = e.host.disk.tier.files[0, "exp_avg"].path
    os.unlink(victim)
    with pytest.raises(StorageError, match=f"{os.path.basename(victim)} was deleted"):
        e.step(idx=ids, targets=ids)
        e.synchronize()
    with pytest.raises(StorageError, match="failed earlier"):     # and it stays stopped
        e.step(idx=ids, targets=ids)
        e.synchronize()


def test_host_bytes_per_param_at_each_placement():
    """A 118B Llama's owners (95 blocks of 1.237B, embeddings and head of 328M), bf16 compute,
    one micro-batch per step: 14 B/param all in RAM, 6 with the moments on disk, 2 with the
    masters there too, plus the tier's pool; the disk holds 8 and 12 B/param, read and written once a step."""
    owners = {0: 327_680_000, **{1 + i: 1_237_319_680 for i in range(95)}, 96: 327_680_000 + 10_240}
    costs = [host_cost(owners, set(), 0, torch.bfloat16, 1, p) for p in LEVELS]
    assert costs[0].ram_bytes_per_param == 14 and costs[0].disk_bytes == 0
    # + the tier's buffer pool (4 pieces of 4M parameters per kind on disk): 128 and 192 MiB here
    assert costs[1].ram_bytes - costs[1].pool_bytes == 6 * costs[1].params and costs[1].pool_bytes == 128 * 2**20
    assert costs[1].ram_bytes_per_param < 6.002 and costs[1].disk_bytes == 8 * costs[1].params
    assert costs[2].ram_bytes - costs[2].pool_bytes == 2 * costs[2].params and costs[2].pool_bytes == 192 * 2**20
    assert costs[2].ram_bytes_per_param <= 2.5 and costs[2].disk_bytes == 12 * costs[2].params
    # fp32 compute keeps the master as the device's copy and a gradient of its own: 16 B/param.
    assert host_cost(owners, set(), 0, torch.float32, 1, LEVELS[0]).ram_bytes_per_param == 16
    # Accumulating micro-batches: an fp32 sum (4 B) and a bf16 landing buffer (2 B) besides.
    accumulating = host_cost(owners, set(), 0, torch.bfloat16, 4, LEVELS[2])
    assert accumulating.ram_bytes - accumulating.pool_bytes == 8 * accumulating.params


SMALL_LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096,
               "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_plan_puts_the_moments_on_disk_when_host_ram_is_short(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", str(1 << 16))     # a pool of 2 MiB for this small model
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    args = ["plan", "--config", str(config), "--hbm-budget", "1", "--batch", "2", "--seq", "64",
            "--host-budget", "0.03", "--json"]
    assert main(args) == 3
    out = capsys.readouterr().err       # --json: the text on stderr, the document alone on stdout
    assert "does NOT fit" in out and "give a disk tier" in out and "exp_avg and exp_avg_sq on disk" in out
    assert main(args + ["--nvme-budget", "1", "--nvme-bandwidth", "2"]) == 0
    captured = capsys.readouterr()
    summary, out = json.loads(captured.out), captured.err
    assert summary["fits"] and summary["host_placement"] == "exp_avg and exp_avg_sq on disk"
    assert summary["host_tiers"]["exp_avg+exp_avg_sq"]["where"] == "disk"
    assert summary["disk_read_bytes_per_step"] == summary["disk_bytes"] == 8 * summary["host_tiers"]["fp32 masters"][
        "bytes"] // 4
    # at least one step's bytes over the step without the disk's stall: the updates cannot use all of it
    assert summary["disk_bandwidth_needed"] >= 2 * summary["disk_bytes"] / summary["predicted_step_s_without_disk"]
    assert "disk tier" in out and "per optimizer step; hidden at >=" in out


@pytest.mark.slow    # a sweep of disk speeds; the disk setting the pace stays in the default tier
def test_the_disk_bandwidth_needed_is_where_the_cost_model_stops_waiting_on_the_disk():
    """At the bandwidth the plan names, the predicted step is within 1% of the step with a disk
    that never stalls; at 10% less it is not (the updates of the stages' last backward and the
    next forward's first weights queue on the disk)."""
    import dataclasses

    from megacompile.cost.predict import predict
    from megacompile.planner import plan
    p = plan(dict(PHI_4), 24 * 0.9 * 10**9 / 2**30, hardware="rtx4090", batch=4, seq=2048, host_budget=128,
             nvme_budget=2000)
    need, without = p.disk_bandwidth_needed, p.step_s_without_disk
    assert need > 1.5 * 2 * p.disk_bytes_per_step / without      # well above the floor at this shape
    disk = p.host_cost.disk_bytes / p.host_cost.params

    def step(bandwidth):
        scale = bandwidth / p.disk_bandwidth_given
        hw = dataclasses.replace(p.hardware, disk_read_bw=p.hardware.disk_read_bw * scale,
                                 disk_write_bw=p.hardware.disk_write_bw * scale)
        return predict(p.program, p.captured, hw, disk).step_s
    assert step(need) <= 1.01 * without < step(0.9 * need)


PHI_4 = {"model_type": "phi3", "hidden_size": 5120, "intermediate_size": 17920, "num_hidden_layers": 40,
         "num_attention_heads": 40, "num_key_value_heads": 10, "vocab_size": 100352,
         "max_position_embeddings": 16384, "rope_theta": 250000.0, "tie_word_embeddings": False}


def test_a_disk_slower_than_the_step_needs_is_said_to_set_the_pace(tmp_path, capsys):
    """Phi-4 on a 4090 with 128 GB of RAM: the moments go to disk, 2 x 109 GiB per step at the
    desktop's 5.65 GB/s. The bandwidth needed is measured against the step without the disk's
    stall (about 10 s), not the stretched one (about 46 s), which would always put it under what
    the disk gives."""
    config = tmp_path / "phi-4.json"
    config.write_text(json.dumps(PHI_4))
    args = ["plan", "--config", str(config), "--hardware", "rtx4090", "--host", "desktop", "--host-budget", "128",
            "--nvme-budget", "2000", "--batch", "4", "--seq", "2048", "--json"]
    assert main(args) == 0
    captured = capsys.readouterr()
    summary, out = json.loads(captured.out), captured.err
    assert summary["disk_bytes"] > 0
    without = summary["predicted_step_s_without_disk"]
    assert without < summary["predicted_step_s"] / 2
    assert summary["disk_bandwidth_needed"] >= 2 * summary["disk_bytes"] / without
    assert summary["disk_bandwidth_needed"] > 2 * summary["disk_bandwidth_given"]
    assert summary["disk_sets_pace"] is True
    assert "the disk tier sets the pace" in out and "(hidden)" not in out


@pytest.mark.slow   # two plans of a 118B model: 20-40 s (the host state needs no global-batch search)
def test_a_118b_llama_fits_a_1_tib_host_with_a_disk_tier(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 10240, "intermediate_size": 32768,
                                  "num_hidden_layers": 95, "num_attention_heads": 80, "num_key_value_heads": 8,
                                  "vocab_size": 32000, "max_position_embeddings": 4096,
                                  "tie_word_embeddings": False}))
    args = ["plan", "--config", str(config), "--hbm-budget", "80", "--hardware", "h100", "--batch", "4",
            "--seq", "4096", "--host-budget", "1024", "--json"]
    assert main(args) == 3
    out = capsys.readouterr().err       # --json: the text on stderr, the document alone on stdout
    assert "does NOT fit: the host RAM budget of 1024 GiB" in out and "give a disk tier" in out
    assert main(args + ["--nvme-budget", "4096"]) == 0
    captured = capsys.readouterr()
    summary, out = json.loads(captured.out), captured.err
    assert summary["fits"], out
    assert summary["disk_bytes"] > 0 and summary["disk_bandwidth_needed"] > 0
    assert "hidden at >=" in out


def test_accumulating_bf16_state_is_what_the_plan_counts(tmp_path, tier_env):
    """grad_accum=2, bf16 compute, moments on disk: the fp32 sum and the bf16 landing buffer are
    allocated as counted, and the run matches the same run all in RAM bit for bit."""
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=2)
    batches = [models.batch(96, b=2, t=16, seed=i) for i in range(4)]
    off = megacompile_run(clone(model), batches, "nanogpt", 64.0, compute_dtype=torch.bfloat16, grad_accum=2)
    costs = host_costs(off.engine.plan.captured, torch.bfloat16, 2)
    assert off.engine.host.nbytes == costs[0].ram_bytes and costs[1].ram_bytes < costs[0].ram_bytes
    assert any(b.landing.dtype == torch.bfloat16 for b in off.engine.host.owners.values())
    on = megacompile_run(clone(model), batches, "nanogpt", 64.0, compute_dtype=torch.bfloat16, grad_accum=2,
                         nvme_dir=str(tmp_path), host_budget=costs[1].ram_bytes / GiB)
    assert on.engine.host_cost.placement == LEVELS[1] and on.engine.host.nbytes == costs[1].ram_bytes
    assert on.losses == off.losses
    assert_bit_equal(masters(on.engine), masters(off.engine))


def test_disk_tier_arguments_are_checked_before_anything_runs(tmp_path):
    from megacompile.errors import ArgumentError
    with pytest.raises(ArgumentError, match="nvme_bandwidth is the disk tier's disk bandwidth in GB/s"):
        megacompile.plan(SMALL_LLAMA, 1.0, nvme_bandwidth=0)
    with pytest.raises(ArgumentError, match="nvme_budget bounds the disk tier in nvme_dir: give nvme_dir"):
        megacompile.compile(models.NanoGPT(), 1.0, device="cpu", nvme_budget=10)
    with pytest.raises(ArgumentError, match="nvme_budget is the disk space"):
        megacompile.compile(models.NanoGPT(), 1.0, device="cpu", nvme_dir=str(tmp_path), nvme_budget=-1)
    (tmp_path / "file").write_text("")
    with pytest.raises(ArgumentError, match="nvme_dir .* is a file"):
        megacompile.compile(models.NanoGPT(), 1.0, device="cpu", nvme_dir=str(tmp_path / "file"))
