"""Generated Triton kernels for chains of elementwise ATen ops that no hand-written kernel covers.

After the pattern rewrites, connected groups of two or more elementwise nodes of one output shape
become one generated kernel: one load per input, the ops in fp32 registers, one store per value the
rest of the graph reads. The intermediates never reach memory. Each group is printed as Triton
source; the source is the cache key, so every block's residual add + cast (or any chain that repeats)
compiles once. Eager rounding is kept: a node whose dtype is bf16/fp16 is rounded to it (to nearest
even, kernels/cast.py round_to) before the next op reads it, as eager would store and reload it;
division and square root are the IEEE-rounded forms (div_rn, sqrt_rn) and kernels launch without
FMA contraction, so +, -, *, / and sqrt round as eager's do on the device too. exp, log, rsqrt,
sigmoid, tanh and erf are the GPU's approximations (a few ulp, as CUDA's own expf is not exact
either): tolerances, not bits, for those.

Inputs a group accepts: the group's shape and contiguous (indexed by the flat offset), a single
element (loaded once), or anything that broadcasts to the group's shape (indexed through the
output's coordinates and the input's broadcast strides). Outputs are contiguous, and only nodes
whose traced value is contiguous join a group, so every reader sees the layout it saw before.
Anything else stays eager ATen.
"""
from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
from typing import Callable

import torch
import torch.fx as fx
import triton

from megacompile.capture.split import is_random
from megacompile.kernels import outputs
from megacompile.kernels.tiling import flat_block

from .graph import GraphEdit
from .match import is_call, number, val

aten = torch.ops.aten
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.bool: "i1"}
TL_DTYPES = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}


# -- the ops a generated kernel knows: arguments (variable names or literals) -> expression ---
def _binary(fmt: str) -> Callable:
    def emit(node: fx.Node, a: list[str]) -> str | None:
        alpha = node.kwargs.get("alpha", 1)
        if not number(alpha):
            return None
        b = a[1] if alpha == 1 else f"({a[1]} * {_literal(alpha)})"
        return fmt.format(a[0], b)
    return emit


def _unary(fmt: str) -> Callable:
    return lambda node, a: fmt.format(a[0])


def _pow(node: fx.Node, a: list[str]) -> str | None:
    exponent = node.args[1]
    forms = {0.5: "tl.math.sqrt_rn({0})", -0.5: "tl.rsqrt({0})", 1.0: "{0}", 2.0: "({0} * {0})",
             3.0: "({0} * {0} * {0})", -1.0: "tl.math.div_rn(1.0, {0})", -2.0: "tl.math.div_rn(1.0, {0} * {0})"}
    return forms[float(exponent)].format(a[0]) if number(exponent) and float(exponent) in forms else None


def _where(node: fx.Node, a: list[str]) -> str:
    return f"tl.where({a[0]}, {a[1]}, {a[2]})"


def _copy(node: fx.Node, a: list[str]) -> str | None:
    kwargs = set(node.kwargs) - {"dtype", "layout", "device", "memory_format"}
    fmt = node.kwargs.get("memory_format")
    if kwargs or fmt not in (None, torch.contiguous_format, torch.preserve_format):
        return None
    return a[0] if val(node).dtype.is_floating_point else None   # the value; the store rounds it


def _silu_backward(node: fx.Node, a: list[str]) -> str:
    return f"({a[0]} * tl.sigmoid({a[1]}) * (1.0 + {a[1]} * (1.0 - tl.sigmoid({a[1]}))))"


def _threshold_backward(node: fx.Node, a: list[str]) -> str:
    return f"tl.where({a[1]} <= {a[2]}, 0.0, {a[0]})"


