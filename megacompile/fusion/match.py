"""A small structural matcher for ATen graphs.

A pattern is a tree of `Op` (an ATen call with argument patterns), `Var` (any node, bound to a
name: the same name must bind the same node everywhere in one match), `Const` (a non-node
argument meeting a predicate), `Alt` (alternatives, tried in order) and `ANY`. Plain Python
values in a pattern must equal the argument. `add.Tensor` and `mul.Tensor` match in either
argument order. `detach` and `alias` are looked through, since autograd puts them in front of
saved values at random.

    rstd = Op(aten.rsqrt.default, Op(aten.add.Tensor, Var("var"), Const(is_float)), name="rstd")
    for b in matches(rstd, node): b["var"], b["rstd"], b.nodes

Every match is a `Binding`: the names bound, plus `nodes`, the graph nodes the Op patterns
consumed (what the kernel will replace).
"""
from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

aten = torch.ops.aten

PASSTHROUGH = {aten.detach.default, aten.alias.default}
# ops that only re-describe a tensor's shape: a chain of them is still the same values
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.alias.default,
            aten.detach.default}
COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}
# kwargs a pattern may leave unstated: they restate where the value already lives
IGNORED_KWARGS = {"layout", "device", "pin_memory"}


def is_call(value: Any, targets: Iterable | Any = None) -> bool:
    if not isinstance(value, fx.Node) or value.op != "call_function":
        return False
    if targets is None:
        return True
    if isinstance(targets, (set, frozenset, list, tuple)):
        return value.target in targets
    return value.target is targets


def peel(value: Any) -> Any:
    """The value under any chain of detach/alias nodes."""
    while is_call(value, PASSTHROUGH):
        value = value.args[0]
    return value


def single_user(node: fx.Node) -> bool:
    return len(node.users) == 1


def plain_cast(node: Any) -> bool:
    """A dtype cast that does nothing else (no memory format, no copy flags)."""
    return is_call(node, aten._to_copy.default) and set(node.kwargs) <= {"dtype", "layout", "device"}


def getitems(node: fx.Node) -> dict[int, fx.Node]:
    """The getitem readers of a node with several outputs, by index."""
    return {u.args[1]: u for u in node.users if is_call(u, operator.getitem)}


def val(node: Any) -> Any:
    """The traced fake value of a node (a fake tensor, a tuple of them, or a constant)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


class Binding(dict):
    """Names bound by a match, plus the matched nodes in `nodes`."""

    def __init__(self, *args, nodes: tuple = (), **kwargs):
        super().__init__(*args, **kwargs)
        self.nodes = nodes

    def bind(self, name: str, node: Any) -> "Binding | None":
        if name in self:
            return self if self[name] is node else None
        out = Binding(self, nodes=self.nodes)
        out[name] = node
        return out

    def consume(self, *nodes: fx.Node) -> "Binding":
        return Binding(self, nodes=self.nodes + tuple(n for n in nodes if n not in self.nodes))


class Pattern:
    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        raise NotImplementedError


class Op(Pattern):
    """A call of one of `targets` whose arguments match `args` (and `kwargs`, by name)."""

    def __init__(self, targets, *args, name: str | None = None, **kwargs):
        self.targets = targets if isinstance(targets, (set, frozenset)) else {targets}
        self.args, self.kwargs, self.name = args, kwargs, name

    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        node = value
        skipped = []
        while is_call(node, PASSTHROUGH):
            skipped.append(node)
            node = node.args[0]
        if not is_call(node, self.targets) or len(node.args) != len(self.args):
            return
        if any(k not in self.kwargs and k not in IGNORED_KWARGS for k in node.kwargs):
            return
        if self.name is not None:
            b = b.bind(self.name, node)
            if b is None:
                return
        b = b.consume(*skipped, node)
        orders = [self.args]
        if node.target in COMMUTATIVE and len(self.args) == 2:
            orders.append((self.args[1], self.args[0]))
        for order in orders:
            for b2 in _match_all(list(order), list(node.args), b):
                yield from _match_kwargs(self.kwargs, node.kwargs, b2)


class Var(Pattern):
    """Any graph node (looked through detach/alias), bound to `name`; `pred` may restrict it."""

    def __init__(self, name: str, pred: Callable[[fx.Node], bool] | None = None):
        self.name, self.pred = name, pred

    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        node = peel(value)
        if not isinstance(node, fx.Node) or (self.pred is not None and not self.pred(node)):
            return
        b = b.bind(self.name, node)
        if b is not None:
            yield b


class Const(Pattern):
    """A non-node argument meeting `pred`, bound to `name` when given."""

    def __init__(self, pred: Callable[[Any], bool], name: str | None = None):
        self.pred, self.name = pred, name

    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        if isinstance(value, fx.Node) or not self.pred(value):
            return
        if self.name is not None:
            b = b.bind(self.name, value)
            if b is None:
                return
        yield b


class Alt(Pattern):
    def __init__(self, *options):
        self.options = options

    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        for option in self.options:
            yield from _match(option, value, b)


class _Any(Pattern):
    def match(self, value: Any, b: Binding) -> Iterator[Binding]:
        yield b


ANY = _Any()


def _match(pattern: Any, value: Any, b: Binding) -> Iterator[Binding]:
    if isinstance(pattern, Pattern):
        yield from pattern.match(value, b)
    elif isinstance(pattern, (list, tuple)) and any(isinstance(p, Pattern) for p in pattern):
        if isinstance(value, (list, tuple)) and len(value) == len(pattern):
            yield from _match_all(list(pattern), list(value), b)
    elif not isinstance(value, fx.Node) and _same_constant(pattern, value):
        yield b


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_constant(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return a == b


def _match_all(patterns: list, values: list, b: Binding) -> Iterator[Binding]:
    if not patterns:
        yield b
        return
    for b2 in _match(patterns[0], values[0], b):
        yield from _match_all(patterns[1:], values[1:], b2)


def _match_kwargs(patterns: dict, values: dict, b: Binding) -> Iterator[Binding]:
    names = list(patterns)
    if any(n not in values for n in names):
        return
    yield from _match_all([patterns[n] for n in names], [values[n] for n in names], b)


def matches(pattern: Pattern, node: Any, bound: dict | None = None) -> Iterator[Binding]:
    """Every way `pattern` matches at `node`, starting from the names in `bound`."""
    yield from _match(pattern, node, Binding(bound or {}))


def first_match(pattern: Pattern, node: Any, bound: dict | None = None) -> Binding | None:
    return next(matches(pattern, node, bound), None)


# -- predicates used by the patterns --------------------------------------------------------
def number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def equals(v: float) -> Callable[[Any], bool]:
    return lambda x: number(x) and float(x) == float(v)


def close_to(v: float, rtol: float = 1e-6) -> Callable[[Any], bool]:
    return lambda x: number(x) and abs(float(x) - v) <= rtol * abs(v)


def floating(node: fx.Node) -> bool:
    t = val(node)
    return isinstance(t, torch.Tensor) and t.dtype.is_floating_point


def cast_of(pattern: Any, dtype: torch.dtype | None = None) -> Op:
    """`_to_copy(pattern, dtype=...)`, the cast HF norms put around their fp32 math."""
    return Op(aten._to_copy.default, pattern, dtype=Const(lambda d: dtype is None or d == dtype))


def maybe_cast(pattern: Any, dtype: torch.dtype | None = None) -> Alt:
    return Alt(cast_of(pattern, dtype), pattern)

