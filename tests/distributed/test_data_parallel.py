"""Data parallelism on gloo with the cpu backend: ranks spawned on this machine, each on its slice
of the global batch, held against one process (eager torch.optim.AdamW) on the whole batch."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

import megacompile
from megacompile.distributed import shard_of
from megacompile.distributed.shard import grad_bytes

from . import ranks

TOL = 1e-5


def _results(folder, size):
    return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(size)]


def _weight_error(weights, reference) -> float:
    assert set(weights) == set(reference)
    return max((weights[k] - v).abs().max().item() / (v.abs().max().item() or 1.0) for k, v in reference.items())


def _loss_error(results, reference) -> float:
    # Equal micro-batches: the mean of the ranks' losses is the loss of the whole batch.
    mean = [sum(losses) / len(losses) for losses in zip(*(r["losses"] for r in results))]
    return max(abs(a - b) / abs(b) for a, b in zip(mean, reference, strict=True))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """2 ranks, 10 clipped steps, a checkpoint after step 5."""
    folder = str(tmp_path_factory.mktemp("two"))
    ckpt = os.path.join(folder, "ckpt", "step-5")
    ranks.compiled(ranks.CLIP).save_checkpoint(os.path.join(folder, "ckpt", "other-run"))   # keep_last leaves it
    ranks.spawn("train", 2, folder, clip=ranks.CLIP, save=ckpt)
    return folder, ckpt, _results(folder, 2)


@pytest.fixture(scope="module")
def eager_clipped():
    return ranks.eager(ranks.CLIP)


def test_two_ranks_train_as_one_process_on_the_whole_batch(two_ranks, eager_clipped):
    folder, _, results = two_ranks
    losses, weights = eager_clipped
    assert _loss_error(results, losses) <= TOL
    assert _weight_error(torch.load(os.path.join(folder, "weights.pt")), weights) <= TOL


def test_reading_the_models_own_parameters_on_a_rank_is_refused(two_ranks):
    """Each rank holds a share of the trained masters: the module's parameters are not them."""
    _, _, results = two_ranks
    for r in results:
        assert r["model_read"] is not None and "holds only its share of the trained ones: call " \
            "engine.state_dict() on every rank" in r["model_read"], r["model_read"]


def test_each_rank_holds_its_share_of_masters_and_moments(two_ranks):
    _, _, results = two_ranks
    params = sum(p.numel() for p in ranks.model().parameters())
    single = 12 * params          # one process: fp32 master, exp_avg, exp_avg_sq of every parameter
    held = [r["state_bytes"] for r in results]
    assert sum(held) == single
    assert all(abs(b - single / 2) <= 0.1 * single / 2 for b in held), (held, single)


def test_each_rank_holds_its_share_of_the_gradients(two_ranks):
    _, _, results = two_ranks
    engine = ranks.compiled(ranks.CLIP)
    ids = ranks.batches()[0]
    engine.prepare(idx=ids, targets=ids)
    single = grad_bytes(engine.host)     # one process: an fp32 gradient of every parameter
    assert single == 4 * sum(p.numel() for p in ranks.model().parameters())
    held = [r["grad_bytes"] for r in results]
    assert sum(held) == single
    assert all(abs(b - single / 2) <= 0.1 * single / 2 for b in held), (held, single)


def test_each_stage_gradients_are_reduced_as_the_backward_makes_them(two_ranks):
    """Each stage's reduce is issued right after its backward, before the next stage's backward
    (the earlier stage's): not after the backward. One reduce per gradient offload, on the
    network stream."""
    _, _, results = two_ranks
    for r in results:
        issued = r["issued"]
        backward = [w.partition(" ")[2] for w in issued if w.startswith("backward ")]
        assert len(backward) >= 3
        for stage, before in zip(backward, backward[1:]):
            assert issued.index(f"reduce {stage}") == issued.index(f"backward {stage}") + 1 < \
                issued.index(f"backward {before}"), issued
        assert r["reduce_nodes"] == r["grad_offload_nodes"]


def test_the_ranks_of_a_node_share_one_compute_copy(two_ranks):
    _, _, results = two_ranks
    # one segment, mapped by both ranks, its name already gone: a crash from here on leaks nothing
    assert results[0]["mapped"] is not None and results[0]["mapped"] == results[1]["mapped"]
    assert results[0]["segment"] == results[1]["segment"] and results[0]["local"] == [0, 1]
    assert not any(r["segment_left"] for r in results)


def test_a_node_holds_one_compute_copy_and_its_share_of_the_state(two_ranks):
    _, _, results = two_ranks
    model = ranks.model()
    params = sum(p.numel() for p in model.parameters())
    owners = 4                                  # embeddings, 2 blocks, head: each starts on its own page
    shared = results[0]["shared_bytes"]
    assert 4 * params <= shared <= 4 * params + owners * 4096      # one fp32 copy for the node
    node = sum(r["nbytes"] for r in results)
    private = sum(r["state_bytes"] + r["grad_bytes"] + r["const_bytes"] for r in results)
    assert node == shared + private
    # one copy + one 16 B/param of masters, moments and gradient sums across the node's ranks
    assert sum(r["state_bytes"] for r in results) == 12 * params
    assert sum(r["grad_bytes"] for r in results) == 4 * params


def test_the_disk_tier_is_refused_with_data_parallelism(two_ranks):
    _, _, results = two_ranks
    assert all("nvme_dir" in r["nvme_refused"] and "not sharded" in r["nvme_refused"] for r in results)


