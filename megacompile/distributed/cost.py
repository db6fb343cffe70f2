"""What a plan costs per rank when R GPUs run it data-parallel, and the throughput it predicts.

Every rank runs the same plan, so the device memory per rank is the plan's. Host RAM
(cost/host_shards.py): per rank 1/R of the masters, AdamW moments and gradient sums ((12 + 4
[+ the landing buffer]) B/param / R, shard.py); per node one compute copy its R/nodes ranks
share. The step is the single-GPU schedule played again (cost/predict.py) with each stage's
gradients summed over the ranks on a network stream as the backward makes them, 1/R of them
offloaded after that, and each owner's update covering 1/R of its parameters ahead of the
all-gather of its new weights, on the host stream beside compute: the intra-node bandwidth on
one node, the inter-node one across
several (a ring collective runs at its slowest link).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.host_shards import sharded_host_cost
from ..cost.predict import StepPrediction, predict
from ..errors import ArgumentError
from ..ir.printer import fmt_bytes, fmt_rate
from ..planner import Plan


@dataclass(frozen=True)
class ScaleOut:
    gpus: int
    nodes: int
    device_bytes: int             # per rank: the plan's peak
    host_bytes: int               # per rank: host state (1/L of the node's copy) and offloaded activations
    node_host_bytes: int          # per node: one compute copy, its ranks' shares and activations
    network_bw: float             # B/s per rank the collectives were costed at
    link: str
    prediction: StepPrediction    # one rank's step

    @property
    def tokens_per_s(self) -> float:
        return self.gpus * self.prediction.tokens_per_s

    def summary(self) -> str:
        p = self.prediction
        per_node = self.gpus // self.nodes
        return "\n".join([
            f"  data parallel  {self.gpus} GPUs on {self.nodes} node{'s' * (self.nodes > 1)}, the same plan on each, "
            f"host optimizer state sharded 1/{self.gpus} per rank",
            f"  per rank       device {fmt_bytes(self.device_bytes)}; host {fmt_bytes(self.host_bytes)} "
            f"({fmt_bytes(self.node_host_bytes)} per node of {per_node}: one shared compute copy)",
            f"  predicted      {p.step_s * 1e3:.4g} ms/step: {self.tokens_per_s:,.0f} tok/s in all, "
            f"{p.tokens_per_s:,.0f} per GPU, {fmt_rate(p.tflops_6nd)} TFLOPS per GPU (6ND); collectives at "
            f"{self.network_bw / 1e9:.4g} GB/s per rank ({self.link}), the gradients' reduce "
            f"{p.network_s * 1e3:.4g} ms of the step, beside the backward",
        ])

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "device_bytes_per_rank": self.device_bytes,
                "host_bytes_per_rank": self.host_bytes, "host_bytes_per_node": self.node_host_bytes,
                "network_bw": self.network_bw,
                "predicted_tokens_per_s_total": self.tokens_per_s, **self.prediction.to_dict()}


def check_gpus(gpus: int, nodes: int) -> None:
    if not isinstance(gpus, int) or not isinstance(nodes, int) or gpus < 1 or nodes < 1 or gpus % nodes:
        raise ArgumentError(f"--gpus is the number of GPUs in all and --nodes the machines they sit in, "
                            f"{gpus} GPUs on {nodes} nodes: give --gpus a multiple of --nodes")


def scale_out(plan: Plan, gpus: int, nodes: int = 1, network_bw: float | None = None) -> ScaleOut:
    """`network_bw` (B/s per rank) overrides the hardware profile's intra- or inter-node figure."""
    check_gpus(gpus, nodes)
    if plan.hardware is None:
        raise ArgumentError("a data-parallel prediction needs a hardware profile (--hardware)")
    hw = plan.hardware
    link = "inter-node" if nodes > 1 else "intra-node"
    if network_bw is None:
        network_bw = hw.inter_node_bw if nodes > 1 else hw.intra_node_bw
    elif network_bw <= 0:
        raise ArgumentError(f"--network-bandwidth is GB/s per rank, above 0; got {network_bw / 1e9:g}")
    else:
        link = "given"
    per_node = gpus // nodes
    host = sharded_host_cost(plan.captured, plan.captured.compute_dtype, plan.grad_accum, gpus, per_node)
    prediction = predict(plan.program, plan.captured, hw, ranks=gpus, network_bw=network_bw)
    return ScaleOut(gpus, nodes, plan.predicted_peak_bytes, host.ram_bytes + plan.stash_bytes,
                    host.node_bytes + per_node * plan.stash_bytes, network_bw, link, prediction)
