"""Checkpoints of a data-parallel run: each rank writes the masters and moments it holds, in the
same folder format as one process (io/checkpoint.py), so any number of ranks, one included,
loads it (each rank reads all masters, for its whole compute copy, and the moments of its share).

    ckpt/step-1000/
        rank-00000-of-00004.safetensors   master/<name>, exp_avg/<name>, exp_avg_sq/<name> of the
        ...                               parameters rank 0 holds (whole tensors: shard.py)
        buffers.safetensors               written by rank 0
        manifest.json                     rank 0's, listing every rank's file with its sha256, and
                                          every rank's random state (rng_ranks)
        COMMITTED

Rank 0 makes the partial folder and names it to the others; every rank writes and fsyncs its
file; rank 0 writes the manifest once all have and commits the folder, and keep_last rotates the
run's older ones, with the one-process writer's own functions (io/checkpoint.py commit and
rotate): the same marker, renames and run identity, so the same guarantees. On several nodes the
folder must be on a file system they share.

A rank that dies or hangs while the others save makes them raise DistributedError (group.py) before
the commit: rank 0 removes the partial folder it made, and the checkpoint before it stays the
last committed one, which the error names for the resume. The collectives of a save and a load
wait the long timeout (timeouts.py): the ranks write and fsync at their disks' speeds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import TYPE_CHECKING, Any

import safetensors.torch

from ..errors import CheckpointError, DistributedError, MegacompileError
from ..io import checkpoint, durable, model_params, run_state, unbuilt
from ..io.source import CONST, MASTER, WEIGHT, PendingLoad

if TYPE_CHECKING:
    from ..state import TrainingState


class ShardedCheckpoints:
    """The checkpoint writer of a data-parallel run: io/checkpoint.py's LocalCheckpoints interface,
    each rank writing and reading its share."""

    def save(self, state: "TrainingState", path: str, *, extra: Any = None, keep_last: int | None = None,
             keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
        save(state, path, extra=extra, keep_last=keep_last, keep=keep, side_files=side_files)

    def load(self, state: "TrainingState", path: str, *, strict: bool = True) -> Any:
        return load(state, path, strict=strict)


def save(state: "TrainingState", path: str, extra: Any = None, keep_last: int | None = None,
         keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
    """`side_files`: rank 0's (io/checkpoint.py commit)."""
    ranks = state.data_parallel.ranks
    with ranks.patient():
        _save(state, path, extra, keep_last, keep, side_files)
    ranks.checkpoint = (os.fspath(path), state.steps_done)


