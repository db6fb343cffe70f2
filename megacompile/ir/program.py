"""The schedule: one ordered list of nodes, transfers and frees included.

Compute (FORWARD, RECOMPUTE, BACKWARD, INFER), transfers (INPUT and PREFETCH host -> device,
OFFLOAD device -> host, and the WAIT that makes compute wait for one), host work (CLIP_GRADS,
OPTIMIZER_STEP), OUTPUT and FREE are ordinary nodes, so the printer, the verifier, the memory
simulator and the runtime all read one object. Evicting a stage's weights is a FREE of them (its
note says "evict"). Values are named device tensors (or bundles of them) with the storages they
hold; a value sharing storage with another (a saved view of a block's input) lists the same
storage key, so it keeps that storage alive exactly as the runtime would.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Op(enum.Enum):
    INPUT = "input"              # model inputs host -> device, and the loss seed
    PREFETCH = "prefetch"        # a stage's weights host -> device (h2d stream)
    WAIT = "wait"                # compute waits for the transfer of one value to finish
    FORWARD = "forward"          # run a stage's forward graph (outputs + saved values)
    RECOMPUTE = "recompute"      # run it again before the backward, same random state
    BACKWARD = "backward"        # run a stage's backward graph (gradients)
    INFER = "infer"              # forward without saving anything (inference plans)
    OFFLOAD = "offload"          # gradients device -> host, accumulated into the fp32 grads (d2h stream)
    CLIP_GRADS = "clip_grads"    # global gradient norm over all owners -> the scale every update uses
    OPTIMIZER_STEP = "optimizer_step"  # host AdamW over one stage's fp32 masters
    OUTPUT = "output"            # the loss / outputs device -> host
    FREE = "free"                # drop a device value (weights: an eviction)


STREAM_OF = {Op.PREFETCH: "h2d", Op.OFFLOAD: "d2h", Op.OPTIMIZER_STEP: "host", Op.CLIP_GRADS: "host"}
COMPUTE_OPS = (Op.FORWARD, Op.RECOMPUTE, Op.BACKWARD, Op.INFER)


@dataclass(frozen=True)
class Value:
    name: str
    parts: tuple[tuple[str, int], ...]   # (storage key, bytes) it keeps alive
    kind: str                            # weights | activation | saved | grads | input | output

    @property
    def nbytes(self) -> int:
        return sum(b for _, b in self.parts)


@dataclass(frozen=True)
class Node:
    op: Op
    stage: int | None = None
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()          # FREE: the values dropped
    origin: str = ""                     # the module path or stage the node came from
    note: str = ""                       # why the pass put it there
    transient: int = 0                   # compute: device bytes its graph needs above what is live
    micro: int = 0                       # the micro-batch it works on (layer-major accumulation)

    @property
    def stream(self) -> str:
        return STREAM_OF.get(self.op, "compute")


@dataclass
class Program:
    nodes: list[Node]
    values: dict[str, Value]
    stage_names: list[str]
    passes: list[str] = field(default_factory=list)    # the passes that built it, in order
    facts: dict = field(default_factory=dict)           # plan-level numbers passes attach

    def copy(self, nodes: list[Node] | None = None, **facts) -> "Program":
        return Program(list(self.nodes if nodes is None else nodes), dict(self.values),
                       list(self.stage_names), list(self.passes), {**self.facts, **facts})


# Value names. Stage s is an index into Program.stage_names.
def weights(s: int) -> str: return f"w{s}"
def act(s: int, k: int) -> str: return f"x{s}.{k}"
def saved(s: int) -> str: return f"saved{s}"
def restored_of(v: str) -> str: return f"h{v}"    # a value brought back from host memory
def restored(s: int) -> str: return restored_of(saved(s))
def grads(s: int) -> str: return f"g{s}"
def act_grad(s: int, k: int) -> str: return f"dx{s}.{k}"
def model_input(k: int) -> str: return f"in{k}"
def masters(s: int) -> str: return f"m{s}"      # host: owner s's fp32 masters (no device bytes)
def of_micro(v: str, m: int) -> str: return f"{v}@{m}"   # a value of micro-batch m (layer-major)
def base_name(v: str) -> str: return v.split("@", 1)[0]
SEED = "seed"
