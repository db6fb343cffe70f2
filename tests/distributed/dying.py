"""Ranks of which one dies or hangs mid-run (spawned by launch(), gloo, the cpu backend), for
test_rank_failure.py: what the others say, how soon they stop, what the checkpoints hold."""
from __future__ import annotations

import json
import os
import signal
import time

import torch
import torch.multiprocessing as mp

from . import ranks

SAVE_AT = 3         # the checkpoint every run commits, after this step


def launch(scenario: str, size: int, folder: str, limit: float = 120.0, awaited: list[int] | None = None,
           **kw) -> list[tuple[int | None, float | None]]:
    """Run `scenario` of this file on `size` ranks: each rank's (exit code, time.time() it was seen
    exited), polled every 20 ms. Once the ranks `awaited` (default: all) have exited, or after
    `limit` seconds, those still running are killed and have (None, None)."""
    context = mp.start_processes(ranks._entry, args=(f"{__name__}:{scenario}", size, folder, kw), nprocs=size,
                                 join=False, start_method="spawn")
    exits: list = [(None, None)] * size
    awaited = list(range(size)) if awaited is None else awaited
    deadline = time.time() + limit
    while time.time() < deadline and any(exits[r][0] is None for r in awaited):
        for r, process in enumerate(context.processes):
            if exits[r][0] is None and process.exitcode is not None:
                exits[r] = (process.exitcode, time.time())
        time.sleep(0.02)
    for process in context.processes:
        if process.exitcode is None:
            process.kill()
        process.join()
    return exits


def die(rank: int, size: int, folder: str, how: str, at: int) -> dict:
    """Every rank trains on its slice, writing each step's loss as it goes (losses-<rank>.json),
    with a checkpoint after step SAVE_AT (keep_last=1, and state-<rank>.pt: the masters and
    moments it held then). Rank 1 ends at step `at`: "kill" SIGKILLs it before the step; "save"
    kills it inside a checkpoint after the step, once it wrote its share; "hang" leaves it alive
    in a sleep before the step. Before it ends it writes the time (ended-at). The collectives'
    timeouts are written as they were before the first step and before step `at` (timeouts-<rank>.json)."""
    engine = ranks.compiled(None)
    dp = engine.data_parallel.ranks
    waits = {"before": _waits(dp)}
    ckpt = os.path.join(folder, "ckpt")
    losses = []
    for i, ids in enumerate(ranks.batches()):
        step = i + 1
        if step == at:
            waits["paced"] = _waits(dp)
            _write(folder, f"timeouts-{rank}.json", waits)
            if rank == 1 and how in ("kill", "hang"):
                _end(folder, how)
        mine = ranks.rank_slice(ids, rank, size)
        losses.append(engine.step(idx=mine, targets=mine))
        _write(folder, f"losses-{rank}.json", losses)
        if step == SAVE_AT:
            engine.save_checkpoint(os.path.join(ckpt, f"step-{step}"), extra={"next": step}, keep_last=1)
            host = engine.host
            torch.save({f"{t}/{n}": host.view(t, n).clone() for n in host.slots if host.mine(n)
                        for t in ("master", "exp_avg", "exp_avg_sq")}, os.path.join(ckpt, f"state-{rank}.pt"))
        if step == at and how == "save":
            if rank == 1:
                _die_after_writing_share(folder)
            engine.save_checkpoint(os.path.join(ckpt, f"step-{step}"), extra={"next": step}, keep_last=1)
    return {}


def _waits(dp) -> dict:
    """The timeout the run holds, and the one its compute thread's gloo group was given (s)."""
    gloo = dp.main._get_backend(torch.device("cpu")).options._timeout
    return {"ranks": dp.timeout.total_seconds(), "gloo": gloo.total_seconds()}


def _end(folder: str, how: str) -> None:
    _write(folder, "ended-at", time.time())
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)


def _die_after_writing_share(folder: str) -> None:
    from megacompile.distributed import checkpoint
    write = checkpoint._write

    def write_then_die(where: str, file: str, tensors: dict) -> dict:
        written = write(where, file, tensors)
        _end(folder, "kill")
        return written
    checkpoint._write = write_then_die


def _write(folder: str, name: str, value) -> None:
    with open(os.path.join(folder, name), "w") as f:
        json.dump(value, f)