OPS: dict = {
    aten.add.Tensor: _binary("({0} + {1})"), aten.add.Scalar: _binary("({0} + {1})"),
    aten.sub.Tensor: _binary("({0} - {1})"), aten.sub.Scalar: _binary("({0} - {1})"),
    aten.rsub.Scalar: _binary("({1} - {0})"),
    aten.mul.Tensor: _binary("({0} * {1})"), aten.mul.Scalar: _binary("({0} * {1})"),
    aten.div.Tensor: _binary("tl.math.div_rn({0}, {1})"), aten.div.Scalar: _binary("tl.math.div_rn({0}, {1})"),
    aten.maximum.default: _binary("tl.maximum({0}, {1})"), aten.minimum.default: _binary("tl.minimum({0}, {1})"),
    aten.neg.default: _unary("(-{0})"), aten.abs.default: _unary("tl.abs({0})"),
    aten.exp.default: _unary("tl.exp({0})"), aten.log.default: _unary("tl.log({0})"),
    aten.sqrt.default: _unary("tl.math.sqrt_rn({0})"), aten.rsqrt.default: _unary("tl.rsqrt({0})"),
    aten.reciprocal.default: _unary("tl.math.div_rn(1.0, {0})"), aten.sigmoid.default: _unary("tl.sigmoid({0})"),
    aten.tanh.default: _unary("_tanh({0})"), aten.sin.default: _unary("tl.sin({0})"),
    aten.cos.default: _unary("tl.cos({0})"), aten.erf.default: _unary("tl.math.erf({0})"),
    aten.silu.default: _unary("({0} * tl.sigmoid({0}))"),
    aten.relu.default: _unary("tl.where({0} > 0.0, {0}, 0.0)"),
    aten.pow.Tensor_Scalar: _pow,
    aten.where.self: _where,
    aten._to_copy.default: _copy, aten.clone.default: _copy,
    aten.silu_backward.default: _silu_backward,
    aten.tanh_backward.default: lambda n, a: f"({a[0]} * (1.0 - {a[1]} * {a[1]}))",
    aten.sigmoid_backward.default: lambda n, a: f"({a[0]} * {a[1]} * (1.0 - {a[1]}))",
    aten.threshold_backward.default: _threshold_backward,
    aten.eq.Tensor: _binary("({0} == {1})"), aten.eq.Scalar: _binary("({0} == {1})"),
    aten.ne.Tensor: _binary("({0} != {1})"), aten.ne.Scalar: _binary("({0} != {1})"),
    aten.lt.Tensor: _binary("({0} < {1})"), aten.lt.Scalar: _binary("({0} < {1})"),
    aten.le.Tensor: _binary("({0} <= {1})"), aten.le.Scalar: _binary("({0} <= {1})"),
    aten.gt.Tensor: _binary("({0} > {1})"), aten.gt.Scalar: _binary("({0} > {1})"),
    aten.ge.Tensor: _binary("({0} >= {1})"), aten.ge.Scalar: _binary("({0} >= {1})"),
}

PRELUDE = '''import triton
import triton.language as tl

from megacompile.kernels.cast import round_to


@triton.jit
def _tanh(x):
    # tanh without libdevice: sign(x) (1 - e) / (1 + e), e = exp(-2|x|); a short series near 0,
    # where 1 - e would cancel
    ax = tl.abs(x)
    e = tl.exp(ax * -2.0)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 - x2 * (0.3333333333333333 - x2 * (0.13333333333333333 - x2 * 0.05396825396825397)))
    t = tl.where(ax < 0.0625, small, big)
    return tl.where(x < 0.0, -t, t)
'''


_KIND_NOTE = {"flat": "[n] contiguous", "scalar": "one element", "strided": "broadcast to [n] by the strides below"}


def _literal(x) -> str:
    if x is None:
        return "None"
    if isinstance(x, bool):
        return "1.0" if x else "0.0"
    x = float(x)
    if math.isnan(x):
        return 'float("nan")'
    if math.isinf(x):
        return 'float("inf")' if x > 0 else 'float("-inf")'
    return repr(x)


