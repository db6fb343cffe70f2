"""How every system of the peers bench is timed and measured, the same way for each: warmup steps,
then timed steps back to back; the memory it held; the allocator's retries in the timed steps."""
from __future__ import annotations

import resource
import time

import torch

from .workload import Workload

_STARTED = time.perf_counter()


def say(what: str) -> None:
    """A timestamped line in the system's log (bench/peers.py keeps it): a system stopped at its
    time limit shows how far it got."""
    print(f"[{time.perf_counter() - _STARTED:8.1f} s] {what}", flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _alloc_retries(device: str) -> int:
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if device.startswith("cuda") else 0


def timed(workload: Workload, step) -> dict:
    """Warmup steps, then the timed ones back to back with one synchronize at the end (as a training
    loop runs them); losses of every step. The allocator's retries (each one a flush of its cache
    at the cap) are counted over the timed steps and given per step: the process's total also
    holds the warmup's and whatever ran before."""
    batches = workload.batches()
    say("first step")
    losses = [step(ids, labels) for ids, labels in batches[:workload.warmup]]
    say(f"{workload.warmup} warmup steps done")
    sync(workload.device)
    retries = _alloc_retries(workload.device)
    start = time.perf_counter()
    losses += [step(ids, labels) for ids, labels in batches[workload.warmup:]]
    sync(workload.device)
    seconds = (time.perf_counter() - start) / workload.steps
    retries = _alloc_retries(workload.device) - retries
    losses = [float(x) for x in losses]
    say(f"{workload.steps} timed steps done")
    out = {"losses": losses, "step_s": seconds, "tokens_per_s": workload.tokens_per_step / seconds,
           "tflops_6nd": 6 * workload.flop_parameters * workload.tokens_per_step / seconds / 1e12}
    if workload.device.startswith("cuda"):
        out["alloc_retries_per_step"] = retries / workload.steps
    return out


def memory(device: str) -> dict:
    """Peak host RSS of the process, and on a GPU the caching allocator's peaks and its retries
    since the process began (num_alloc_retries; per timed step: timed())."""
    out = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.startswith("cuda"):
        stats = torch.cuda.memory_stats()
        out.update(max_memory_reserved_bytes=torch.cuda.max_memory_reserved(),
                   max_memory_allocated_bytes=torch.cuda.max_memory_allocated(),
                   num_alloc_retries=stats.get("num_alloc_retries", 0))
    return out
