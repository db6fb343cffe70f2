"""What a plan costs per rank when R GPUs run it data-parallel, and the throughput it predicts.

Every rank runs the same plan, so the device memory per rank is the plan's. Host RAM per rank:
the whole compute copy, and 1/R of the masters, AdamW moments and gradient sums ((12 + 4 [+ the
landing buffer]) B/param / R, shard.py); the node holds R/nodes ranks. The step is the
single-GPU schedule played again (cost/predict.py) with each stage's gradients summed over the
ranks on a network stream as the backward makes them, 1/R of them offloaded after that, and each
owner's update covering 1/R of its parameters ahead of the all-gather of its new weights, on the
host stream beside compute: the intra-node bandwidth on one node, the inter-node one across
several (a ring collective runs at its slowest link).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.host_memory import Placement, owner_layout, owner_sizes
from ..cost.predict import StepPrediction, predict
from ..errors import ArgumentError
from ..ir.printer import fmt_bytes
from ..plan import Plan


@dataclass(frozen=True)
class ScaleOut:
    gpus: int
    nodes: int
    device_bytes: int             # per rank: the plan's peak
    host_bytes: int               # per rank: host state and offloaded activations
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
            f"({fmt_bytes(per_node * self.host_bytes)} per node of {per_node})",
            f"  predicted      {p.step_s * 1e3:.4g} ms/step: {self.tokens_per_s:,.0f} tok/s in all, "
            f"{p.tokens_per_s:,.0f} per GPU, {p.tflops_6nd:.3g} TFLOPS per GPU (6ND); collectives at "
            f"{self.network_bw / 1e9:.4g} GB/s per rank ({self.link}), the gradients' reduce "
            f"{p.network_s * 1e3:.4g} ms of the step, beside the backward",
        ])

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "nodes": self.nodes, "device_bytes_per_rank": self.device_bytes,
                "host_bytes_per_rank": self.host_bytes, "network_bw": self.network_bw,
                "predicted_tokens_per_s_total": self.tokens_per_s, **self.prediction.to_dict()}


def scale_out(plan: Plan, gpus: int, nodes: int = 1, network_bw: float | None = None) -> ScaleOut:
    """`network_bw` (B/s per rank) overrides the hardware profile's intra- or inter-node figure."""
    if not isinstance(gpus, int) or not isinstance(nodes, int) or gpus < 1 or nodes < 1 or gpus % nodes:
        raise ArgumentError(f"--gpus is the number of GPUs in all and --nodes the machines they sit in, "
                            f"{gpus} GPUs on {nodes} nodes: give --gpus a multiple of --nodes")
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
    sizes, summed, frozen = owner_sizes(plan.captured)
    dtype = plan.captured.compute_dtype
    host = frozen + plan.stash_bytes
    for owner, numel in sizes.items():
        layout = owner_layout(dtype, plan.grad_accum, owner in summed, Placement())
        host += numel * (dtype.itemsize + (12 + 4 + layout.landing_dtype.itemsize * layout.landing) / gpus)
    prediction = predict(plan.program, plan.captured, hw, ranks=gpus, network_bw=network_bw)
    return ScaleOut(gpus, nodes, plan.predicted_peak_bytes, int(host), network_bw, link, prediction)
