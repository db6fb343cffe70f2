"""Find the model's decoder blocks, and which of them can share one traced template."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy
import torch
import torch.nn as nn

from ..errors import CaptureError
from .deepstack import merger_lists
from .leaf import BlockCall


@dataclass(frozen=True)
class BlockStack:
    """The blocks capture streams: the decoder's, and those of the towers beside it.

    A vision-language model's vision tower is a stack of its own (LLaVA's CLIP layers at
    "model.vision_tower.vision_model.encoder.layers"): its blocks are streamed like the decoder's,
    in the order the model calls them. `blocks` holds the towers' blocks first, then the decoder's;
    `block_path(i)` names each one."""
    path: str                 # module path of the decoder's nn.ModuleList, e.g. "model.layers"
    blocks: tuple[nn.Module, ...]
    towers: tuple[str, ...] = ()        # module paths of the towers' lists
    tower_sizes: tuple[int, ...] = ()   # how many of `blocks` each tower holds, in that order

    def block_path(self, i: int) -> str:
        for tower, size in zip(self.towers, self.tower_sizes):
            if i < size:
                return f"{tower}.{i}"
            i -= size
        return f"{self.path}.{i}" if self.path else str(i)

    def list_of(self, i: int) -> str:
        """The module path of the list block `i` belongs to."""
        return self.block_path(i).rsplit(".", 1)[0] if "." in self.block_path(i) else ""

    @property
    def decoder(self) -> range:
        """The indices of the decoder's blocks."""
        return range(sum(self.tower_sizes), len(self.blocks))

    def refuse_backward_hooks(self) -> None:
        """A backward hook on a block module itself wraps the block's call, outside what its
        template traces: it would never run. Hooks on modules inside a block are traced."""
        for i, block in enumerate(self.blocks):
            if block._backward_hooks or block._backward_pre_hooks:
                raise CaptureError(
                    f"{self.block_path(i)} has a backward hook on the block module itself, which megacompile "
                    "cannot run (each block is traced as one unit from inside its forward): register the "
                    "hook on a module inside the block, or remove it")


