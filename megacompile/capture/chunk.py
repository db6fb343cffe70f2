"""Sequence-chunked blocks: a block's token-wise submodules run over chunks of the sequence.

At long context a block's working set is not its weights but its activations: at 512k tokens a
7B block's MLP makes four [S, 11008] intermediates (11 GiB each in bf16) and its norms upcast the
[S, 4096] residual stream to fp32 (8 GiB a copy). Attention is the one part that needs every
token at once (one SDPA call, causal, no [S, S] mask); the rest works token by token. With
`chunked(n)` active, the block template is traced with each token-wise submodule (a norm, the
MLP) run as `_ChunkedCall`: its forward runs the module on n slices of the sequence and saves
only its input; its backward runs the module again, one slice at a time, with the slice's
gradient, so a chunk's intermediates live only while that chunk is worked on. Parameter
gradients are the sum of the chunks' (exact up to float reassociation).

A module is chunked only when its traced ATen graph is shown token-wise (`token_wise`): every op
keeps each token's row apart (elementwise ops, matmuls with the token rows on the left, views
that keep the rows in front, reductions over features). Anything else (a convolution over
positions, a cumulative sum, random draws, an op this file does not know) leaves the module
whole, so a model that mixes positions outside attention is never chunked wrong. Plain
projections are left whole too: their input and output are all they hold, and attention needs
those whole anyway.
"""
from __future__ import annotations

import contextlib
import logging
import math
import operator
import threading

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.fx.experimental.proxy_tensor import make_fx

aten = torch.ops.aten
_state = threading.local()   # .chunks: the count while a chunked trace runs; .inside: re-entry guard


def active_chunks() -> int:
    return getattr(_state, "chunks", 1)


@contextlib.contextmanager
def chunked(n: int):
    """Block templates traced inside run their token-wise submodules over `n` chunks."""
    before = active_chunks()
    _state.chunks = n
    try:
        yield
    finally:
        _state.chunks = before


@contextlib.contextmanager
def chunk_block(block: torch.nn.Module, local: list[str], fake_params: list[torch.Tensor], probe):
    """While tracing `block` (its parameters `local`, faked as `fake_params`), run its token-wise
    submodules over `active_chunks()` slices of the sequence. `probe()` runs the block's forward once
    on fake tensors, to see how each submodule is called. Yields the chunked modules' paths."""
    n = active_chunks()
    if n <= 1:
        yield []
        return
    fakes = dict(zip(local, fake_params))
    calls = _first_calls(block, probe)
    chosen: list[str] = []
    patched: list[tuple[torch.nn.Module, object]] = []
    try:
        for path, (module, x) in calls.items():
            if any(path.startswith(c + ".") for c in chosen) or not _worth_chunking(module):
                continue
            names = [k for k, _ in module.named_parameters()] + [k for k, _ in module.named_buffers()]
            ps = [fakes[f"{path}.{k}"] for k in names]
            if x.dim() < 2 or x.shape[1] < n or token_wise(module, names, x, ps, n) is not None:
                continue
            chosen.append(path)
            patched.append((module, module.__dict__.get("forward")))
            module.forward = _chunked_forward(module, names, n, x)
        yield chosen
    finally:
        for m, before in patched:   # a forward patched in by someone else stays theirs
            if before is None:
                del m.forward
            else:
                m.forward = before


def _first_calls(block: torch.nn.Module, probe) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """Submodules (outermost first) called with one tensor and nothing else, and that tensor."""
    seen: dict[str, tuple[torch.nn.Module, torch.Tensor]] = {}
    hooks = []
    for path, m in block.named_modules():
        if not path:
            continue

        def pre(mod, args, kwargs, path=path):
            if path not in seen and len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor):
                seen[path] = (mod, args[0].detach())
        hooks.append(m.register_forward_pre_hook(pre, with_kwargs=True))
    try:
        with torch.no_grad():
            probe()
    finally:
        for h in hooks:
            h.remove()
    order = {p: i for i, (p, _) in enumerate(block.named_modules())}
    return dict(sorted(seen.items(), key=lambda kv: order[kv[0]]))


def _worth_chunking(module: torch.nn.Module) -> bool:
    """A lone projection holds nothing but its input and output: chunking it saves no memory and
    its backward would redo the matmul."""
    return not isinstance(module, (torch.nn.Linear, torch.nn.Embedding, torch.nn.Dropout, torch.nn.Identity))


def _chunked_forward(module: torch.nn.Module, names: list[str], n: int, seen: torch.Tensor):
    original = module.forward

    def run(x, *ps):
        _state.inside = getattr(_state, "inside", 0) + 1
        try:
            return functional_call(module, dict(zip(names, ps)), (x,), strict=False)
        finally:
            _state.inside -= 1

    def forward(x, *args, **kwargs):
        # Only a call like the one shown token-wise is chunked (a module may be called again on
        # other shapes).
        like = isinstance(x, torch.Tensor) and x.shape == seen.shape and x.dtype == seen.dtype
        if getattr(_state, "inside", 0) or args or kwargs or not like:
            return original(x, *args, **kwargs)
        state = [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()]
        return _ChunkedCall.apply(run, n, x, *state)
    return forward


