"""The lm head and its loss onto one chunked kernel: the [N, V] logits never exist.

Forward group (the epilogue):   logits = h @ W.T ; [views, cast to fp32] ; [div c, tanh, mul c] ;
                                [views, cast] ; _log_softmax ; nll_loss_forward (mean)
Backward group:                 nll_loss_backward ; _log_softmax_backward_data ; [views, cast] ;
                                [mul c, tanh_backward, div c] ; [views, cast] -> dlogits
                                dW = dlogits.T @ h          dh = dlogits @ W
                                (a frozen head, LoRA's: dh alone; frozen_head=True skips the dW
                                matmul and saves dh alone, no fp32 dW)
The bracketed cap is Gemma 2's final logit softcapping (c * tanh(logits / c)): the kernel caps each
logit tile as it reads it and takes 1 - tanh^2 in the gradient, so the [N, V] tanh eager saves for
its backward goes with the log-softmax.

Eager keeps the logits, their log-softmax (saved for the backward) and, in the backward, two more
[N, V] gradients: three to four times N * V * 4 bytes. The loss ends the graph, so the fused forward
computes the loss and both gradients in one pass over token chunks (kernels/fused_linear_cross_entropy.py:
per chunk a [chunk, V] logits tile, turned in place into d loss / d logits by a Triton kernel, then
two matmuls), and saves dh [N, H] and an fp32 dW [V, H] instead of the log-softmax. The backward
only scales them by the loss tangent. The chunk tile (and, when dW's product is bf16, a [chunk, H]
partial of it) are returned as outputs that nothing reads, so the plan and the runtime both count
them while the kernel runs: the launchers allocate nothing their meta does not declare.

The rewrite changes the saved values, so it edits both graphs of the pair together and checks
both groups completely before it changes either.
"""
from __future__ import annotations

import torch
import torch.fx as fx
import triton

from megacompile.kernels import outputs
from megacompile.kernels.cast import scale
from megacompile.kernels.fused_linear_cross_entropy import BLOCK_V_MAX, cross_entropy_grad_kernel, default_chunk_size
from megacompile.kernels.tiling import row_tile

from .contract import StagePair
from .graph import launcher
from .lm_head import accumulate_dw, dw_rows, head_grads
from .match import RESHAPES, getitems, is_call, peel, plain_cast, single_user, val

aten = torch.ops.aten


# -- launchers ----------------------------------------------------------------------------------
def _forward_meta(h, w, labels, ignore_index, chunk_size, softcap=0.0, frozen_head=False):
    n, hidden = h.shape
    loss = torch.empty((), dtype=torch.float32, device=h.device)
    dh = torch.empty((n, hidden), dtype=h.dtype, device=h.device)
    tile = torch.empty((min(chunk_size, n), w.shape[0]), dtype=h.dtype, device=h.device)
    if frozen_head:
        return loss, dh, tile
    partial = dw_rows(chunk_size, n, w.shape[0]) if w.dtype != torch.float32 else 0
    return (loss, dh, torch.empty(w.shape, dtype=torch.float32, device=w.device), tile,
            torch.empty((partial, hidden), dtype=h.dtype, device=h.device))


@launcher("fused_linear_cross_entropy", _forward_meta)
def linear_cross_entropy_forward(h, w, labels, ignore_index, chunk_size, softcap=0.0, frozen_head=False):
    """(loss [] fp32, dh [N, H] in h.dtype, dw [V, H] fp32, the [chunk, V] logits tile, the
    [rows, H] dW partial) for h [N, H], w [V, H], labels [N]: mean cross-entropy of h @ w.T over
    non-ignored labels, with its gradients for an upstream gradient of 1. The tile and the partial
    are reused by every chunk; nothing reads them after, they are outputs so that the plan and the
    runtime count them. The small per-token loss and count live only while the kernel runs.
    frozen_head (W takes no gradient: LoRA, a frozen head): (loss, dh, tile), no dW matmul, no dW."""
    n, hidden = h.shape
    vocab = w.shape[0]
    h, labels = h.contiguous(), labels.contiguous()
    n_valid = (labels != ignore_index).sum().to(torch.float32).reshape(1)
    loss_rows = torch.empty(n, dtype=torch.float32, device=h.device)
    dh = outputs.empty((n, hidden), dtype=h.dtype, device=h.device)
    dw = None if frozen_head else outputs.zeros((vocab, hidden), dtype=torch.float32, device=w.device)
    tile = outputs.empty((min(chunk_size, n), vocab), dtype=h.dtype, device=h.device)
    rows = dw_rows(chunk_size, n, vocab) if w.dtype != torch.float32 else 0
    # declared by the meta: kept on cuda too (where addmm's out_dtype makes it unneeded)
    partial = None if frozen_head else outputs.empty((rows, hidden), dtype=h.dtype, device=h.device)
    block_m, block_v, num_warps = row_tile(chunk_size, min(vocab, BLOCK_V_MAX), tile=4 * BLOCK_V_MAX)
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        h_chunk, logits = h[start:end], tile[:end - start]           # [c, H], [c, V]
        torch.mm(h_chunk, w.T, out=logits)
        cross_entropy_grad_kernel[(triton.cdiv(end - start, block_m),)](
            logits, labels[start:end], loss_rows[start:end], n_valid,
            logits.stride(0), end - start, vocab, ignore_index, float(softcap or 1.0),
            SOFTCAP=bool(softcap), BLOCK_M=block_m, BLOCK_V=block_v, num_warps=num_warps,
        )
        torch.mm(logits, w, out=dh[start:end])                       # logits now hold d loss / d logits
        if dw is not None:
            accumulate_dw(dw, logits, h_chunk, partial)
    loss = outputs.empty((), dtype=torch.float32, device=h.device)
    loss = torch.div(loss_rows.sum(), n_valid[0], out=loss)
    return (loss, dh, tile) if frozen_head else (loss, dh, dw, tile, partial)


