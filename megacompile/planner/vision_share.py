"""The vision tower's share of a planned step, beside the language model's.

The tower's patch embedding runs in the prologue, its layers are blocks of their own templates,
and its last norm, the projector and the merge of the image features into the token embeddings
run in the bridge before the decoder's blocks (docs/families.md); the language model is the
decoder's blocks and the epilogue. The tower's blocks are vision whole; the vision side of the
prologue and of the bridge is found by data flow in their graphs (`_stage_share`). The vision
seconds are those parts of the predicted compute stream; the vision device bytes at the predicted
peak are those parts of the weights, gradients and saved values live there. The running node's
working set at the peak is reported on its own.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from ..capture.split import ancestors
from ..cost.estimate import node_seconds
from ..ir.printer import fmt_bytes, fmt_seconds
from ..ir.program import COMPUTE_OPS, Op
from ..ir.stage_program import StageProgram
from .image_inputs import ImageSignature


@dataclass(frozen=True)
class VisionShare:
    images: ImageSignature
    vision_params: int          # parameters of the tower and projector
    language_params: int
    vision_s: float             # predicted compute seconds of the step on the vision side
    language_s: float           # the rest of the compute stream: token embedding, blocks, epilogue
    vision_peak_bytes: int      # device bytes the vision side holds at the predicted peak
    language_peak_bytes: int
    working_set_bytes: int      # the running node's working set at the peak
    working_set_of: str         # that node, in words

    @property
    def time_share(self) -> float:
        return self.vision_s / max(self.vision_s + self.language_s, 1e-30)

    @property
    def memory_share(self) -> float:
        """Of the predicted peak (the working set included)."""
        return self.vision_peak_bytes / max(self.vision_peak_bytes + self.language_peak_bytes
                                            + self.working_set_bytes, 1)

    def lines(self) -> list[str]:
        return [f"  images         {self.images.describe()}",
                f"  vision tower   {self.vision_params:,} parameters (tower and projector) beside the language "
                f"model's {self.language_params:,}; {fmt_seconds(self.vision_s)} of {fmt_seconds(self.vision_s + self.language_s)}"
                f" compute per step ({self.time_share:.1%}); {fmt_bytes(self.vision_peak_bytes)} of the device peak "
                f"({self.memory_share:.1%}) against the language model's {fmt_bytes(self.language_peak_bytes)} and the "
                f"{self.working_set_of}'s working set {fmt_bytes(self.working_set_bytes)}"]

    def to_json(self) -> dict:
        return {"images": self.images.to_json(), "vision_params": self.vision_params,
                "language_params": self.language_params, "vision_s": self.vision_s, "language_s": self.language_s,
                "time_share": self.time_share, "vision_peak_bytes": self.vision_peak_bytes,
                "language_peak_bytes": self.language_peak_bytes, "working_set_bytes": self.working_set_bytes,
                "memory_share": self.memory_share}


def vision_share(plan, images: ImageSignature, image_inputs: list[int]) -> VisionShare:
    """`image_inputs`: the indexes of the model's inputs that hold images (pixel values, masks)."""
    captured = plan.captured
    # The vision side: parameters outside the language model (whose blocks are the decoder stack)
    # that neither its blocks nor the epilogue read (the head is the epilogue's), unused ones (a
    # tower's pooling head) included: the host holds them all.
    root = captured.block_path.rsplit(".", 1)[0] + "." if captured.block_path else ""
    towers = {s for s, st in enumerate(captured.stages) if st.template.kind == "block" and captured.in_tower(st.origin)}
    decoder = next((s for s, st in enumerate(captured.stages) if st.template.kind == "block" and s not in towers),
                   len(captured.stages))
    later = {n for stage in captured.stages[decoder:] for n in stage.params}
    numel = {n: e.numel for n, e in captured.state.items() if not e.is_buffer}
    vision_names = {n for n in numel if not n.startswith(root) and n not in later}
    vision_params = sum(v for n, v in numel.items() if n in vision_names)
    hw, dtype = plan.hardware, captured.compute_dtype
    # Per stage: the vision part of each compute node's seconds, and of each kind of bytes. A
    # tower's blocks are vision whole; the prologue and the bridge in part; the rest not at all.
    # (share of each compute node's seconds, share of each kind of bytes; None: all of them).
    parts: dict[int, tuple[dict, dict | None]] = {s: ({op: 1.0 for op in COMPUTE_OPS}, None) for s in towers}
    for s, stage in enumerate(captured.stages[:decoder]):
        if s not in towers:
            vision_act = [(p.stage == -1 and p.index in image_inputs) or p.stage in towers for p in stage.inputs]
            parts[s] = _stage_share(stage, [n in vision_names for n in stage.params], vision_act, hw, dtype)
    vision_s = language_s = 0.0
    for i, stream, start, end in plan.predicted_spans():
        node = plan.program.nodes[i]
        if stream != "compute" or node.op not in COMPUTE_OPS:
            continue
        part = parts[node.stage][0].get(node.op, 0.0) if node.stage in parts else 0.0
        vision_s += (end - start) * part
        language_s += (end - start) * (1 - part)

    vision_bytes = language_bytes = 0
    live, working = _live_at_peak(plan)
    for name, nbytes, node in live:
        kind = plan.program.values[name].kind
        part = 0.0
        if node.stage in parts:
            kinds = parts[node.stage][1]
            part = 1.0 if kinds is None else kinds.get(kind, 0.0)
        vision_bytes += round(nbytes * part)
        language_bytes += nbytes - round(nbytes * part)
    peak = plan.program.nodes[plan.curve.peak_index]
    where = plan.program.stage_names[peak.stage] if peak.stage is not None else ""
    return VisionShare(images, vision_params, sum(numel.values()) - vision_params, vision_s, language_s,
                       vision_bytes, language_bytes, working, f"{peak.op.value} {where}".strip())


