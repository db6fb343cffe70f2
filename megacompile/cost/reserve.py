"""What the plan keeps free on a real device: the bytes the ledger cannot see.

The ledger counts every tensor an op returns. A GPU also holds memory no op returns:
  workspaces     cuBLAS and cuBLASLt take a workspace per handle and stream from the caching
                 allocator (32 MiB each on sm_90 by default; CUBLAS_WORKSPACE_CONFIG changes it);
  op scratch     what an op allocates inside itself and frees before it returns: SDPA's backward
                 keeps a float32 dq accumulator and a row-sum buffer (FlashAttention: 4 B per
                 query element, 1.25 GiB at 16 x 4096 tokens with 40 x 128 heads; under GQA its
                 dk and dv for every query head too); sliding-window attention where its
                 kernels do not run (float32: megacompile/attention/window.py's reference holds
                 the heads in float32 and a chunk's scores); the gated delta rule's backward
                 operator, which runs the rule again under autograd (cost/delta_rule.py); a host->device
                 copy that casts and lands in a non-contiguous slot stages a converted copy. Only
                 one op runs at a time on the compute stream, so the largest one is reserved;
  fragmentation  the caching allocator rounds blocks (to 512 B, 2 MiB segments) and cannot always
                 reuse freed blocks for other sizes: a fraction of the budget.

The runtime serves every tensor of the step from the device arena the plan laid out
(passes/arena.py, runtime/arena.py): the plan fits when the arena fits `budget - workspaces - op
scratch`, its packing known to the byte. What the caching allocator still serves is only what the
arena does not hold: the workspaces, op scratch, and the results of ops with no out= form (attention,
the fused kernels), which are copied into their arena tensors as they return, so such an op holds
its results twice for a moment: that is op scratch too. The fragmentation share is of those alone,
not of the budget. The allocator is capped at the budget itself. Workspaces and the fragmentation
share come from the hardware profile (HardwareProfile.workspace_bytes, .fragmentation), which
`megacompile calibrate` can overwrite and `python -m megacompile.acceptance` checks against torch's
own peak. The simulated device (backend "cpu", and the measured cpu profile) counts exactly what it
allocates, and reserves nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.reference import reference_scratch_bytes
from ..capture import CapturedModel
from ..ir.stage_ops import copied_result_bytes
from ..kernels import embedding
from .delta_rule import backward_scratch as delta_rule_scratch
from .hardware import HardwareProfile

# Attention backward ops with an fp32 accumulator the size of the query (float32 dq, [B, H, S, D])
# plus one float per query row (softmax_d / delta, [B, H, S]).
_ATTENTION_BACKWARD = ("_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_efficient_attention_backward",
                       "_scaled_dot_product_cudnn_attention_backward", "_flash_attention_backward",
                       "_efficient_attention_backward", "_scaled_dot_product_flash_attention_for_cpu_backward")


# Of those, the ones whose GPU kernel is FlashAttention-2's backward (the CPU kernel stands for it
# in a plan traced without a GPU). With fewer key/value heads than query heads (GQA, MQA) it first
# computes dk and dv for every query head, [B, S_k, H_q, D] each in the inputs' dtype, then sums
# each group into the results. The fused-SDPA ops lay heads out at dim 1 ([B, H, S, D]); the
# lower-level _flash_attention_backward at dim -2 ([B, S, H, D], or [T, H, D] over packed rows).
_FLASH_BACKWARD = {"_scaled_dot_product_flash_attention_backward": 1, "_flash_attention_backward": -2,
                   "_scaled_dot_product_flash_attention_for_cpu_backward": 1}


@dataclass(frozen=True)
class DeviceReserve:
    workspace_bytes: int = 0
    scratch_bytes: int = 0
    scratch_op: str = ""           # which op needs the largest scratch
    fragmentation_bytes: int = 0

    @property
    def total(self) -> int:
        return self.workspace_bytes + self.scratch_bytes + self.fragmentation_bytes

    def to_dict(self) -> dict:
        return {"reserve_bytes": self.total, "reserve_workspace_bytes": self.workspace_bytes,
                "reserve_scratch_bytes": self.scratch_bytes, "reserve_scratch_op": self.scratch_op,
                "reserve_fragmentation_bytes": self.fragmentation_bytes}


def device_reserve(captured: CapturedModel, budget_bytes: int, hardware: HardwareProfile, backend: str) -> DeviceReserve:
    if backend == "cpu":
        return DeviceReserve()
    scratch, op = largest_scratch(captured) if hardware.hidden_scratch else (0, "")
    # Planned for a GPU on a machine without one, attention was traced with the CPU kernel: the
    # scratch is sized from the query alike, but the op the GPU runs is its flash/efficient backward.
    op = op.replace("aten._scaled_dot_product_flash_attention_for_cpu_backward.default",
                    "attention backward (traced with the CPU kernel; sized as the GPU's)")
    outside = hardware.workspace_bytes + scratch     # all the caching allocator serves beside the arena
    return DeviceReserve(hardware.workspace_bytes, scratch, op, int(hardware.fragmentation * outside))


def smallest_budget(ledger_peak: int, captured: CapturedModel, hardware: HardwareProfile, backend: str,
                    arena_bytes: int = 0) -> int:
    """The smallest budget whose reserve leaves `ledger_peak` to the plan and that holds an arena of
    `arena_bytes` beside the workspaces and op scratch."""
    fixed = device_reserve(captured, 0, hardware, backend)
    if backend == "cpu":
        return max(ledger_peak, arena_bytes)
    return max(ledger_peak + fixed.total, arena_bytes + fixed.workspace_bytes + fixed.scratch_bytes)


def largest_scratch(captured: CapturedModel) -> tuple[int, str]:
    """(bytes, what) of the temporaries ops hold beside the arena: the largest op on the compute stream
    (an attention backward's accumulators, and the results of an op with no out= form while they are
    copied into the arena) plus the largest casting prefetch on the h2d stream beside it."""
    # Read each template's graphs once, however many stages run it (104 blocks, one template).
    per_template: dict[int, tuple[int, list[str]]] = {}
    for stage in captured.stages:
        t = stage.template
        if id(t) not in per_template:
            sizes = [(attention_backward_scratch(node) + window_scratch(node) + delta_rule_scratch(node)
                      + embedding_backward_scratch(node) + copied_result_bytes(node),
                      getattr(node.target, "kernel", None) or str(node.target))
                     for program in (t.forward, t.backward, t.inference) if program is not None
                     for node in program.gm.graph.nodes]
            top = max((b for b, _ in sizes), default=0)
            per_template[id(t)] = top, [target for b, target in sizes if b == top]
    attention = max(((top, f"{target} in {stage.name}") for stage in captured.stages
                     for top, targets in [per_template[id(stage.template)]] for target in targets), default=(0, ""))
    # Frozen weights and buffers stay in their own dtype on the host; a non_blocking copy that
    # casts stages the slot in the source dtype on the device first.
    compute = captured.compute_dtype
    cast = max(((e.numel * e.dtype.itemsize, f"casting prefetch of {key}") for key, e in captured.state.items()
                if not e.trainable and e.dtype.is_floating_point and e.dtype != compute), default=(0, ""))
    parts = [(n, what) for n, what in (attention, cast) if n]
    return sum(n for n, _ in parts), " + ".join(what for _, what in parts)


def attention_backward_scratch(node) -> int:
    """Bytes an attention backward allocates inside itself: a float32 dq accumulator and one float
    per query row; under GQA, FlashAttention-2's per-query-head dk and dv too."""
    if node.op != "call_function" or not any(s in str(node.target) for s in _ATTENTION_BACKWARD):
        return 0
    query, key, value = (_val(a) for a in (*node.args[1:4], None, None)[:3])
    if not isinstance(query, torch.Tensor):
        return 0
    rows = query.numel() // query.shape[-1]
    scratch = query.numel() * 4 + rows * 4
    heads = next((dim for op, dim in _FLASH_BACKWARD.items() if f".{op}." in f".{node.target}"), None)
    if heads is not None and isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) \
            and key.shape[heads] < query.shape[heads]:
        groups = query.shape[heads] // key.shape[heads]
        scratch += (key.numel() + value.numel()) * groups * key.element_size()
    return scratch