class _ChunkedCall(torch.autograd.Function):
    """`run(x, *state)` over `n` slices of dim 1 of x; the backward redoes each slice's forward and
    takes its gradient before the next slice is made."""

    @staticmethod
    def forward(ctx, run, n, x, *state):
        ctx.run, ctx.n = run, n
        ctx.save_for_backward(x, *state)
        with torch.no_grad():
            return torch.cat([run(xc, *state) for xc in _slices(x, n)], dim=1)

    @staticmethod
    def backward(ctx, grad):
        x, *state = ctx.saved_tensors
        wants = [t.requires_grad and t.is_floating_point() for t in state]
        sums: list[torch.Tensor | None] = [None] * len(state)
        dx = []
        for xc, gc in zip(_slices(x, ctx.n), _slices(grad, ctx.n)):
            with torch.enable_grad():
                xc = xc.detach().requires_grad_(x.requires_grad)
                leaves = [t.detach().requires_grad_(w) for t, w in zip(state, wants)]
                out = ctx.run(xc, *leaves)
            wrt = ([xc] if x.requires_grad else []) + [t for t, w in zip(leaves, wants) if w]
            # A parameter no slice reaches keeps None, so the stage's trace sees it get no gradient.
            grads = list(torch.autograd.grad(out, wrt, gc, allow_unused=True))
            if x.requires_grad:
                g = grads.pop(0)
                dx.append(torch.zeros_like(xc) if g is None else g)
            for i, w in enumerate(wants):
                g = grads.pop(0) if w else None
                if g is not None:
                    sums[i] = g if sums[i] is None else sums[i] + g
        return (None, None, torch.cat(dx, dim=1) if dx else None, *sums)


