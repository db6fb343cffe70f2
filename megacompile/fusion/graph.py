"""Graph surgery for the fusion pass: put a kernel node where a matched group of ATen nodes was.

A kernel node's target is a launcher: a Python callable with a `kernel` name and a `meta`
function that makes its outputs as fake tensors (shape, dtype, strides, one storage per output),
so the memory simulator and the runtime see the same values. Every output that takes the place
of an original node is adapted to that node's shape and dtype (a view, a cast), so the nodes
around the group, and the other graph of the pair, keep reading what they read before.
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor

from megacompile.capture.split import is_random
from megacompile.ir.stage_program import fake_storage_key

from .match import is_call, val

aten = torch.ops.aten


def launcher(kernel: str, meta: Callable):
    """Mark `fn` as a kernel-node target: `kernel` names it in reports, `meta` gives fake outputs."""
    def wrap(fn):
        fn.kernel, fn.meta = kernel, meta
        return fn
    return wrap


def alive(node: fx.Node) -> bool:
    """Not erased by an earlier rewrite of the loop that is visiting it."""
    return not getattr(node, "_erased", False)


def is_kernel(node: fx.Node) -> bool:
    return node.op == "call_function" and hasattr(node.target, "kernel") and "fused_from" in node.meta


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of gm's graph (node metas copied, fake values shared)."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    old_out = next(n for n in gm.graph.nodes if n.op == "output")
    new_out = next(n for n in graph.nodes if n.op == "output")
    new_out.meta = dict(old_out.meta)
    return fx.GraphModule(gm, graph)


def fake_mode_of(graph: fx.Graph):
    for n in graph.nodes:
        for t in _tensors(n.meta.get("val")):
            if isinstance(t, FakeTensor):
                return t.fake_mode
    raise ValueError("the graph carries no fake tensors in node.meta['val']")


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def nodes_in(*values: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(values, lambda n: found.append(n))
    return list(dict.fromkeys(found))


class GraphEdit:
    """Edits one stage graph in place; `touched` collects nodes that may have become dead."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.graph = gm, gm.graph
        # A graph that computes nothing (the backward of a frozen stage nothing before it trains:
        # a LoRA model's embedding) has no fake tensors, and no rewrite makes a node in it.
        computes = any(n.op not in ("placeholder", "output") for n in gm.graph.nodes)
        self.fake_mode = fake_mode_of(gm.graph) if computes else None
        self.touched: list[fx.Node] = []
        self.kernels: list[fx.Node] = []

    # -- making nodes ----------------------------------------------------------------------
    def fake(self, target, args: tuple, kwargs: dict) -> Any:
        fargs = fx.node.map_arg(args, val)
        fkwargs = fx.node.map_arg(kwargs, val)
        with self.fake_mode:
            if hasattr(target, "meta"):
                return target.meta(*fargs, **fkwargs)
            return target(*fargs, **fkwargs)

    def call(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """A new node at the current insertion point, with its fake value."""
        kwargs = kwargs or {}
        node = self.graph.call_function(target, args, kwargs)
        node.meta["val"] = self.fake(target, args, kwargs)
        return node

    def adapt(self, src: fx.Node, like: fx.Node) -> fx.Node:
        """src viewed and cast to like's shape and dtype."""
        s, o = val(src), val(like)
        if tuple(s.shape) != tuple(o.shape):
            op = aten.view.default if s.is_contiguous() else aten.reshape.default
            src = self.call(op, (src, list(o.shape)))
        if s.dtype != o.dtype:
            src = self.call(aten._to_copy.default, (src,), {"dtype": o.dtype})
        return src

    # -- replacing a group -----------------------------------------------------------------
    def replace(self, target, args: tuple, kwargs: dict, replaces: dict[int, fx.Node],
                matched: Iterable[fx.Node], keep: Iterable[fx.Node] = ()) -> tuple[fx.Node, list[fx.Node]] | None:
        """Put `target(*args, **kwargs)` in place of the `matched` nodes; its output i takes the
        place of replaces[i]. Refuses (None) when a matched node that is neither replaced nor in
        `keep` is read outside the group, or when no position is after every input and before
        every reader. Returns the kernel node and one node per output."""
        matched = [n for n in dict.fromkeys(matched) if alive(n)]   # pruning may have taken some
        group = set(matched)
        replaced = set(replaces.values())
        keep = set(keep)
        for n in group - replaced - keep:
            if any(u not in group for u in n.users):
                return None
        nodes = list(self.graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        inputs = nodes_in(args, kwargs)
        if any(i in group - keep for i in inputs):
            return None
        lo = max((pos[i] for i in inputs), default=-1) + 1
        readers = [u for r in replaced for u in r.users if u not in group]
        hi = min((pos[u] for u in readers), default=len(nodes) - 1)
        at = max(lo, min(max(pos[m] for m in group) + 1, hi))
        if at > hi:
            return None
        with self.graph.inserting_before(nodes[at]):
            kernel = self.call(target, tuple(args), dict(kwargs))
            kernel.meta["kernel"] = target.kernel
            kernel.meta["fused_from"] = [n.name for n in sorted(group - keep, key=pos.__getitem__)
                                         if n.op == "call_function"]
            outs = kernel.meta["val"]
            n_out = len(outs) if isinstance(outs, (tuple, list)) else 1
            items = [kernel] if n_out == 1 and not isinstance(outs, (tuple, list)) else [
                self.call(operator.getitem, (kernel, i)) for i in range(n_out)]
            for i, original in replaces.items():
                kernel.meta["fused_from"] += self._skip_round_trip(items[i], original, group)
                if any(u not in group for u in original.users):
                    adapted = self.adapt(items[i], original)
                    original.replace_all_uses_with(adapted)
                    self._refresh_views(adapted, _storages(val(original)))
        self.touched.extend(matched)
        if len(items) > 1:
            self.touched.extend(items)   # a getitem nobody reads goes; the kernel stays while one is read
        self.kernels.append(kernel)
        return kernel, items

    def _skip_round_trip(self, src: fx.Node, original: fx.Node, group: set) -> list[str]:
        """Readers that cast `original` back to src's dtype read src itself when src -> original's
        dtype widens exactly (bf16 -> fp32): the kernel already rounded to what they want. Returns
        the names of the casts so skipped."""
        s, o = val(src), val(original)
        if (s.shape != o.shape or s.dtype == o.dtype or not (s.dtype.is_floating_point and o.dtype.is_floating_point)
                or torch.finfo(s.dtype).bits >= torch.finfo(o.dtype).bits):
            return []
        skipped = []
        for u in list(original.users):
            if (u not in group and is_call(u, aten._to_copy.default) and u.kwargs.get("dtype") == s.dtype
                    and set(u.kwargs) <= {"dtype", "layout", "device"}):
                u.replace_all_uses_with(src)
                self.touched.append(u)
                skipped.append(u.name)
        return skipped

    def _refresh_views(self, node: fx.Node, old: set) -> None:
        """Readers of a replaced node that were views of its storage still carry fake values over
        the old storage; trace them again over the new one, so each storage is counted once."""
        stack = [node]
        while stack:
            n = stack.pop()
            for u in n.users:
                if u.op != "call_function" or hasattr(u.target, "kernel"):
                    continue
                if _storages(val(u)) & old:
                    u.meta["val"] = self.fake(u.target, u.args, u.kwargs)
                    stack.append(u)

    def sum_of(self, a: fx.Node, b: fx.Node) -> fx.Node | None:
        """A node holding a + b, made by reassociating the add tree that sums a and b with other
        terms (autograd accumulates a gradient's pieces into a running sum one at a time):
        ((r + a) + b) becomes r + (a + b). None when a and b meet in no such tree."""
        chains = []
        for leaf in (a, b):
            chain, n = [], leaf
            while len(n.users) == 1:
                (u,) = n.users
                if not _plain_add(u):
                    break
                chain.append(u)
                n = u
            chains.append(chain)
        common = next((n for n in chains[0] if n in chains[1]), None)
        if common is None:
            return None
        tree = list(dict.fromkeys(chains[0][:chains[0].index(common) + 1] + chains[1][:chains[1].index(common) + 1]))
        if any(val(n).shape != val(common).shape or val(n).dtype != val(common).dtype for n in tree):
            return None
        leaves = [x for n in tree for x in n.args if x not in tree]
        others = [x for x in leaves if x is not a and x is not b]
        if not others:
            return common
        with self.graph.inserting_before(common):
            both = self.call(aten.add.Tensor, (a, b))
            rest = others[0]
            for o in others[1:]:
                rest = self.call(aten.add.Tensor, (rest, o))
        common.args = (rest, both)
        for n in reversed(tree):   # the partial sums below common: nothing reads them now
            if n is not common and not n.users:
                self.graph.erase_node(n)
        return both

    # -- cleaning up -----------------------------------------------------------------------
    def dce(self) -> None:
        """Erase the touched nodes that nothing reads any more, and what only they read."""
        work = list(self.touched)
        self.touched = []
        while work:
            n = work.pop()
            if not alive(n) or n.graph is not self.graph or n.users or n.op != "call_function" or is_random(n):
                continue
            inputs = n.all_input_nodes
            self.graph.erase_node(n)
            work.extend(inputs)


def _storages(value: Any) -> set:
    return {fake_storage_key(t) for t in _tensors(value)}


def _plain_add(n: fx.Node) -> bool:
    return is_call(n, aten.add.Tensor) and not n.kwargs and all(isinstance(x, fx.Node) for x in n.args)