def embedding_backward_scratch(node) -> int:
    """Bytes an embedding's backward allocates inside itself beside its result (which
    copied_result_bytes counts): ATen's op on a GPU, a partial sum per token row in float32 (the
    gradient's dtype if wider) and seven index arrays of the tokens' length (the sort's keys, values
    and buffers, the segments' offsets and counts); the fused kernel (kernels/embedding.py), which
    writes its result into the arena, its sorted ids alone."""
    if node.op != "call_function":
        return 0
    fused = getattr(node.target, "kernel", None) == "embedding_backward"
    if not fused and "embedding_dense_backward" not in str(node.target):
        return 0
    grad, indices = (_val(a) for a in node.args[:2])
    if not isinstance(grad, torch.Tensor) or not isinstance(indices, torch.Tensor):
        return 0
    tokens = indices.numel()
    if fused:       # the fused kernel's result is the arena's: only its sorted ids are beside it
        return embedding.scratch_bytes(tokens)
    return tokens * grad.shape[-1] * max(4, grad.element_size()) + 7 * tokens * 8


def window_scratch(node) -> int:
    """Bytes sliding-window attention holds inside itself where its kernels do not run it
    (megacompile/attention/window.py: float32, or head dims past 256)."""
    if node.op != "call_function" or "megacompile.window_attention" not in str(node.target):
        return 0
    backward = "backward" in str(node.target)
    q, k = (_val(a) for a in (node.args[1:3] if backward else node.args[0:2]))
    window = node.args[7] if backward else node.args[4]
    return reference_scratch_bytes(q, k, window, backward)


def _val(arg):
    return arg.meta.get("val") if hasattr(arg, "meta") else None