# -- which nodes may join a group -----------------------------------------------------------
def _tensor_dtype_ok(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in DTYPES


def _candidate(node: fx.Node) -> bool:
    if not is_call(node) or node.target not in OPS or is_random(node):
        return False
    out = val(node)
    if not _tensor_dtype_ok(out) or not out.is_contiguous() or out.numel() == 0:
        return False
    if any(isinstance(v, fx.Node) for v in node.kwargs.values()):
        return False
    for a in node.args:
        if isinstance(a, fx.Node):
            t = val(a)
            if not _tensor_dtype_ok(t):
                return False
            try:
                if tuple(torch.broadcast_shapes(t.shape, out.shape)) != tuple(out.shape):
                    return False
            except RuntimeError:
                return False
        elif not (a is None or number(a) or isinstance(a, bool)):
            return False
    emitted = OPS[node.target](node, [f"a{i}" for i in range(len(node.args))])
    return emitted is not None


def _depends_on(start: fx.Node, group: set[fx.Node], floor: int, pos: dict, seen: set[fx.Node]) -> bool:
    """Does `start` read any node of `group` through nodes outside it (only nodes after `floor`)?
    `seen`: nodes an earlier search for the same group went through without reaching it."""
    stack = [start]
    while stack:
        n = stack.pop()
        if n in seen or pos[n] < floor:
            continue
        seen.add(n)
        for i in n.all_input_nodes:
            if i in group:
                return True
            stack.append(i)
    return False


def find_groups(graph: fx.Graph) -> list[list[fx.Node]]:
    """Connected groups (producer -> consumer) of >= 2 candidate nodes with one output shape. A node
    joins, and so merges, the groups of its producers of its shape, as many as can be merged without
    a path from the group back into it through a node outside (which would make a cycle)."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    group_of: dict[fx.Node, int] = {}
    groups: dict[int, list[fx.Node]] = {}
    for node in graph.nodes:
        if not _candidate(node):
            continue
        shape = tuple(val(node).shape)
        merged = [node]
        homes = []
        for p in reversed(node.all_input_nodes):
            g = group_of.get(p)
            if g is None or g in homes or tuple(val(groups[g][0]).shape) != shape:
                continue
            trial = groups[g] + merged
            if _closed(trial, pos):
                merged, homes = trial, homes + [g]
        key = homes[0] if homes else len(pos) + pos[node]
        for g in homes:
            groups.pop(g)
        groups[key] = sorted(merged, key=pos.__getitem__)
        for n in merged:
            group_of[n] = key
    return [g for g in sorted(groups.values(), key=lambda g: pos[g[0]]) if len(g) >= 2]


def _closed(members: list[fx.Node], pos: dict) -> bool:
    """No input of the group from outside it depends on a member (the group can be one node)."""
    group = set(members)
    floor = min(pos[m] for m in members)
    seen: set[fx.Node] = set()
    return not any(_depends_on(i, group, floor, pos, seen) for m in members for i in m.all_input_nodes
                   if i not in group)


# -- code generation ------------------------------------------------------------------------
class ElementwiseKernel:
    """A generated kernel as a node target: kernel(shape, *inputs) -> output(s), plus its meta."""
    kernel = "elementwise"

    def __init__(self, source: str, kinds: list[str], in_dtypes: list[torch.dtype], out_dtypes: list[torch.dtype],
                 ndim: int):
        self.source, self.kinds, self.in_dtypes, self.out_dtypes, self.ndim = source, kinds, in_dtypes, out_dtypes, ndim
        self.key = hashlib.sha1(source.encode()).hexdigest()[:16]
        self.__name__ = f"elementwise_{self.key}"
        self.__module__ = __name__
        self.path = _write_source(self.key, source)
        self._fn = None

    @property
    def fn(self):
        if self._fn is None:
            name = f"megacompile_elementwise_{self.key}"
            spec = importlib.util.spec_from_file_location(name, self.path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            self._fn = module.elementwise_kernel
        return self._fn

    @property
    def strided(self) -> bool:
        return "strided" in self.kinds

    def meta(self, shape, *inputs):
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs = tuple(torch.empty(shape, dtype=d, device=device) for d in self.out_dtypes)
        return outs if len(outs) > 1 else outs[0]

    def __call__(self, shape, *inputs):
        shape = tuple(shape)
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        outs_list = [outputs.empty(shape, dtype=d, device=device) for d in self.out_dtypes]   # where given, the arena's
        outs = tuple(outs_list) if len(outs_list) > 1 else outs_list[0]
        args: list = list(outs_list)
        for kind, t in zip(self.kinds, inputs):
            if kind == "flat" and (tuple(t.shape) != shape or not t.is_contiguous()):
                t = t.expand(shape).contiguous()
            args.append(t)
            if kind == "strided":
                args.extend(t.expand(shape).stride())
        if self.strided:
            args.extend(shape[1:])
        n = math.prod(shape)
        args.append(n)
        block, num_warps = flat_block(n)
        # No FMA contraction: eager rounds every op (kernels.md, "Rounding on the device").
        self.fn[(triton.cdiv(n, block),)](*args, BLOCK=block, num_warps=num_warps, enable_fp_fusion=False)
        return outs

    def signature(self) -> dict[str, str]:
        """Argument name -> Triton type, as the launcher passes them (for a compile without a GPU)."""
        sig = {f"out{i}_ptr": "*" + DTYPES[d] for i, d in enumerate(self.out_dtypes)}
        for i, (kind, d) in enumerate(zip(self.kinds, self.in_dtypes)):
            sig[f"in{i}_ptr"] = "*" + DTYPES[d]
            if kind == "strided":
                sig.update({f"in{i}_s{k}": "i32" for k in range(self.ndim)})
        if self.strided:
            sig.update({f"size{k}": "i32" for k in range(1, self.ndim)})
        sig["n"] = "i32"
        sig["BLOCK"] = "constexpr"
        return sig


def _kernel_dir() -> str:
    root = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
    path = os.path.join(root, "megacompile_elementwise")
    os.makedirs(path, exist_ok=True)
    return path


def _write_source(key: str, source: str) -> str:
    path = os.path.join(_kernel_dir(), f"elementwise_{key}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(source)
        os.replace(tmp, path)
    return path


_CACHE: dict[str, ElementwiseKernel] = {}


def generate(group: list[fx.Node]) -> tuple[ElementwiseKernel, list[fx.Node], list[fx.Node]]:
    """The kernel for `group` (from the cache when its source was seen), its input nodes and the
    group nodes it stores, in argument order."""
    members = set(group)
    shape = tuple(val(group[0]).shape)
    inputs: list[fx.Node] = []
    for n in group:
        for a in n.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in group if any(u not in members for u in n.users)]
    kinds = []
    for a in inputs:
        t = val(a)
        if tuple(t.shape) == shape and t.is_contiguous():
            kinds.append("flat")
        elif t.numel() == 1:
            kinds.append("scalar")
        else:
            kinds.append("strided")
    ndim = len(shape)
    params = []
    for i, n in enumerate(outputs):
        params.append(f"    out{i}_ptr,  # *{DTYPES[val(n).dtype]} [n] contiguous")
    for i, (a, kind) in enumerate(zip(inputs, kinds)):
        params.append(f"    in{i}_ptr,  # *{DTYPES[val(a).dtype]} {_KIND_NOTE[kind]}")
        if kind == "strided":
            params.append("    " + ", ".join(f"in{i}_s{k}" for k in range(ndim)) + f",  # in{i}'s broadcast strides")
    if "strided" in kinds and ndim > 1:
        params.append("    " + ", ".join(f"size{k}" for k in range(1, ndim)) + ",  # the output's dims after the first")
    params.append("    n,  # elements")
    params.append("    BLOCK: tl.constexpr,")
    body = ["    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)", "    mask = offs < n"]
    if "strided" in kinds:
        body.append("    r = offs")
        for k in range(ndim - 1, 0, -1):
            body.append(f"    i{k} = r % size{k}")
            body.append(f"    r = r // size{k}")
        body.append("    i0 = r")
    names: dict[fx.Node, str] = {}
    for i, (a, kind) in enumerate(zip(inputs, kinds)):
        t = val(a)
        to = ".to(tl.float32)" if t.dtype.is_floating_point else ""
        if kind == "flat":
            body.append(f"    in{i} = tl.load(in{i}_ptr + offs, mask=mask, other=0){to}")
        elif kind == "scalar":
            body.append(f"    in{i} = tl.load(in{i}_ptr){to}")
        else:
            index = " + ".join(f"i{k} * in{i}_s{k}" for k in range(ndim))
            body.append(f"    in{i} = tl.load(in{i}_ptr + {index}, mask=mask, other=0){to}")
        names[a] = f"in{i}"
    for k, n in enumerate(group):
        args = [names[a] if isinstance(a, fx.Node) else _literal(a) for a in n.args]
        expr = OPS[n.target](n, args)
        body.append(f"    v{k} = {expr}  # {n.target}")
        dtype = val(n).dtype
        if dtype in (torch.bfloat16, torch.float16):
            body.append(f"    v{k} = round_to(v{k}, {TL_DTYPES[dtype]}).to(tl.float32)")
        names[n] = f"v{k}"
    for i, n in enumerate(outputs):
        body.append(f"    tl.store(out{i}_ptr + offs, round_to({names[n]}, out{i}_ptr.dtype.element_ty), mask=mask)")
    source = (PRELUDE + "\n\n@triton.jit\ndef elementwise_kernel(\n" + "\n".join(params) + "\n):\n"
              + "\n".join(body) + "\n")
    kernel = _CACHE.get(source)
    if kernel is None:
        kernel = _CACHE[source] = ElementwiseKernel(
            source, kinds, [val(a).dtype for a in inputs], [val(n).dtype for n in outputs], ndim)
    return kernel, inputs, outputs


def fuse_elementwise(edit: GraphEdit) -> int:
    """Replace every group of find_groups(edit.graph) that can be placed with a generated kernel."""
    count = 0
    for group in find_groups(edit.graph):
        kernel, inputs, outputs = generate(group)
        shape = list(val(group[0]).shape)
        done = edit.replace(kernel, (shape, *inputs), {}, dict(enumerate(outputs)), group)
        count += bool(done)
    return count


def generated_kernels() -> list[ElementwiseKernel]:
    """Every kernel generated in this process (the GPU compile check walks them)."""
    return list(_CACHE.values())
