"""The chunked gated delta rule (Qwen3-Next's and Qwen3.5's linear attention) as one operator.

    chunk_gated_delta_rule(q [B, S, Hk, Dk], k [B, S, Hk, Dk], v [B, S, Hv, Dv], g [B, S, Hv], beta [B, S, Hv],
                           reference, use_qk_l2norm) -> o [B, S, Hv, Dv] in q's dtype
    chunk_gated_delta_rule_backward(do, q, k, v, g, beta, reference, use_qk_l2norm) -> (dq, dk, dv, dg, dbeta)

transformers computes the rule with a function of the model's own module,
`torch_chunk_gated_delta_rule`: flash-linear-attention's kernels where that package is installed,
else a torch fallback over chunks of 64 tokens with a Python loop over the chunks. Traced op by op,
the fallback is some 40 ops a chunk (2,600 a layer at 4096 tokens), and a layer keeps every chunk's
intermediates for its backward: 1.83 GiB of a Qwen3-Next block's activations at 4096 tokens, 2.5
times a full-attention block's, and ~10^5 device tensors a 48-layer plan lays out.

As one operator the forward runs that same function without autograd and keeps only its five
inputs; the backward runs it again under autograd and takes the gradient of its output. Those are
eager's own ops in eager's order, so the output and the gradients are eager's bit for bit, and what
the function holds for its backward lives only inside one layer's backward operator (op scratch,
measured by the planner: cost/reserve.py). The price is one more forward of the rule per layer.

`reference` names the model module whose function runs ("transformers.models.qwen3_next.
modeling_qwen3_next"); while a capture routes that module's function here (capture/hf_delta_rule.py)
the function it had before is the one run.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

FUNCTION = "torch_chunk_gated_delta_rule"      # the name transformers' modules give the rule

# module name -> the function it held before a capture routed it here
_ORIGINAL: dict[str, Callable] = {}


def remember(module: str, function: Callable) -> None:
    """Keep `module`'s own rule, which the operator runs while the module holds the router."""
    _ORIGINAL.setdefault(module, function)


def reference_rule(module: str) -> Callable:
    found = _ORIGINAL.get(module)
    return found if found is not None else getattr(importlib.import_module(module), FUNCTION)


def _rule(q, k, v, g, beta, reference: str, use_qk_l2norm: bool) -> torch.Tensor:
    out, _ = reference_rule(reference)(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm)
    return out


def _forward(q, k, v, g, beta, reference: str, use_qk_l2norm: bool) -> torch.Tensor:
    with torch.no_grad():
        out = _rule(q, k, v, g, beta, reference, use_qk_l2norm)
    # A result may not alias an input (the fallback's is a view of its padded [B, Hv, S', Dv] result).
    inputs = {StorageWeakRef(x.untyped_storage()) for x in (q, k, v, g, beta)}
    return out.clone() if StorageWeakRef(out.untyped_storage()) in inputs else out


# The dispatch state of plain eager code with autograd on (as read at import, less an inference
# mode the import might run in). An operator runs with autograd's keys excluded, and its fake with
# every key after Python's, where requires_grad records nothing.
_K = torch._C.DispatchKey
_AUTOGRAD = [torch._C.DispatchKeySet(k) for k in (_K.AutogradFunctionality, _K.AutogradOther, _K.AutogradNestedTensor)]
_EAGER_KEYS = (torch._C._dispatch_tls_local_include_set() | torch._C.DispatchKeySet(_K.ADInplaceOrView),
               functools.reduce(lambda keys, k: keys - k, _AUTOGRAD, torch._C._dispatch_tls_local_exclude_set()))


@contextlib.contextmanager
def _autograd_recording():
    """Inside: dispatch as in plain eager code, grad mode on, so the rule's own autograd runs as
    eagerly (torch.func.vjp would run inside an operator too, but not over fake or meta tensors)."""
    with torch._C._ForceDispatchKeyGuard(*_EAGER_KEYS), torch.enable_grad():
        yield


