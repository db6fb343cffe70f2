"""Node targets for the hand-written kernels in megacompile.kernels, each with its fake-tensor meta.

A launcher takes the tensors the matched ATen group read, in the layout the graph has them, and
returns what the kernel returns; its meta makes the same outputs (shape, dtype, strides, one storage
each) on fake tensors, mirroring the allocations in the kernel's host function. Statistics saved in
the ATen layout ([..., 1]) are flattened to the kernels' [M] here, so the graphs keep their shapes.
"""
from __future__ import annotations

import torch

from megacompile.kernels.attention import attention_backward, attention_forward
from megacompile.kernels.embedding import embedding_backward
from megacompile.kernels.gelu import gelu_backward, gelu_forward
from megacompile.kernels.layer_norm import layer_norm_backward, layer_norm_forward
from megacompile.kernels.rms_norm import rms_norm_backward, rms_norm_forward
from megacompile.kernels.rope import rope_rotate
from megacompile.kernels.softmax import softmax_forward
from megacompile.kernels.swiglu import swiglu_backward, swiglu_forward

from .graph import launcher


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 1


def _like(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)


def _stat(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(_rows(x), dtype=torch.float32, device=x.device)


# -- RMSNorm ------------------------------------------------------------------------------------
@launcher("rms_norm", lambda x, w, eps: (_like(x), _stat(x)))
def rms_norm_fwd(x, w, eps):
    """(y [..., N] in x.dtype, rstd [M] fp32)."""
    return rms_norm_forward(x, w, eps)


@launcher("rms_norm_backward", lambda dy, x, w, rstd, weight_grad=True: (_like(x), _like(w))[:1 + weight_grad])
def rms_norm_bwd(dy, x, w, rstd, weight_grad=True):
    """(dx [..., N] in x.dtype, dw [N] in w.dtype); rstd in any shape with M elements. weight_grad=False
    (a frozen norm): (dx,)."""
    dx, dw = rms_norm_backward(dy, x, w, rstd.reshape(-1), weight_grad)
    return (dx, dw) if weight_grad else (dx,)


# -- LayerNorm ----------------------------------------------------------------------------------
@launcher("layer_norm", lambda x, w, b, eps: (_like(x), _stat(x), _stat(x)))
def layer_norm_fwd(x, w, b, eps):
    """(y [..., N] in x.dtype, mean [M] fp32, rstd [M] fp32)."""
    return layer_norm_forward(x, w, b, eps)


@launcher("layer_norm_backward",
          lambda dy, x, w, mean, rstd, weight_grad=True: (_like(x), _like(w), _like(w))[:1 + 2 * weight_grad])
def layer_norm_bwd(dy, x, w, mean, rstd, weight_grad=True):
    """(dx, dw, db); mean and rstd in any shape with M elements, any float dtype. weight_grad=False
    (a frozen weight and bias): (dx,)."""
    dx, dw, db = layer_norm_backward(dy, x, w, mean.reshape(-1).float(), rstd.reshape(-1).float(), weight_grad)
    return (dx, dw, db) if weight_grad else (dx,)


# -- SwiGLU, GELU, softmax ----------------------------------------------------------------------
@launcher("swiglu", lambda a, b: _like(a))
def swiglu_fwd(a, b):
    return swiglu_forward(a, b)


@launcher("swiglu_backward", lambda dc, a, b: (_like(a), _like(b)))
def swiglu_bwd(dc, a, b):
    return swiglu_backward(dc, a, b)


@launcher("gelu", lambda a, approximate: _like(a))
def gelu_fwd(a, approximate):
    return gelu_forward(a, None, approximate)


@launcher("gelu_backward", lambda dc, a, approximate: _like(a))
def gelu_bwd(dc, a, approximate):
    return gelu_backward(dc, a, None, approximate)[0]


@launcher("softmax", lambda x: _like(x))
def softmax_fwd(x):
    """Row softmax over the last dim (no scale, no mask: those stay in the graph)."""
    return softmax_forward(x, 1.0, False)


# -- RoPE ---------------------------------------------------------------------------------------
def _rope_meta(x, cos, sin):
    y = torch.empty_like(x)
    return y if y.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


@launcher("rope", _rope_meta)
def rope_fwd(x, cos, sin):
    """x * cos + rotate_half(x) * sin for x [B, H, S, D]."""
    return rope_rotate(x, cos, sin)


@launcher("rope_backward", _rope_meta)
def rope_bwd(dy, cos, sin):
    """The rotation by -theta: the gradient of rope_fwd."""
    return rope_rotate(dy, cos, sin, backward=True)


# -- attention ----------------------------------------------------------------------------------
def _strided(x: torch.Tensor, shape, stride, dtype: torch.dtype | None = None) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype or x.dtype, device=x.device)


@launcher("attention", lambda q, k, v, causal, scale, o_stride, lse_stride: (
    _strided(q, q.shape, o_stride), _strided(q, q.shape[:3], lse_stride, torch.float32)))
def attention_fwd(q, k, v, causal, scale, o_stride, lse_stride):
    """(o [B, Hq, S, D] in q.dtype, lse [B, Hq, S] fp32) at the strides the replaced op made them."""
    return attention_forward(q, k, v, causal, scale, o_stride, lse_stride)


@launcher("attention_backward", lambda do, q, k, v, o, lse, causal, scale, dq_stride, dk_stride, dv_stride: (
    _strided(q, q.shape, dq_stride), _strided(k, k.shape, dk_stride), _strided(v, v.shape, dv_stride),
    torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)))
def attention_bwd(do, q, k, v, o, lse, causal, scale, dq_stride, dk_stride, dv_stride):
    """(dq, dk, dv) at the strides the replaced op made them, and delta [B, Hq, S] fp32, the kernel's
    temporary made a result so the plan places it."""
    return attention_backward(do, q, k, v, o, lse, causal, scale, dq_stride, dk_stride, dv_stride)


# -- Embedding ----------------------------------------------------------------------------------
@launcher("embedding_backward",
          lambda grad, ids, num_weights, padding_idx: grad.new_empty((num_weights, grad.shape[-1])))
def embedding_bwd(grad, ids, num_weights, padding_idx):
    """The [V, H] weight gradient, in grad's dtype (aten.embedding_dense_backward without
    scale_grad_by_freq)."""
    return embedding_backward(grad, ids, num_weights, padding_idx)