def _signature(module: nn.Module) -> tuple:
    """The structure two blocks must share to share a template: the same parameter slots."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    classes = tuple(type(m).__name__ for m in module.modules())
    return type(module), params, buffers, classes


def find_block_stack(model: nn.Module) -> BlockStack | None:
    """The nn.ModuleList of blocks holding the most parameters, or None; with the towers beside it.

    A list is a stack when at least two of its modules are of one class: its blocks may differ
    (another class in one layer, an extra module, a per-layer flag), and those that differ get
    their own template (`share_templates`). A list of modules all of different classes (an
    embedding, a body, a head) is no stack; a list of one module neither.
    In a model with a token embedding, lists beside it come first (a vision-language model's
    decoder layers, not its vision tower's, whichever is larger). The stacks outside the token
    embedding's module and outside each other are towers, streamed too, in a model with a vision
    config (a vision tower's layers); other models stream their decoder alone.
    """
    home = _token_home(model)
    attached = merger_lists(model)    # Qwen3-VL's deepstack mergers run inside tower blocks
    lists = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2 or path in attached:
            continue
        if max(Counter(type(m) for m in module).values()) < 2:
            continue
        n = sum(p.numel() for m in module for p in m.parameters())
        lists.append(((home is None or path.startswith(home), n), path, module))
    if not lists:
        return None
    _, path, module = max(lists, key=lambda x: x[0])
    if home is None or getattr(getattr(model, "config", None), "vision_config", None) is None:
        return BlockStack(path, tuple(module))
    towers = [(p, m) for (beside, _), p, m in lists if not beside]
    towers = [(p, m) for p, m in towers if not any(p.startswith(q + ".") for q, _ in towers)]
    return BlockStack(path, tuple(b for _, m in towers for b in m) + tuple(module),
                      tuple(p for p, _ in towers), tuple(len(m) for _, m in towers))


def _token_home(model: nn.Module) -> str | None:
    """The path, with a trailing dot, of the module holding the token embedding (LLaVA's
    "model.language_model."); None where it is the model itself or there is none."""
    try:
        embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    except NotImplementedError:
        return None
    path = next((n for n, m in model.named_modules() if m is embed), "") if isinstance(embed, nn.Module) else ""
    return path.rsplit(".", 1)[0] + "." if "." in path else None


class TemplateGroups:
    """Which block calls share a template: those that compute the same thing, i.e. the same
    structure, the same non-tensor arguments, the same fingerprint (fingerprint.py) and the same
    inputs needing a gradient. One template is traced per group, from its first block."""

    def __init__(self, stack: BlockStack, calls: list[BlockCall]):
        self.stack, self.calls = stack, calls
        self.firsts: list[tuple[int, tuple[bool, ...], tuple]] = []
        self.why: dict[int, tuple[int, str]] = {}   # per later group of a list: the block its first one
        # was compared with, and how it differs

    def source(self, i: int, grads: tuple[bool, ...], handed: tuple = (), inputs: int | None = None) -> int:
        """The call whose template call `i` runs (`i` itself when it starts a group); `grads`:
        which of its tensor inputs need a gradient, known only once the earlier stages are traced,
        then which of its outputs are read (`inputs` of them are inputs; None: all);
        `handed`: which of its inputs are the model's parameters or buffers as they are, and which
        of the stage's tensors each is (segment.py)."""
        for j, g, h in self.firsts:
            if g == grads and h == handed and _difference(self.stack, self.calls[j], self.calls[i]) is None:
                return j
        mine = [(j, g, h) for j, g, h in self.firsts if self._list(j) == self._list(i)]
        if mine:     # the first block of a tower, or of the decoder, needs no note
            j, g, h = mine[0]
            self.why[i] = (self.calls[j].index, _difference(self.stack, self.calls[j], self.calls[i])
                           or ("which of its inputs are the model's own parameters or buffers, handed as they are"
                               if h != handed else _grad_difference(grads, g, len(grads) if inputs is None else inputs,
                                                                    self.stack.block_path(self.calls[j].index))))
        self.firsts.append((i, grads, handed))
        return i

    def _list(self, i: int) -> str:
        return self.stack.list_of(self.calls[i].index)


def _difference(stack: BlockStack, a: BlockCall, b: BlockCall) -> str | None:
    """None when the calls can share a template, else the first difference, in words."""
    ma, mb = stack.blocks[a.index], stack.blocks[b.index]
    sa, sb = _signature(ma), _signature(mb)
    if sa[0] is not sb[0] or sa[3] != sb[3]:
        return f"module classes ({_classes(sa, sb)})"
    if sa[1:3] != sb[1:3]:
        return "parameters or buffers (names, shapes, dtypes or requires_grad)"
    if not (a.in_spec == b.in_spec and a.tensor_positions == b.tensor_positions and a.out_spec == b.out_spec
            and same_constants(a.constants, b.constants) and a.side_keys == b.side_keys):
        return "non-tensor call arguments"
    if a.attached_key != b.attached_key:
        return f"the work folded into it ({b.attached_key or 'none'} where the other has {a.attached_key or 'none'})"
    if a.fingerprint != b.fingerprint:
        return f"what it computes ({_first_op_difference(a.fingerprint, b.fingerprint)})"
    return None


def _grad_difference(mine: tuple[bool, ...], other: tuple[bool, ...], inputs: int, other_path: str) -> str:
    """Which of a block's inputs need a gradient and which of its outputs are read, in words: a
    frozen embedding's output needs none, so the first decoder layer of a LoRA model differs from
    the second in its input 0."""
    said = []
    for k, (x, y) in enumerate(zip(mine, other)):
        if x != y and k < inputs:
            said.append(f"its input {k} needs a gradient and {other_path}'s does not" if x else
                        f"its input {k} needs no gradient and {other_path}'s does")
        elif x != y:
            said.append(f"its output {k - inputs} is read and {other_path}'s is not" if x else
                        f"its output {k - inputs} is not read and {other_path}'s is")
    return "which inputs need a gradient and which outputs are read (" + "; ".join(said) + ")"


def _classes(sa: tuple, sb: tuple) -> str:
    for x, y in zip(sa[3], sb[3]):
        if x != y:
            return f"{y} where the other has {x}"
    return f"{len(sb[3])} submodules where the other has {len(sa[3])}"


def _first_op_difference(fa: tuple, fb: tuple) -> str:
    ops_a, ops_b = fa[0], fb[0]
    for k, (x, y) in enumerate(zip(ops_a, ops_b)):
        if x != y:
            return f"op {k} is {_show(y)} where the other runs {_show(x)}"
    if len(ops_a) != len(ops_b):
        return f"{len(ops_b)} ops where the other runs {len(ops_a)}"
    return "its outputs or gradients come from other ops"


def _show(entry: tuple) -> str:
    func, args, kwargs = entry

    def show(x: Any) -> str:
        if isinstance(x, tuple) and len(x) == 3 and isinstance(x[2], torch.dtype):
            return f"tensor{list(x[1])}"
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "float":
            return str(float.fromhex(x[1])) if x[1].startswith(("0x", "-0x")) else x[1]
        if isinstance(x, tuple):
            return "[" + ", ".join(show(y) for y in x) + "]"
        return repr(x)
    text = ", ".join([show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs])
    return f"{func}({text})"


def same_constants(a: list, b: list) -> bool:
    """Whether two calls' non-tensor arguments are equal; arrays of numbers (Qwen2.5-VL's
    attention lengths) compare by value."""
    try:
        return len(a) == len(b) and all(x is y or _same_value(x, y) for x, y in zip(a, b))
    except Exception:  # noqa: BLE001 - uncomparable constants count as different
        return False


def _same_value(x: Any, y: Any) -> bool:
    if isinstance(x, numpy.ndarray) or isinstance(y, numpy.ndarray):
        return type(x) is type(y) and x.dtype == y.dtype and numpy.array_equal(x, y)
    return bool(x == y)