def _stage_share(stage, vision_slot: list[bool], vision_act: list[bool], hw, dtype) -> tuple[dict, dict]:
    """The vision part of a stage that holds some of each side (the prologue, the bridge), by data
    flow in its graphs: in the forward, every op that reads (through any chain) a vision parameter
    or input; in the backward, every op that feeds a vision parameter's gradient or reads a vision
    parameter. Seconds are the ops' roofline seconds (cost/estimate.py); bytes are the share of
    the stage's weights, gradients and saved values."""
    t = stage.template
    ran = t.forward or t.inference          # a forward-only plan runs the inference graph
    forward = _forward_nodes(ran, vision_slot + vision_act)
    graphs = [(Op.FORWARD, ran, forward), (Op.RECOMPUTE, ran, forward), (Op.INFER, ran, forward)]
    if t.backward is not None:
        graphs.append((Op.BACKWARD, t.backward, _backward_nodes(t, vision_slot)))
    share = {}
    for op, program, nodes in graphs:
        costs = [node_seconds(n, hw, dtype) for n in program.body if n.op == "call_function"]
        mine = sum(node_seconds(n, hw, dtype) for n in nodes)
        share[op] = mine / max(sum(costs), 1e-30)
    slot_bytes = [p.meta.nbytes for p in t.params]
    saved_nodes = list(ran.output_node.args[0])[len(t.outputs):]
    return share, {"weights": _fraction(slot_bytes, vision_slot),
                   "grads": _fraction([b for b, p in zip(slot_bytes, t.params) if p.trainable],
                                      [v for v, p in zip(vision_slot, t.params) if p.trainable]),
                   "saved": _fraction([s.nbytes for s in t.saved], [n in forward for n in saved_nodes])}


def _fraction(nbytes: list[int], vision: list[bool]) -> float:
    return sum(b for b, v in zip(nbytes, vision) if v) / max(sum(nbytes), 1)


def _forward_nodes(program: StageProgram, vision_inputs: list[bool]) -> set[fx.Node]:
    """The forward's ops that read a vision placeholder, directly or through other ops."""
    reached = {p for p, v in zip(program.placeholders, vision_inputs) if v}
    for node in program.body:
        if any(a in reached for a in node.all_input_nodes):
            reached.add(node)
    return {n for n in reached if n.op == "call_function"}


def _backward_nodes(t, vision_slot: list[bool]) -> set[fx.Node]:
    """The backward's ops that feed a vision parameter's gradient or read a vision parameter."""
    program = t.backward
    grads = list(program.output_node.args[0])[:len(t.grad_params)]
    wanted = [g for g, i in zip(grads, t.grad_params) if vision_slot[i] and isinstance(g, fx.Node)]
    feeding = ancestors(wanted)
    params = [p for p, i in zip(program.placeholders, t.bwd_params) if vision_slot[i]]
    return {n for n in feeding | set(_forward_nodes(program, [p in params for p in program.placeholders]))
            if n.op == "call_function"}


def _live_at_peak(plan) -> tuple[list, int]:
    """(value, bytes, the node that wrote it) for each storage live at the predicted peak, as the
    simulation counts them (ir/simulate.py), and the running node's working set there (0 where the
    peak is what the node leaves)."""
    program, i = plan.program, plan.curve.peak_index
    holders: dict = {}        # storage -> {value: the node that wrote it}
    sizes: dict = {}

    def apply(node) -> None:
        if node.op is Op.FREE:
            for v in node.frees:
                for key, _ in program.values[v].parts:
                    held = holders.get(key)
                    if held is not None:
                        held.pop(v, None)
                        if not held:
                            del holders[key]
        else:
            for v in node.writes:
                for key, nbytes in program.values[v].parts:
                    holders.setdefault(key, {})[v] = node
                    sizes.setdefault(key, nbytes)

    for node in program.nodes[:i]:
        apply(node)
    peak, working = program.nodes[i], program.nodes[i].transient
    if peak.op is not Op.FREE and plan.curve.live_after[i] == plan.curve.peak:
        apply(peak)
        working = 0
    out = []
    for key, held in holders.items():
        name, node = next(iter(held.items()))
        out.append((name, sizes[key], node))
    return out, working