def _backward_meta(tangent, dh, dw, w_dtype):
    if dw is None:
        return (torch.empty_like(dh),)
    return torch.empty_like(dh), torch.empty(dw.shape, dtype=w_dtype, device=dw.device)


@launcher("fused_linear_cross_entropy_backward", _backward_meta)
def linear_cross_entropy_backward(tangent, dh, dw, w_dtype):
    """(dh * tangent, dw * tangent in w_dtype): new tensors, the saved ones are left as they are.
    Each product is taken in fp32 and rounded once (a tangent of 1/k, with grad_accum=k, is not
    rounded to bf16 first), straight into its output: no [V, H] fp32 temporary. dw None (a frozen
    head): (dh * tangent,)."""
    if dw is None:
        return (scale(dh, tangent),)
    return scale(dh, tangent), scale(dw, tangent, w_dtype)


# -- matching -----------------------------------------------------------------------------------
def _cap_of(mul: fx.Node, saved_by: set[fx.Node]) -> tuple[float, list[fx.Node]] | None:
    """(c, [mul, tanh, div]) where `mul` is c * tanh(x / c) (the tanh read otherwise only by the
    saved values, `saved_by`), else None."""
    if not (is_call(mul, aten.mul.Tensor) and isinstance(mul.args[1], (int, float))):
        return None
    tanh, cap = mul.args
    if not (is_call(tanh, aten.tanh.default) and set(tanh.users) <= {mul} | saved_by):
        return None
    div = tanh.args[0]
    if not (is_call(div, aten.div.Tensor) and div.args[1] == cap and single_user(div) and cap > 0):
        return None
    return float(cap), [mul, tanh, div]


def _up_to_matmul(x: fx.Node, saved_by: set[fx.Node]) -> tuple[fx.Node, list[fx.Node], float] | None:
    """From the log-softmax input up through reshapes, an fp32 cast and a softcap to the lm-head mm:
    (mm, the nodes between, the cap or 0)."""
    chain, cap = [], 0.0
    while True:
        if not single_user(x):
            return None
        if is_call(x, aten.mm.default):
            return x, chain, cap
        if is_call(x, RESHAPES) or (plain_cast(x) and x.kwargs.get("dtype") == torch.float32):
            chain.append(x)
            x = x.args[0]
            continue
        capped = None if cap else _cap_of(x, saved_by)
        if capped is not None:
            cap, nodes = capped
            chain += nodes
            x = nodes[-1].args[0]
            continue
        return None


def _uncap_of(mul: fx.Node, cap: float, pair: StagePair, tanh: fx.Node) -> list[fx.Node] | None:
    """[mul, tanh_backward, div] where they are the cap's backward: (g * c), back through the saved
    tanh (read by nothing else), / c."""
    if not (is_call(mul, aten.mul.Tensor) and mul.args[1] == cap and single_user(mul)):
        return None
    (back,) = mul.users
    if not (is_call(back, aten.tanh_backward.default) and back.args[0] is mul and single_user(back)):
        return None
    saved = peel(back.args[1])
    if pair.forward_of(saved) is not tanh or not _only_read_by(saved, {back}):
        return None
    (div,) = back.users
    if not (is_call(div, aten.div.Tensor) and div.args[1] == cap):
        return None
    return [mul, back, div]


def _down_from(x: fx.Node, cap: float = 0.0, pair: StagePair | None = None,
               tanh: fx.Node | None = None) -> tuple[fx.Node, list[fx.Node]] | None:
    """From _log_softmax_backward_data down through reshapes, a cast and the cap's backward (where
    the forward capped) to the 2-d dlogits; None where a cap's backward is not found."""
    chain = []
    while single_user(x):
        (u,) = x.users
        if is_call(u, RESHAPES) or plain_cast(u):
            chain.append(u)
            x = u
            continue
        uncapped = _uncap_of(u, cap, pair, tanh) if cap else None
        if uncapped is not None:
            chain += uncapped
            x, cap = uncapped[-1], 0.0
            continue
        break
    return None if cap else (x, chain)