def rule_gradients(do, q, k, v, g, beta, reference: str, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    """What the backward operator computes, where autograd records: the rule again, and the
    gradients of its inputs for `do`. Traced, its peak is the operator's scratch (cost/reserve.py)."""
    inputs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
    out = _rule(*inputs, reference, use_qk_l2norm)
    grads = torch.autograd.grad(out, inputs, do, allow_unused=True)
    return tuple(torch.zeros_like(x) if d is None else d for d, x in zip(grads, inputs))


def _gradients(do, q, k, v, g, beta, reference: str, use_qk_l2norm: bool) -> tuple[torch.Tensor, ...]:
    with _autograd_recording():
        return rule_gradients(do, q, k, v, g, beta, reference, use_qk_l2norm)


def _laid_out_as_run(run: Callable, tensors: list[torch.Tensor], dense: Callable):
    """On fake inputs: the results as the rule lays them out, from its own run on meta tensors of
    the inputs' layouts, so the device arena holds them with the strides eager gives (the gradient
    of g comes back transposed, and the sum that reduces it to A_log's adds in the order its layout
    gives: eager's order). A rule that cannot run on meta tensors (a Triton kernel) gets `dense`."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    like = tensors[0]
    try:
        with unset_fake_temporarily():
            metas = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors]
            laid = run(*metas)
    except Exception:  # noqa: BLE001 - whatever stops a rule from running on meta tensors
        return dense()
    made = [like.new_empty_strided(t.shape, t.stride(), dtype=t.dtype)
            for t in (laid if isinstance(laid, tuple) else (laid,))]
    return tuple(made) if isinstance(laid, tuple) else made[0]


@torch.library.custom_op("megacompile::chunk_gated_delta_rule", mutates_args=())
def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           reference: str, use_qk_l2norm: bool) -> torch.Tensor:
    return _forward(q, k, v, g, beta, reference, use_qk_l2norm)


@chunk_gated_delta_rule.register_fake
def _chunk_gated_delta_rule_fake(q, k, v, g, beta, reference, use_qk_l2norm):
    return _laid_out_as_run(lambda *xs: _forward(*xs, reference, use_qk_l2norm), [q, k, v, g, beta],
                            lambda: v.new_empty(v.shape, dtype=q.dtype))


@torch.library.custom_op("megacompile::chunk_gated_delta_rule_backward", mutates_args=())
def chunk_gated_delta_rule_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                    g: torch.Tensor, beta: torch.Tensor, reference: str, use_qk_l2norm: bool
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gradients(do, q, k, v, g, beta, reference, use_qk_l2norm)


@chunk_gated_delta_rule_backward.register_fake
def _chunk_gated_delta_rule_backward_fake(do, q, k, v, g, beta, reference, use_qk_l2norm):
    return _laid_out_as_run(
        lambda *xs: _gradients(*xs, reference, use_qk_l2norm), [do, q, k, v, g, beta],
        lambda: tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, reference, use_qk_l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta)
    ctx.reference, ctx.use_qk_l2norm = reference, use_qk_l2norm


def _backward(ctx, do: torch.Tensor):
    grads = chunk_gated_delta_rule_backward(do, *ctx.saved_tensors, ctx.reference, ctx.use_qk_l2norm)
    return (*grads, None, None)


chunk_gated_delta_rule.register_autograd(_backward, setup_context=_setup_context)


def rule_flops(q: torch.Tensor, v: torch.Tensor, chunk: int = 64) -> float:
    """Multiply-adds x 2 of one forward of the chunked rule, per (batch, value head, token): the
    chunk's k_beta k^T and q k^T (2 C Dk), two unit-triangular solves (C (Dk + Dv) / 2 each way),
    and per chunk the state's reads and update (k_cumdecay S, q S, k^T v_new: 3 Dk Dv) and the
    intra-chunk attention over the new values (C Dv)."""
    batch, seq, _, dk = q.shape
    heads, dv = v.shape[-2:]
    return 2.0 * batch * heads * seq * (2 * chunk * dk + chunk * (dk + dv) / 2 + 3 * dk * dv + chunk * dv)
