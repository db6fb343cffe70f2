"""The grouped matmul of a mixture-of-experts layer, as two operators with static output shapes.

Rows of `x` are sorted by expert; `offs[e]` is where expert e's rows end (offs[-1] == rows). Each
expert's rows meet that expert's weight:

    grouped_mm(x [S, K], w [E, K, N], offs [E]) -> y [S, N],    y[s_e:offs[e]] = x[s_e:offs[e]] @ w[e]
    grouped_mm_weight_grad(x [S, K], dy [S, N], offs [E]) -> dw [E, K, N],  dw[e] = x_e^T @ dy_e

How many rows each expert gets depends on the routing, which a fake-tensor trace cannot know, but
the shapes of both results do not: the trace (capture) and the planner see [S, N] and [E, K, N].
The backward of grouped_mm is grouped_mm on the transposed weights (dx) and the weight-gradient
operator (dw); an expert that got no rows gets a zero gradient.

Implementations, chosen when the graph runs:
  - bf16 on an sm_90+ GPU: torch._grouped_mm (CUTLASS grouped GEMM);
  - other CUDA cases (float32, GPUs before sm_90): the Triton grouped GEMM in kernels/grouped_gemm.py,
    which never reads the offsets on the host;
  - cpu: one torch.mm per expert over its slice, exact in float32 (the reference, also what
    transformers' own grouped_mm computes on the cpu, sum for sum).
The Triton kernels and the cpu reference make their results through kernels/outputs.py, so where
the device arena placed them they are written there (the CUTLASS op makes its own, copied in).
Only the cpu path reads the offsets on the host: on a GPU they stay on the device, where a read
would wait for every kernel queued before it, once per expert layer and pass.
"""
from __future__ import annotations

import torch

from ..errors import CaptureError


def _check(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3 or offs.dim() != 1 or offs.size(0) != w.size(0) or x.size(1) != w.size(1):
        raise CaptureError(f"grouped_mm takes x [S, K], w [E, K, N], offs [E]; got x {list(x.shape)}, "
                           f"w {list(w.shape)}, offs {list(offs.shape)}")


def _ends(offs: torch.Tensor) -> list[int]:
    return offs.tolist()     # host offsets: the cpu path's per-expert loop only


def _on_gpu(x: torch.Tensor) -> bool:
    return x.is_cuda


def _host_float32(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """On the host, bf16/fp16 operands in float32. A half-precision CPU matmul goes through oneDNN,
    which keeps memory for every shape it has seen, and an expert's row count changes every step:
    400 steps of routed shapes held 300 MB more; float32 goes through BLAS and holds nothing. Both
    accumulate in float32, and the result is rounded to the input dtype once, as before."""
    if ts[0].is_cuda or ts[0].dtype == torch.float32:
        return ts
    return tuple(t.float() for t in ts)


def _result(shape: tuple, like: torch.Tensor, host: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the result, zeroed, where the caller laid it out (kernels/outputs.py: the device arena), and
    the float32 tensor the per-expert matmuls write: the result itself, or a float32 one rounded into
    it once at the end)."""
    from ..kernels import outputs
    y = outputs.zeros(shape, dtype=like.dtype, device=like.device)
    return y, (y if host.dtype == y.dtype else host.new_zeros(shape))


def grouped_mm_reference(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """One matmul per expert; rows past offs[-1] (none when every row is routed) are zero."""
    xs, ws = _host_float32(x, w)
    y, acc = _result((x.size(0), w.size(2)), x, xs)
    start = 0
    for e, end in enumerate(_ends(offs)):
        if end > start:
            torch.mm(xs[start:end], ws[e], out=acc[start:end])
        start = end
    return y if acc is y else y.copy_(acc)


def grouped_mm_weight_grad_reference(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    xs, dys = _host_float32(x, dy)
    dw, acc = _result((offs.size(0), x.size(1), dy.size(1)), x, xs)
    start = 0
    for e, end in enumerate(_ends(offs)):
        if end > start:
            torch.mm(xs[start:end].t(), dys[start:end], out=acc[e])
        start = end
    return dw if acc is dw else dw.copy_(acc)


def _cutlass(x: torch.Tensor, *dims: int) -> bool:
    """torch._grouped_mm: bf16 on sm_90+, every row stride a multiple of 16 bytes (8 elements)."""
    return (_on_gpu(x) and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and all(d % 8 == 0 for d in dims) and torch.cuda.get_device_capability(x.device)[0] >= 9)


@torch.library.custom_op("megacompile::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    _check(x, w, offs)
    if _cutlass(x, x.size(1), w.size(1), w.size(2)):
        return torch._grouped_mm(x, w, offs=offs.to(torch.int32))
    if _on_gpu(x):
        from ..kernels.grouped_gemm import grouped_gemm
        return grouped_gemm(x, w, offs)
    return grouped_mm_reference(x, w, offs)


@grouped_mm.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    _check(x, w, offs)
    return x.new_empty(x.size(0), w.size(2))


@torch.library.custom_op("megacompile::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _cutlass(x, x.size(1), dy.size(1)):
        return torch._grouped_mm(x.t(), dy, offs=offs.to(torch.int32))
    if _on_gpu(x):
        from ..kernels.grouped_gemm import grouped_gemm_weight_grad
        return grouped_gemm_weight_grad(x, dy, offs)
    return grouped_mm_weight_grad_reference(x, dy, offs)


@grouped_mm_weight_grad.register_fake
def _grouped_mm_weight_grad_fake(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return x.new_empty(offs.size(0), x.size(1), dy.size(1))


def _setup_context(ctx, inputs, output) -> None:
    x, w, offs = inputs
    ctx.save_for_backward(x, w, offs)


def _backward(ctx, dy: torch.Tensor):
    x, w, offs = ctx.saved_tensors
    dx = grouped_mm(dy, w.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    dw = grouped_mm_weight_grad(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)
