"""The lm head and the tokens' log-probabilities onto chunked kernels: the [N, V] logits never exist.

Post-training losses (posttrain/logprobs.py `token_logprobs`: DPO, KTO, GRPO, DFT and the reference
pass) take log p = logits.float().gather(label) - logsumexp(logits). Eager makes the [N, V] logits,
their fp32 copy (saved for the backward), and in the backward exp(x - lse), the scattered one-hot
and their sum in fp32 and its cast: five to six [N, V] tensors, 7.5 GB at 8k tokens of Qwen's 152k
vocabulary each in fp32.

Forward group:   logits = h @ W.T ; [views, / T, cast to fp32] -> x ; gather(x, -1, idx) ; squeeze ;
                 logsumexp(x, [-1])
Backward group:  exp(x - lse) * g_lse + scatter_add(zeros, -1, idx, g_pick) ; [cast, views] -> dlogits
                 [/ T] dW = dlogits.T @ h      dh = dlogits @ W
                 (a frozen head, LoRA's: dh alone; frozen_head=True skips the dW matmul, no dW)

The forward becomes one launcher over token chunks (kernels/linear_logprobs.py) that gives the
picked logit and the logsumexp ([N] fp32); the saved fp32 logits leave the saved values, and the
backward launcher makes each chunk's logits again from h and W (saved or received already) to
turn them into its rows of dh and its share of dW. Unlike the cross-entropy the upstream gradient
differs per token and arrives only in the backward, so nothing can be taken ahead.

An inference template (the reference pass, the policy's log-probabilities before a step) gets the
forward launcher alone. Logits divided by a number (GRPO's temperature) are divided by the kernels
as they read them, rounded as eager rounds; capped logits (Gemma 2's softcap) keep eager's graph.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from megacompile.kernels import outputs
from megacompile.kernels.fused_linear_cross_entropy import default_chunk_size
from megacompile.kernels.linear_logprobs import logits_grad_, picked_and_lse

from .contract import StagePair
from .graph import GraphEdit, launcher
from .lm_head import accumulate_dw, dw_rows, head_grads
from .match import PASSTHROUGH, RESHAPES, is_call, peel, plain_cast, single_user, val

aten = torch.ops.aten


# -- launchers ----------------------------------------------------------------------------------
def _forward_meta(h, w, idx, chunk_size, temperature=0.0, rounded=False):
    n = h.shape[0]
    return (torch.empty(n, dtype=torch.float32, device=h.device), torch.empty(n, dtype=torch.float32, device=h.device),
            torch.empty((min(chunk_size, n), w.shape[0]), dtype=h.dtype, device=h.device))


@launcher("linear_logprobs", _forward_meta)
def linear_logprobs_forward(h, w, idx, chunk_size, temperature=0.0, rounded=False):
    """(picked [N] fp32, lse [N] fp32, the [chunk, V] logits tile) for h [N, H], w [V, H] and idx
    (N indices in [0, V), any shape): x[i, idx[i]] and logsumexp(x[i]), x the logits divided by
    `temperature` where given (the quotient `rounded` to h.dtype, as eager divides bf16 logits). The
    tile is reused by every chunk and returned so that the plan and the runtime count it."""
    n = h.shape[0]
    h, idx = h.contiguous(), idx.reshape(n)
    picked = outputs.empty((n,), dtype=torch.float32, device=h.device)
    lse = outputs.empty((n,), dtype=torch.float32, device=h.device)
    tile = outputs.empty((min(chunk_size, n), w.shape[0]), dtype=h.dtype, device=h.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        logits = tile[:end - start]
        torch.mm(h[start:end], w.T, out=logits)
        picked_and_lse(logits, idx[start:end], picked[start:end], lse[start:end], chunk_size, temperature, rounded)
    return picked, lse, tile


def _backward_meta(g_pick, g_lse, h, w, idx, lse, chunk_size, temperature=0.0, rounded=False, frozen_head=False):
    n, hidden = h.shape
    vocab = w.shape[0]
    tile = torch.empty((min(chunk_size, n), vocab), dtype=h.dtype, device=h.device)
    if frozen_head:
        return torch.empty_like(h), tile
    exact = w.dtype == torch.float32
    partial = dw_rows(chunk_size, n, vocab) if h.dtype != torch.float32 else 0
    return (torch.empty_like(h), torch.empty(w.shape, dtype=w.dtype, device=w.device), tile,
            torch.empty((0 if exact else vocab, hidden), dtype=torch.float32, device=w.device),
            torch.empty((partial, hidden), dtype=h.dtype, device=h.device))


@launcher("linear_logprobs_backward", _backward_meta)
def linear_logprobs_backward(g_pick, g_lse, h, w, idx, lse, chunk_size, temperature=0.0, rounded=False,
                             frozen_head=False):
    """(dh [N, H], dW [V, H] in w.dtype, the logits tile, the fp32 dW accumulator ([0, H] when W is
    fp32 and dW is summed in place), the [rows, H] dW partial) from the gradients of the picked
    logits and of the logsumexps ([N] fp32 each, any shape). frozen_head (W takes no gradient: LoRA,
    a frozen head): (dh, the tile), no dW matmul, no dW, no accumulator or partial."""
    n, hidden = h.shape
    vocab = w.shape[0]
    h, idx, lse = h.contiguous(), idx.reshape(n), lse.reshape(n)
    g_pick, g_lse = g_pick.reshape(n), g_lse.reshape(n)
    dh = outputs.empty((n, hidden), dtype=h.dtype, device=h.device)
    exact = w.dtype == torch.float32                             # dW summed in place, else into acc
    dw = acc = partial = None
    if not frozen_head:
        dw = (outputs.zeros if exact else outputs.empty)((vocab, hidden), dtype=w.dtype, device=w.device)
    tile = outputs.empty((min(chunk_size, n), vocab), dtype=h.dtype, device=h.device)
    if not frozen_head:
        acc = outputs.zeros((0 if exact else vocab, hidden), dtype=torch.float32, device=w.device)
        rows = dw_rows(chunk_size, n, vocab) if h.dtype != torch.float32 else 0
        partial = outputs.empty((rows, hidden), dtype=h.dtype, device=h.device)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_chunk, logits = h[start:end], tile[:end - start]
        torch.mm(h_chunk, w.T, out=logits)
        logits_grad_(logits, idx[start:end], lse[start:end], g_pick[start:end], g_lse[start:end], chunk_size,
                     temperature, rounded)
        torch.mm(logits, w, out=dh[start:end])
        if not frozen_head:
            accumulate_dw(dw if exact else acc, logits, h_chunk, partial)
    if frozen_head:
        return dh, tile
    if not exact:
        dw.copy_(acc)                                            # one rounding of the fp32 sum
    return dh, dw, tile, acc, partial


# -- matching -----------------------------------------------------------------------------------
def _last_dim(dim, node: fx.Node) -> bool:
    return dim in (-1, val(node).dim() - 1)


def _divisor(node: fx.Node) -> float | None:
    """T where node is x / T for a positive number T (GRPO's temperature), else None."""
    if is_call(node, aten.div.Tensor) and isinstance(node.args[1], (int, float)) and not isinstance(node.args[1], bool):
        return float(node.args[1]) if node.args[1] > 0 else None
    return None


def _up_to_matmul(x: fx.Node) -> tuple[fx.Node, list[fx.Node], float, bool] | None:
    """From x (the fp32 logits) up through reshapes, one cast to fp32 and one division by a number to
    the lm-head mm: (mm, the nodes between, the divisor or 0, whether the quotient is rounded to
    the logits' dtype). Every node above x is read by the next one alone."""
    chain, node, divisor, rounded = [], x, 0.0, False
    while True:
        if node is not x and not single_user(node):
            return None
        if is_call(node, aten.mm.default):
            return node, chain, divisor, rounded
        if _divisor(node) is not None and not divisor:
            divisor, rounded = _divisor(node), val(node).dtype != torch.float32
        elif not (is_call(node, RESHAPES) or (plain_cast(node) and node.kwargs.get("dtype") == torch.float32)):
            return None
        chain.append(node)
        node = node.args[0]


def _forward_group(edit: GraphEdit, saved_by: set[fx.Node]):
    """(logsumexp, squeezed gather, x, idx, mm, h, W, group nodes) of the head's log-probabilities,
    or None; x may be read besides only by the nodes in `saved_by` (the training forward's output)."""
    for lse in edit.graph.nodes:
        if not is_call(lse, aten.logsumexp.default):
            continue
        x, dims = lse.args[0], lse.args[1]
        keepdim = lse.args[2] if len(lse.args) > 2 else lse.kwargs.get("keepdim", False)
        if keepdim or len(dims) != 1 or not _last_dim(dims[0], x) or val(x).dtype != torch.float32:
            continue
        others = set(x.users) - {lse} - saved_by
        if len(others) != 1:
            continue
        (gather,) = others
        if not (is_call(gather, aten.gather.default) and gather.args[0] is x and _last_dim(gather.args[1], x)
                and not gather.kwargs.get("sparse_grad", False) and single_user(gather)):
            continue
        (squeeze,) = gather.users
        idx = gather.args[2]
        if not (is_call(squeeze, aten.squeeze.dim) and _last_dim(squeeze.args[1], gather)
                and tuple(val(idx).shape) == tuple(val(x).shape[:-1]) + (1,)):
            continue
        found = _up_to_matmul(x)
        if found is None:
            continue
        mm, chain, divisor, rounded = found
        h, wt = mm.args
        w = peel(wt)
        w = peel(w.args[0]) if is_call(w, aten.t.default) else None
        if w is None or w.op != "placeholder" or val(w).dim() != 2 or val(h).dim() != 2:
            continue
        if val(h).dtype != val(w).dtype or val(idx).numel() != val(h).shape[0]:
            continue
        if rounded and val(mm).dtype == torch.float32:
            continue   # divided in a dtype between fp32 logits and their fp32 read: not what the kernels round
        group = [mm, *chain, gather, squeeze, lse]
        if single_user(peel(wt)):
            group.append(peel(wt))
        return lse, squeeze, x, idx, mm, h, w, group, {"temperature": divisor, "rounded": rounded}
    return None


def _unsqueezed(node: fx.Node, like: fx.Node) -> fx.Node | None:
    """a where `node` is a.unsqueeze(last dim of `like`'s rank)."""
    if is_call(node, aten.unsqueeze.default) and node.args[1] in (-1, val(like).dim() - 1):
        return node.args[0]
    return None


def _passthrough(node: fx.Node) -> list[fx.Node]:
    """The detach/alias nodes between node and what they peel to, when each is read only by the next."""
    chain = []
    while is_call(node, PASSTHROUGH) and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return chain


def _backward_group(pair: StagePair, fwd):
    """(g_pick, g_lse, dh mm, dW mm, group nodes) of the head's backward for the forward group, or None;
    dW mm None where the head is frozen (its backward makes dh alone)."""
    lse, _, x, idx, _, h, w, _, scaling = fwd
    s_x = pair.backward_of(x)
    if s_x is None or len(s_x.users) != 1:
        return None
    (sub,) = s_x.users
    if not (is_call(sub, aten.sub.Tensor) and sub.args[0] is s_x and len(sub.args) == 2 and single_user(sub)):
        return None
    s_lse = _unsqueezed(sub.args[1], s_x)
    if s_lse is None or pair.forward_of(peel(s_lse)) is not lse or not single_user(sub.args[1]):
        return None
    (exp,) = sub.users
    if not (is_call(exp, aten.exp.default) and single_user(exp)):
        return None
    (mul,) = exp.users
    if not (is_call(mul, aten.mul.Tensor) and single_user(mul) and exp in mul.args):
        return None
    g_lse_u = mul.args[1] if mul.args[0] is exp else mul.args[0]
    g_lse = _unsqueezed(g_lse_u, s_x)
    (add,) = mul.users
    if g_lse is None or not single_user(g_lse_u) or not (is_call(add, aten.add.Tensor) and len(add.args) == 2):
        return None
    scatter = add.args[1] if add.args[0] is mul else add.args[0]
    if not (is_call(scatter, aten.scatter_add.default) and single_user(scatter) and _last_dim(scatter.args[1], s_x)):
        return None
    zeros, s_idx, src = scatter.args[0], scatter.args[2], scatter.args[3]
    g_pick = _unsqueezed(src, s_x)
    if not (is_call(zeros, aten.new_zeros.default) and single_user(zeros) and g_pick is not None
            and tuple(val(zeros).shape) == tuple(val(s_x).shape) and set(src.users) <= {zeros, scatter}
            and pair.forward_of(peel(s_idx)) is idx):
        return None
    for g in (g_pick, g_lse):
        if val(g).dtype != torch.float32 or not val(g).is_contiguous() or val(g).numel() != val(h).shape[0]:
            return None
    down = _down_to_dlogits(add, scaling["temperature"])
    if down is None:
        return None
    dlogits, chain = down
    w_in = pair.backward_of(w)
    grads = head_grads(pair, dlogits, w_in, h) or head_grads(pair, dlogits, w_in, h, frozen=True)
    if grads is None:
        return None
    dh, dw, transposes = grads
    group = [sub, sub.args[1], *_passthrough(s_lse), exp, mul, g_lse_u, zeros, src, scatter, add, *chain,
             *transposes, dh, *([dw] if dw is not None else [])]
    return g_pick, g_lse, dh, dw, group


def _down_to_dlogits(node: fx.Node, divisor: float) -> tuple[fx.Node, list[fx.Node]] | None:
    """From the fp32 gradient of the logits down through reshapes, casts and the division's backward
    (by the forward's divisor, where it divided) to the 2-d dlogits."""
    chain = []
    while single_user(node):
        (u,) = node.users
        if is_call(u, RESHAPES) or plain_cast(u) or (divisor and _divisor(u) == divisor and u.args[0] is node):
            divisor = 0.0 if _divisor(u) else divisor
            chain.append(u)
            node = u
            continue
        break
    return None if divisor or val(node).dim() != 2 else (node, chain)


# -- the rewrites -------------------------------------------------------------------------------
def _chunk(h: fx.Node, w: fx.Node) -> int:
    n, hidden = val(h).shape
    return int(default_chunk_size(n, hidden, val(w).shape[0]))


def linear_logprobs(pair: StagePair) -> int:
    """A training template's head log-probabilities and their backward, both graphs or neither."""
    fwd = _forward_group(pair.fwd, {pair._fwd_output})
    if fwd is None:
        return 0
    bwd = _backward_group(pair, fwd)
    if bwd is None:
        return 0
    lse, squeeze, _, idx, _, h, w, group, scaling = fwd
    g_pick, g_lse, dh_mm, dw_mm, bwd_group = bwd
    frozen = dw_mm is None
    chunk = _chunk(h, w)
    args = (g_pick, g_lse, pair.input_for(h), pair.input_for(w), pair.input_for(idx), pair.input_for(lse), chunk)
    grads = {0: dh_mm} if frozen else {0: dh_mm, 1: dw_mm}
    done = pair.bwd.replace(linear_logprobs_backward, args, {**scaling, "frozen_head": frozen}, grads, bwd_group)
    assert done, "the head's backward group was checked but could not be replaced"
    pair.prune()   # the fp32 logits leave the saved values (a frozen head's h comes in their place)
    done = pair.fwd.replace(linear_logprobs_forward, (h, w, idx, chunk), scaling, {0: squeeze, 1: lse}, group)
    assert done, "the head's log-probability group was checked but could not be replaced"
    return 1


def linear_logprobs_forward_only(edit: GraphEdit) -> int:
    """An inference template's head log-probabilities (the logits read by nothing else)."""
    fwd = _forward_group(edit, set())
    if fwd is None:
        return 0
    lse, squeeze, _, idx, _, h, w, group, scaling = fwd
    return 1 if edit.replace(linear_logprobs_forward, (h, w, idx, _chunk(h, w)), scaling, {0: squeeze, 1: lse},
                             group) else 0