def _save(state: "TrainingState", path: str, extra: Any, keep_last: int | None, keep: tuple[str, ...] = (),
          side_files: dict[str, str] | None = None) -> None:
    checkpoint.check_keep_last(keep_last)
    state.host_or_error()       # refuses before the first step, while there is nothing to save
    unbuilt.refuse_missing_weights(state)
    ranks = state.data_parallel.ranks
    if state.micro_batches % state.grad_accum:
        raise CheckpointError("a data-parallel checkpoint is written between optimizer steps: save after the "
                              f"step's last micro-batch (micro-batch {state.micro_batches % state.grad_accum} "
                              f"of {state.grad_accum} now)")
    extra = run_state.extra_json(extra)
    path = os.fspath(path)
    tmp = None
    if ranks.rank == 0:
        try:
            parent = durable.prepare_parent(path, "checkpoint")
            if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, checkpoint.MANIFEST)):
                raise CheckpointError(f"cannot write the checkpoint {path}: it is a folder of other files, not a "
                                      "checkpoint (which would be replaced); give a new path")
            durable.clean_leftovers(parent)
            tmp = durable.partial_path(path)
            os.makedirs(tmp)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            tmp = e
    tmp = ranks.gather_objects(tmp, "starting the checkpoint")[0]
    if isinstance(tmp, Exception):
        raise tmp
    try:
        _write_and_commit(state, path, tmp, extra, keep_last, keep, side_files)
    except DistributedError:
        if ranks.rank == 0:       # a rank died or hung: this save never commits
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_and_commit(state: "TrainingState", path: str, tmp: str, extra: Any, keep_last: int | None,
                      keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
    ranks, host = state.data_parallel.ranks, state.host_or_error()
    model_params.synchronize(state)
    written, error = {}, None
    try:
        file = f"rank-{ranks.rank:05d}-of-{ranks.size:05d}.safetensors"
        tables = {f"{t}/{n}": host.view(t, n) for n in host.slots if host.mine(n) for t in ("master", "exp_avg", "exp_avg_sq")}
        written.update(_write(tmp, file, tables))
        if ranks.rank == 0:
            written.update(_write(tmp, checkpoint.BUFFERS, {f"{CONST}/{n}": t for n, t in host.consts.items()}))
    except Exception as e:  # noqa: BLE001 - reported below, by every rank
        error = f"rank {ranks.rank}: {type(e).__name__}: {e}"
    reports = ranks.gather_objects((written, run_state.rng_state(), error), "writing the checkpoint")
    failed = [r[2] for r in reports if r[2]]
    outcome = None
    if ranks.rank == 0:
        try:
            if failed:
                raise CheckpointError(f"cannot write the checkpoint {path}: {'; '.join(failed)}")
            manifest = {"format": checkpoint.FORMAT, **run_state.counters(state),
                        "optimizer": run_state.optimizer_settings(state), "schedule": run_state.schedule_state(state),
                        "rng": reports[0][1], "rng_ranks": [r[1] for r in reports], "extra": extra,
                        "files": {k: v for r in reports for k, v in r[0].items()}}
            checkpoint.commit(tmp, path, manifest, side_files)
            ranks.checkpoint = (path, state.steps_done)     # committed, whatever the others do now
            checkpoint.rotate(path, manifest["run"], keep_last, keep)
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = e if isinstance(e, MegacompileError) else durable.write_failed("checkpoint", path, e)
    outcome = ranks.gather_objects(outcome, "committing the checkpoint")[0]
    if outcome is not None:
        raise outcome


def _write(folder: str, file: str, tensors: dict) -> dict:
    target = os.path.join(folder, file)
    safetensors.torch.save_file(tensors, target)
    durable.fsync_file(target)
    return {file: {"bytes": os.path.getsize(target), "sha256": durable.sha256_of(target)}}


def load(state: "TrainingState", path: str, strict: bool = False) -> Any:
    """io/checkpoint.py's checks and counters; the tensors filtered to what this rank keeps."""
    ranks = state.data_parallel.ranks
    with ranks.patient():
        extra = _load(state, path, strict)
    ranks.checkpoint = (os.fspath(path), state.steps_done)
    return extra


def _load(state: "TrainingState", path: str, strict: bool) -> Any:
    # The one-process reader's checks, against the model's parameters (every rank builds the
    # whole model); then this rank's share of the tensors arrives as a one-process load's
    # would: into the host state now if it exists, else when the first step builds it.
    reading = checkpoint.read(state, path, strict, layout=state.model_layout())
    checkpoint.restore(state, dataclasses.replace(reading, weights=ShareOfLoad(reading.weights)))
    with open(os.path.join(os.fspath(path), checkpoint.MANIFEST)) as f:
        saved = json.load(f).get("rng_ranks", [])
    if len(saved) == state.data_parallel.size:     # else every rank keeps rank 0's, as loaded
        run_state.restore_rng(saved[state.data_parallel.rank])
    return reading.extra


class ShareOfLoad:
    """A pending load of which this rank applies every weight (its compute copy is whole) and the
    optimizer tables of the parameters it holds."""

    def __init__(self, pending: PendingLoad):
        self.pending = pending

    def apply(self, host, model=None) -> None:
        p = self.pending
        items = [it for it in p.items if it.table in (WEIGHT, MASTER, CONST) or host.mine(it.name)]
        # every table was checked present for every parameter before this (io/checkpoint.py)
        PendingLoad(items, own_buffers=p.own_buffers, own_params=p.own_params, needs=(MASTER,),
                    describe=p.describe).apply(host, model)