def _forward_group(pair: StagePair):
    """(nll node, mm, h, W, labels, ignore_index, group nodes, cap, its tanh) of the lm-head loss,
    or None; cap 0 and tanh None where the logits are not capped."""
    out = pair._fwd_output
    for node in pair.fwd.graph.nodes:
        if not is_call(node, aten.nll_loss_forward.default):
            continue
        logsm, labels, weight, reduction, ignore_index = node.args
        if weight is not None or reduction != 1 or not is_call(logsm, aten._log_softmax.default):
            continue
        x, dim, half_to_float = logsm.args
        if half_to_float or dim not in (1, -1) or val(x).dim() != 2 or set(logsm.users) - {node, out}:
            continue
        found = _up_to_matmul(x, {out})
        if found is None:
            continue
        mm, chain, cap = found
        tanh = next((n for n in chain if is_call(n, aten.tanh.default)), None)
        h, wt = mm.args
        w = peel(wt)
        w = peel(w.args[0]) if is_call(w, aten.t.default) else None
        if w is None or w.op != "placeholder" or val(w).dim() != 2 or val(h).dim() != 2:
            continue
        if val(h).dtype != val(w).dtype or val(labels).dim() != 1 or val(labels).shape[0] != val(h).shape[0]:
            continue
        items = getitems(node)
        if 0 not in items or (1 in items and set(items[1].users) - {out}) or len(items) != len(node.users):
            continue
        group = [mm, *chain, logsm, node, *items.values()]
        if single_user(peel(wt)):
            group.append(peel(wt))
        return node, mm, h, w, labels, ignore_index, group, cap, tanh
    return None


def _backward_group(pair: StagePair, fwd):
    """(tangent, dh mm, dW mm, group nodes) of the loss backward for the forward group, or None;
    dW mm None where the head is frozen (its backward makes dh alone)."""
    nll, mm, h, w, labels, ignore_index, _, cap, tanh = fwd
    logsm, w_in = nll.args[0], pair.backward_of(w)
    for node in pair.bwd.graph.nodes:
        if not is_call(node, aten.nll_loss_backward.default):
            continue
        tangent, s_logsm, s_labels, weight, reduction, ignore, _total = node.args
        if (pair.forward_of(s_logsm) is not logsm or pair.forward_of(s_labels) is not labels or weight is not None
                or reduction != 1 or ignore != ignore_index or peel(tangent) not in pair.tangents):
            continue
        (back,) = node.users if single_user(node) else (None,)
        if (back is None or not is_call(back, aten._log_softmax_backward_data.default)
                or peel(back.args[1]) is not peel(s_logsm)):
            continue
        if not (_only_read_by(peel(s_logsm), {node, back}) and _only_read_by(peel(_total), {node})):
            continue   # the log-softmax must leave the saved values, or the forward keeps making it
        down = _down_from(back, cap, pair, tanh)
        if down is None or val(down[0]).dim() != 2:
            continue
        dlogits, chain = down
        grads = head_grads(pair, dlogits, w_in, h) or head_grads(pair, dlogits, w_in, h, frozen=True)
        if grads is None:
            continue
        dh, dw, transposes = grads
        return peel(tangent), dh, dw, [node, back, *chain, *transposes, dh, *([dw] if dw is not None else [])]
    return None


def _only_read_by(node: fx.Node, readers: set[fx.Node]) -> bool:
    """Every reader of node, looking through detach/alias, is in `readers`."""
    for u in node.users:
        if is_call(u, {aten.detach.default, aten.alias.default}):
            if not _only_read_by(u, readers):
                return False
        elif u not in readers:
            return False
    return True


# -- the rewrite --------------------------------------------------------------------------------
def fused_linear_cross_entropy(pair: StagePair) -> int:
    fwd = _forward_group(pair)
    if fwd is None:
        return 0
    bwd = _backward_group(pair, fwd)
    if bwd is None:
        return 0
    nll, mm, h, w, labels, ignore_index, group, cap, _ = fwd
    tangent, dh_mm, dw_mm, bwd_group = bwd
    frozen = dw_mm is None
    n_tokens, hidden = val(h).shape
    chunk = default_chunk_size(n_tokens, hidden, val(w).shape[0])
    args = (h, w, labels)
    kwargs = {"ignore_index": int(ignore_index), "chunk_size": int(chunk), "softcap": cap, "frozen_head": frozen}
    fake = pair.fwd.fake(linear_cross_entropy_forward, args, kwargs)

    saved_dh = pair.add_saved("saved_ce_dh", fake[1])
    saved_dw = None if frozen else pair.add_saved("saved_ce_dw", fake[2])
    grads = {0: dh_mm} if frozen else {0: dh_mm, 1: dw_mm}
    done = pair.bwd.replace(linear_cross_entropy_backward, (tangent, saved_dh, saved_dw, val(w).dtype), {},
                            grads, bwd_group)
    assert done, "the loss backward group was checked but could not be replaced"
    pair.prune()   # the log-softmax, the capped logits' tanh, the labels' total weight and h leave the saved
    #                values; a frozen W leaves the backward's inputs

    loss = getitems(nll)[0]
    done = pair.fwd.replace(linear_cross_entropy_forward, args, kwargs, {0: loss}, group)
    assert done, "the lm-head group was checked but could not be replaced"
    _, items = done
    pair.set_saved(saved_dh, items[1])
    if not frozen:
        pair.set_saved(saved_dw, items[2])
    return 1
