"""How one call's --minutes is shared by its systems: each is started with at least the time it
needs, or not at all. Started short, a system is killed halfway and its row is lost with the time
it took (the first lease lost DeepSpeed's row so: 105 s given, more than 370 s needed); left out,
its row says to run it in a call of its own, which a runbook can (benchmarks/peers/lease.sh)."""
from __future__ import annotations

from .workload import Workload

# Measured at the Llama-3.2-3B shape, 4 x 2048 tokens (docs/gpu.md; 16 host cores), with a margin:
# the set-up (model, host state, process group; DeepSpeed's initialize, its CPUAdam op built if it
# is not yet) and one step. megacompile's from the first H100 lease (93 s for its set-up and 3
# steps, the weights' writing included); FSDP2's (fused host AdamW: 74 s to build and shard, 1.77 s
# a step) and DeepSpeed's (46 s to its first step under zero.Init, 2.38 s a step) from the H200
# lease. The first lease had DeepSpeed's at 300 s and 10 s, bounds from a run that did not finish.
REFERENCE_PARAMETERS, REFERENCE_TOKENS = 3.6e9, 4 * 2048
SETUP_S = {"megacompile": 90.0, "fsdp2": 90.0, "deepspeed": 60.0}
STEP_S = {"megacompile": 1.4, "fsdp2": 1.8, "deepspeed": 2.4}
FLOOR_S = 20.0          # a process that imports torch and builds a toy


def need_s(system: str, workload: Workload) -> float:
    """Seconds `system` needs for `workload`: set-up scaled by the parameters, steps by the 6ND work."""
    scale = workload.parameters / REFERENCE_PARAMETERS
    steps = workload.warmup + workload.steps + (1 if system == "megacompile" else 0)   # its host-optimizer step
    work = scale * workload.tokens_per_step / REFERENCE_TOKENS
    return max(FLOOR_S, SETUP_S[system] * scale + STEP_S[system] * work * steps)


def share_s(needs: list[float], left: float, first: bool) -> float | None:
    """Seconds for the next of the systems still to run (`needs`, in order), with `left` seconds
    left of the call: its need, or its part of the time left in proportion to the needs when that
    is more; None when less than its need is left, unless it is the call's first (it then gets
    all that is left: a call of its own)."""
    if left < needs[0] and not first:
        return None
    return min(left, max(needs[0], left * needs[0] / sum(needs)))