def _slices(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """n slices of dim 1 (the sequence), each contiguous, so the module runs the same ops on a
    slice as on the whole (a strided slice would turn its matmuls into batched ones). With one
    sequence per batch a slice is contiguous already and nothing is copied."""
    return [c.contiguous() for c in x.tensor_split(n, dim=1)]


def token_wise(module: torch.nn.Module, names: list[str], x: torch.Tensor, state: list[torch.Tensor],
               n: int) -> str | None:
    """None when `module(x)` keeps every token (the rows of x's first two dims) apart, traced on the
    whole input and on one chunk of it, with the same ops both times; else why not."""
    def fn(x, *ps):
        return functional_call(module, dict(zip(names, ps)), (x,), strict=False)
    try:
        with _fake_tensor_log_quiet():
            whole = make_fx(fn, tracing_mode="fake")(x, *state)
            part = make_fx(fn, tracing_mode="fake")(_slices(x, n)[0], *state)
    except Exception as e:  # noqa: BLE001 - a module that cannot run on a slice is not chunked
        return f"it does not trace on a slice ({type(e).__name__})"
    why = _rows_kept(whole.graph, x) or _rows_kept(part.graph, _slices(x, n)[0])
    if why is None and _ops(whole.graph) != _ops(part.graph):
        why = "it runs other ops on a slice"
    return why


@contextlib.contextmanager
def _fake_tensor_log_quiet():
    """torch logs every meta kernel that raises at ERROR, with its traceback; here a module that
    fails on a slice is an expected answer (not token-wise), which must not read as a crash."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    was = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = was


def _ops(graph: fx.Graph) -> list:
    return [n.target for n in graph.nodes if n.op == "call_function"]


_SAME_ROWS = {aten._to_copy.default, aten.clone.default, aten.alias.default, aten.detach.default,
              aten.copy.default, aten.lift_fresh_copy.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_REDUCE = {aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default, aten.var.correction,
           aten.std.correction}


def _rows_kept(graph: fx.Graph, x: torch.Tensor) -> str | None:
    """Follow the token rows through the graph: for each tensor that carries them, `last[node]` is
    the index of its last row dim (its dims up to it enumerate the B*S tokens in x's order)."""
    rows = x.shape[0] * x.shape[1]
    last: dict[fx.Node, object] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    last[placeholders[0]] = 1

    def shape(a):
        return tuple(a.meta["val"].shape)

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        carried = [a for a in node.all_input_nodes if last.get(a) is not None]
        if not carried:
            if torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ()):
                return f"it draws random numbers ({node.target})"
            continue
        why = _follow(node, carried, last, rows, shape)
        if why is not None:
            return why
    out = next(n for n in graph.nodes if n.op == "output").args[0]
    outs = out if isinstance(out, (list, tuple)) else [out]
    if len(outs) != 1 or last.get(outs[0]) != 1 or shape(outs[0])[:2] != tuple(x.shape[:2]):
        return "its output is not one tensor of the input's [batch, seq] rows"
    return None


def _follow(node: fx.Node, carried: list[fx.Node], last: dict, rows: int, shape) -> str | None:
    t = node.target
    if t is operator.getitem:
        src = last[node.args[0]]
        last[node] = src[node.args[1]] if isinstance(src, tuple) else None
        return None if last[node] is not None else f"it indexes a token tensor ({node})"
    if any(isinstance(last[a], tuple) for a in carried):
        return f"{t} reads a tuple of token tensors"
    tags = getattr(t, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return f"it draws random numbers ({t})"
    out = shape(node) if isinstance(node.meta.get("val"), torch.Tensor) else None
    if torch.Tag.pointwise in tags or t in _SAME_ROWS:
        # Broadcast aligns dims from the right: every token tensor must have its rows in the same
        # place, and no other operand may vary along them.
        place = {last[a] - len(shape(a)) for a in carried}
        if len(place) != 1 or out is None:
            return f"{t} mixes tensors whose token rows do not line up"
        p = place.pop()
        for a in node.all_input_nodes:
            if last.get(a) is None and isinstance(a.meta.get("val"), torch.Tensor):
                s = shape(a)
                if any(s[i] != 1 for i in range(len(s)) if i - len(s) <= p):
                    return f"{t} reads a tensor that varies along the token rows"
        last[node] = len(out) + p
    elif t in (aten.mm.default, aten.addmm.default):
        a, b = (node.args[0], node.args[1]) if t is aten.mm.default else (node.args[1], node.args[2])
        if last.get(a) != 0 or last.get(b) is not None or (t is aten.addmm.default and last.get(node.args[0]) is not None):
            return f"{t} contracts over the token rows"
        last[node] = 0
    elif t in _VIEWS:
        d = last[node.args[0]]
        prefix = [math.prod(out[:i + 1]) for i in range(len(out))]
        if math.prod(shape(node.args[0])[:d + 1]) != rows or rows not in prefix:
            return f"{t} reshapes across the token rows"
        last[node] = prefix.index(rows)
    elif t in _REDUCE or t is aten.native_layer_norm.default:
        d = last[node.args[0]]
        n_in = len(shape(node.args[0]))
        if t is aten.native_layer_norm.default:
            dims = list(range(n_in - len(node.args[1]), n_in))
            if min(dims) <= d:
                return "a layer norm over the token rows"
            last[node] = (d, d, d)
            return None
        dims = node.args[1] if len(node.args) > 1 else None
        dims = [dims] if isinstance(dims, int) else dims
        if not dims or any(k % n_in <= d for k in dims):
            return f"{t} reduces over the token rows"
        last[node] = d
    elif t in (aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
               aten.squeeze.dim, aten.split.Tensor, aten.split_with_sizes.default, aten.slice.Tensor,
               aten.cat.default, aten.expand.default):
        return _feature_only(node, carried, last, shape)
    else:
        return f"it runs {t}, not known to keep tokens apart"
    return None


def _feature_only(node: fx.Node, carried, last: dict, shape) -> str | None:
    """Ops that move, cut or join dims: allowed only on the dims after the token rows."""
    t = node.target
    src = carried[0]
    d, n_in = last[src], len(shape(src))
    if t is aten.cat.default:
        dim = node.args[1] if len(node.args) > 1 else 0
        if len({last.get(a) for a in node.args[0]}) != 1 or dim % n_in <= d:
            return "a cat along the token rows"
        last[node] = d
    elif t is aten.t.default:
        return "a transpose of the token rows"
    elif t is aten.transpose.int:
        if min(node.args[1] % n_in, node.args[2] % n_in) <= d:
            return "a transpose of the token rows"
        last[node] = d
    elif t is aten.permute.default:
        if list(node.args[1][:d + 1]) != list(range(d + 1)):
            return "a permute of the token rows"
        last[node] = d
    elif t is aten.unsqueeze.default:
        if node.args[1] % (n_in + 1) <= d:
            return "an unsqueeze among the token rows"
        last[node] = d
    elif t is aten.squeeze.dim:
        if node.args[1] % n_in <= d:
            return "a squeeze among the token rows"
        last[node] = d
    elif t is aten.expand.default:
        if tuple(node.args[1][-n_in:][:d + 1]) != shape(src)[:d + 1] or len(node.args[1]) != n_in:
            return "an expand of the token rows"
        last[node] = d
    else:   # split, split_with_sizes, slice: along args[2] (slice) or args[2] (split dim)
        dim = node.args[2] if len(node.args) > 2 else 0
        if dim % n_in <= d:
            return f"{t} cuts the token rows"
        last[node] = d if t is aten.slice.Tensor else tuple(d for _ in node.meta["val"])
    return None
