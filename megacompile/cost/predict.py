"""Predict a step's time by playing the schedule on its streams.

Four streams run side by side: compute (stage graphs), h2d (prefetches), d2h (offloads) and
host (optimizer updates, clipping); a fifth, network, with data parallelism (the gradients'
reduce, between the backward and the offload). Issuing any node costs the compute stream the profile's
fixed per-node overhead. Each node starts when its stream is free and what it waits
for is done; a WAIT stalls the compute stream until its transfer or update ends. The schedule is
played twice and the second step is reported, so updates left running by one step delay the
next one's prefetches as they do in a real run (the steady state).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..capture import CapturedModel
from ..ir.program import COMPUTE_OPS, Op, Program
from .estimate import graph_cost
from .hardware import HardwareProfile
from .model_flops import model_flops as count_model_flops


@dataclass(frozen=True)
class StepPrediction:
    step_s: float               # steady-state time of one step
    compute_s: float            # time the compute stream is busy
    exposed_s: float            # time the compute stream waits on transfers and updates
    h2d_s: float                # busy time of each other stream
    d2h_s: float
    host_s: float
    hardware_flops: float       # FLOPs the device executes, recompute included
    model_flops: float          # 6ND for the trained parameters, 4ND or 2ND for frozen ones (model_flops.py)
    tokens: int
    network_s: float = 0.0      # data parallelism: the gradients' reduce
    exposed_update_s: float = 0.0   # the part of exposed_s spent waiting on the host's AdamW updates

    @property
    def exposed_transfer_s(self) -> float:
        """The part of exposed_s spent waiting on copies (and collectives), not on updates."""
        return self.exposed_s - self.exposed_update_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s

    @property
    def tflops_6nd(self) -> float:
        return self.model_flops / self.step_s / 1e12

    @property
    def hardware_tflops(self) -> float:
        return self.hardware_flops / self.step_s / 1e12

    @property
    def hardware_flops_per_model_flop(self) -> float:
        return self.hardware_flops / self.model_flops if self.model_flops else float("nan")

    def to_dict(self) -> dict:
        return {"predicted_step_s": self.step_s, "predicted_compute_s": self.compute_s,
                "predicted_exposed_s": self.exposed_s, "predicted_exposed_transfer_s": self.exposed_transfer_s,
                "predicted_exposed_update_s": self.exposed_update_s, "predicted_tokens_per_s": self.tokens_per_s,
                "predicted_tflops_6nd": self.tflops_6nd, "predicted_hardware_tflops": self.hardware_tflops,
                "hardware_flops_per_model_flops": self.hardware_flops_per_model_flop,
                "h2d_busy_s": self.h2d_s, "d2h_busy_s": self.d2h_s, "host_busy_s": self.host_s,
                "network_busy_s": self.network_s}


def compute_seconds(captured: CapturedModel, node, hw: HardwareProfile) -> tuple[float, float]:
    t = captured.stages[node.stage].template
    program = {Op.FORWARD: t.forward, Op.RECOMPUTE: t.forward, Op.BACKWARD: t.backward,
               Op.INFER: t.inference}[node.op]
    cost = graph_cost(program, hw, captured.compute_dtype)
    return cost.seconds, cost.flops


def predict(program: Program, captured: CapturedModel, hw: HardwareProfile,
            disk_bytes_per_param: float = 0.0, spans: list | None = None, ranks: int = 1,
            network_bw: float = 0.0) -> StepPrediction:
    """`disk_bytes_per_param`: host state the disk tier holds (8 B/param moments, 12 with masters),
    read and written once per update; the update of an owner takes the longer of its AdamW and
    its disk traffic (the tier reads ahead and writes behind, so the two overlap).

    `spans`, when given, receives the reported step's timeline: (node index, stream, start, end)
    in seconds from the step's start, one per node on its stream ("compute" for the compute
    thread's nodes, their issue overhead included), and a "disk" entry beside each update that
    moves disk-tier bytes.

    `ranks` > 1: one rank of a data-parallel run (megacompile/distributed), at `network_bw` B/s
    per rank (NCCL's bus bandwidth). A stage's gradients are summed over the ranks on the network
    stream once its backward made them (distributed/grad_reduce.py: a reduce per tensor, to the
    rank that holds it, so all of the bytes cross the ring's links, against (ranks-1)/ranks for
    an even reduce-scatter), and 1/ranks of them then go to the host after that sum. Each
    owner's update covers 1/ranks of its parameters and then all-gathers the new compute copy
    ((ranks-1)/ranks of its bytes) on the host stream."""
    gather = (ranks - 1) / ranks * captured.compute_dtype.itemsize / network_bw if ranks > 1 else 0.0
    owned = _owned_params(captured)
    free = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0, "network": 0.0}
    busy = {k: 0.0 for k in free}
    ready: dict[str, float] = {}
    exposed = exposed_update = flops = 0.0
    ends = []
    costs: dict[tuple, tuple[float, float]] = {}    # per (stage, op): every block's nodes, played twice
    for play in range(2):
        busy = {k: 0.0 for k in free}
        exposed = exposed_update = flops = 0.0
        start_of_step = free["compute"]
        record = spans if play == 1 else None
        for i, n in enumerate(program.nodes):
            issued = free["compute"]
            free["compute"] += hw.node_overhead_s
            if n.op in COMPUTE_OPS:
                key = (n.stage, n.op)
                if key not in costs:
                    costs[key] = compute_seconds(captured, n, hw)
                seconds, f = costs[key]
                free["compute"] += seconds
                busy["compute"] += seconds
                flops += f
            elif n.op is Op.WAIT:
                until = ready.get(n.reads[0], 0.0)
                if until > free["compute"]:
                    exposed += until - free["compute"]
                    if program.values[n.reads[0]].kind == "host":     # an owner's masters: its update
                        exposed_update += until - free["compute"]
                    free["compute"] = until
            elif n.op in (Op.PREFETCH, Op.OFFLOAD, Op.OPTIMIZER_STEP, Op.CLIP_GRADS):
                stream = n.stream
                after = 0.0
                if n.op is Op.PREFETCH:
                    seconds = program.values[n.writes[0]].nbytes / hw.h2d_bw
                elif n.op is Op.OFFLOAD and ranks > 1 and program.values[n.reads[0]].kind == "grads":
                    nbytes = program.values[n.reads[0]].nbytes
                    reduce_begin = max(free["compute"], free["network"])
                    free["network"] = after = reduce_begin + nbytes / network_bw
                    busy["network"] += nbytes / network_bw
                    if record is not None:
                        record.append((i, "network", reduce_begin - start_of_step, after - start_of_step))
                    seconds = nbytes / ranks / hw.d2h_bw
                elif n.op is Op.OFFLOAD:
                    seconds = program.values[n.reads[0]].nbytes / hw.d2h_bw
                elif n.op is Op.OPTIMIZER_STEP:
                    params = owned.get(n.stage, 0)
                    disk = params * disk_bytes_per_param
                    disk_s = disk / hw.disk_read_bw + disk / hw.disk_write_bw
                    seconds = max(params / ranks / hw.host_adam_params_per_s, disk_s) + params * gather
                else:
                    seconds = 4 * sum(owned.values()) / ranks / hw.host_bw
                begin = max(free["compute"], free[stream], after)
                free[stream] = begin + seconds
                busy[stream] += seconds
                for v in n.writes + n.reads:
                    ready[v] = free[stream]
                if record is not None:
                    record.append((i, stream, begin - start_of_step, free[stream] - start_of_step))
                    if n.op is Op.OPTIMIZER_STEP and disk:
                        record.append((i, "disk", begin - start_of_step, begin + disk_s - start_of_step))
                continue
            elif n.op is Op.INPUT:
                seconds = sum(m.nbytes for m in captured.inputs) / hw.h2d_bw
                free["compute"] += seconds
            if record is not None:
                record.append((i, "compute", issued - start_of_step, free["compute"] - start_of_step))
        ends.append(free["compute"] - start_of_step)
    # 6ND with N the trained parameters whose matmuls a token runs (a routed expert layer counts top_k
    # of its experts, an embedding lookup none), and 4ND or 2ND for the frozen ones (model_flops.py).
    tokens = captured.inputs[0].shape[0] * (captured.inputs[0].shape[1] if len(captured.inputs[0].shape) > 1 else 1)
    tokens *= program.facts.get("micro_batches", 1)     # a layer-major program runs every micro-batch of a step
    model_flops = count_model_flops(captured, tokens)
    return StepPrediction(ends[-1], busy["compute"], exposed, busy["h2d"], busy["d2h"], busy["host"],
                          flops, model_flops, tokens, network_s=busy["network"], exposed_update_s=exposed_update)


def _owned_params(captured: CapturedModel) -> dict[int, int]:
    from ..capture.model_graph import owners
    owner = owners(captured)[0]
    counts: dict[int, int] = {}
    for name, s in owner.items():
        counts[s] = counts.get(s, 0) + captured.state[name].numel
    return counts