def test_each_rank_writes_its_share_of_the_checkpoint(two_ranks):
    _, ckpt, _ = two_ranks
    keys = []
    for r in range(2):
        with safe_open(os.path.join(ckpt, f"rank-{r:05d}-of-00002.safetensors"), "pt") as f:
            keys.append(set(f.keys()))
    assert keys[0] and keys[1] and not keys[0] & keys[1]
    names = {n for n, _ in ranks.model().named_parameters()}
    assert {k.partition("/")[2] for k in keys[0] | keys[1]} == names


def test_the_ranks_rotate_their_own_checkpoints_only_and_a_resumed_run_is_theirs(two_ranks):
    _, ckpt, _ = two_ranks
    folder = os.path.dirname(ckpt)
    assert sorted(f for f in os.listdir(folder) if not f.endswith(".pt")) == ["other-run", "step-5"]
    with open(os.path.join(ckpt, "manifest.json")) as f:
        run = json.load(f)["run"]
    engine = ranks.compiled(ranks.CLIP)
    assert engine.run_id != run
    engine.load_checkpoint(ckpt)
    assert engine.run_id == run


def test_a_checkpoint_of_two_ranks_resumes_on_one_process(two_ranks, eager_clipped):
    folder, ckpt, _ = two_ranks
    engine = ranks.compiled(ranks.CLIP)
    start = engine.load_checkpoint(ckpt)["next"]
    all_batches = ranks.batches()
    engine.prepare(idx=all_batches[0], targets=all_batches[0])
    saved = {}
    for r in range(2):
        saved.update(torch.load(os.path.join(os.path.dirname(ckpt), f"state-{r}.pt")))
    for key, value in saved.items():          # the state the ranks held, bit for bit
        table, _, name = key.partition("/")
        assert torch.equal(engine.host.view(table, name), value), key
    losses = [engine.step(idx=ids, targets=ids) for ids in all_batches[start:]]
    reference_losses, reference = eager_clipped
    assert max(abs(a - b) / b for a, b in zip(losses, reference_losses[start:])) <= TOL
    assert _weight_error(engine.state_dict(), reference) <= TOL


@pytest.mark.slow
def test_four_ranks_and_resuming_two_ranks_checkpoint_on_four(two_ranks, eager_clipped, tmp_path):
    _, ckpt, _ = two_ranks
    ranks.spawn("train", 4, str(tmp_path), clip=ranks.CLIP, resume=ckpt)
    results = _results(tmp_path, 4)
    assert all(r["exact"] for r in results)
    assert sum(r["held"] for r in results) == len(list(ranks.model().parameters()))
    losses, weights = eager_clipped
    assert _loss_error(results, losses[ranks.STEPS // 2:]) <= TOL
    assert _weight_error(torch.load(tmp_path / "weights.pt"), weights) <= TOL


@pytest.mark.slow
def test_four_ranks_on_two_nodes_train_as_one_process_without_clipping(tmp_path):
    ranks.spawn("train", 4, str(tmp_path), nodes=2)
    losses, weights = ranks.eager(None)
    results = _results(tmp_path, 4)
    # a segment per node, shared by its two ranks; the weights cross between the nodes
    mapped = [r["mapped"] for r in results]
    assert None not in mapped and mapped[0] == mapped[1] != mapped[2] == mapped[3]
    assert [r["local"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert _loss_error(results, losses) <= TOL
    assert _weight_error(torch.load(tmp_path / "weights.pt"), weights) <= TOL


@pytest.mark.slow
def test_two_ranks_accumulating_micro_batches_train_as_one_process(eager_clipped, tmp_path):
    """Two micro-batches per step on each rank: each micro-batch's gradients are reduced and
    added into the holder's share of the sum."""
    ranks.spawn("train", 2, str(tmp_path), clip=ranks.CLIP, accum=2)
    losses, weights = eager_clipped
    assert _loss_error(_results(tmp_path, 2), losses) <= TOL
    assert _weight_error(torch.load(tmp_path / "weights.pt"), weights) <= TOL


@pytest.mark.slow
def test_a_rank_that_fails_is_named_by_the_others(tmp_path):
    with pytest.raises(Exception):
        ranks.spawn("fail", 2, str(tmp_path))
    error = (tmp_path / "rank0.error").read_text()
    segments = {(tmp_path / f"segment{r}").read_text() for r in range(2)}
    assert len(segments) == 1 and not any(os.path.exists(s) for s in segments)
    assert "DistributedError" in error and "rank 1 failed first" in error and "out of paper" in error, error


@pytest.mark.slow
def test_a_killed_rank_leaves_no_shared_copy_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_DIST_TIMEOUT", "15")
    with pytest.raises(RuntimeError, match="rank 0 exited"):
        ranks.spawn("fail", 2, str(tmp_path), kill=True)
    assert "DistributedError" in (tmp_path / "rank0.error").read_text()
    segment = (tmp_path / "segment1").read_text()
    assert segment == (tmp_path / "segment0").read_text() and not os.path.exists(segment)


def test_shares_are_contiguous_and_even_to_within_a_tensor():
    sizes = [7, 300, 5, 120, 120, 64, 64, 3, 250]
    for n in (1, 2, 3, 4):
        holders = shard_of(sizes, n)
        assert holders == sorted(holders) and set(holders) <= set(range(n))
        shares = [sum(s for s, h in zip(sizes, holders) if h == r) for r in range(n)]
        assert max(shares) - sum(sizes) / n <= max(sizes) / 2 + 1, shares


def test_no_group_and_a_group_of_one_train_as_one_process(tmp_path):
    assert ranks.compiled(None).data_parallel is None
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert ranks.compiled(None).data_parallel is None
        with pytest.raises(megacompile.errors.ArgumentError, match="ProcessGroup"):
            ranks.compiled(None, process_group="world")
    finally:
        torch.distributed.destroy_process_group()
