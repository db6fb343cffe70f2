"""How one call's --minutes is shared by its systems: each is started with at least the time it
needs, or not at all. Started short, a system is killed halfway and its row is lost with the time
it took (the first lease lost DeepSpeed's row so: 105 s given, more than 370 s needed); left out,
its row says to run it in a call of its own, which a runbook can (benchmarks/peers/lease.sh)."""
from __future__ import annotations

from .workload import Workload

# Measured on the first H100 lease (docs/gpu.md, 2026-11-23; 16 host cores) at the Llama-3.2-3B
# shape, 4 x 2048 tokens: the set-up (model, host state, process group; DeepSpeed's initialize,
# its CPUAdam op built if it is not yet) and one step. DeepSpeed's are bounds (it did not finish
# its set-up and 5 steps in 370 s); its step is ZeRO-3 offload's ~40 TFLOPS at 14B, halved.
REFERENCE_PARAMETERS, REFERENCE_TOKENS = 3.6e9, 4 * 2048
SETUP_S = {"megacompile": 90.0, "fsdp2": 170.0, "deepspeed": 300.0}
STEP_S = {"megacompile": 1.4, "fsdp2": 6.3, "deepspeed": 10.0}
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

