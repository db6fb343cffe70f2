"""A stage graph (one block's forward or backward) ready to run op by op.

Each value is dropped right after its last use, in both the runtime interpreter and the memory
simulator, so the transient peak the plan predicts is the one the runtime produces.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from .ledger import StorageLedger
from .stage_codegen import generate
from .stage_ops import runnable


def tensors_of(value: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def fake_storage_key(t: torch.Tensor) -> Hashable:
    return StorageWeakRef(t.untyped_storage())


@dataclass(frozen=True)
class GraphStorage:
    """One storage an op of the graph makes, with the ops it lives over (simulate()'s rule)."""
    op: str              # the fx node that first holds it
    nbytes: int
    first: int           # index in `body` of that op
    last: int | None     # index of the op after which it is freed; None: alive when the graph ends
    group: int | None    # its output storage group (GraphMemory.output_groups) when an output holds it
    part: int = 0        # which of the storages its op makes, in the order of the op's result's tensors


@dataclass
class GraphMemory:
    transient_peak: int        # bytes above the inputs while the graph runs
    output_bytes: int          # bytes of storages the outputs newly hold when it ends
    output_groups: list[int]   # per output: a storage group id (outputs sharing storage share it)
    output_alias: list[int | None]  # per output: index of the input whose storage it shares
    group_bytes: list[int]     # per storage group: bytes it holds (0 when it is an input's)


class StageProgram:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        nodes = list(gm.graph.nodes)
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.output_node = next(n for n in nodes if n.op == "output")
        self.body = [n for n in nodes if n.op in ("call_function", "get_attr")]
        outputs = set(self.output_node.all_input_nodes)
        last_use: dict[fx.Node, fx.Node] = {}
        for n in self.body:
            for a in n.all_input_nodes:
                last_use[a] = n
        # free_after[i]: values whose last reader is body[i] (never graph inputs or outputs)
        self.free_after: list[list[fx.Node]] = [[] for _ in self.body]
        index = {n: i for i, n in enumerate(self.body)}
        for value, reader in last_use.items():
            if value.op != "placeholder" and value not in outputs:
                self.free_after[index[reader]].append(value)
        # Values nothing reads (e.g. a discarded getitem) are freed where they are made.
        for i, n in enumerate(self.body):
            if not n.users and n not in outputs:
                self.free_after[i].append(n)
        self.random = any(isinstance(n.target, torch._ops.OpOverload)
                          and torch.Tag.nondeterministic_seeded in n.target.tags for n in self.body)
        self._generated: Callable | None | bool = False     # False: not generated yet
        self._generated_placed: Callable | None | bool = False
        self._input_keys: set | None = None

    # -- running -------------------------------------------------------------------------
    def run(self, inputs: list[Any], on_alloc: Callable[[fx.Node, Any], None],
            on_free: Callable[[fx.Node, Any], None], places: list[Callable | None] | None = None) -> list[Any]:
        """The graph on `inputs`; on_alloc(node, value) after each op, on_free(node, value) after
        a value's last reader. `places`, one per op of `body`: where not None, what runs in the op's
        stead (runtime/placement.py: the op writing into its arena tensors). Runs the generated
        straight-line code (stage_codegen.py), made at the first run, or the interpreter where none
        could be made."""
        if places is None:
            if self._generated is False:
                self._generated = generate(self)
            if self._generated is None:
                return self.interpret(inputs, on_alloc, on_free)
            return self._generated(inputs, on_alloc, on_free)
        if self._generated_placed is False:
            self._generated_placed = generate(self, placed=True)
        if self._generated_placed is None:
            return self.interpret(inputs, on_alloc, on_free, places)
        return self._generated_placed(inputs, on_alloc, on_free, places)

    def interpret(self, inputs: list[Any], on_alloc: Callable[[fx.Node, Any], None],
                  on_free: Callable[[fx.Node, Any], None], places: list[Callable | None] | None = None) -> list[Any]:
        env: dict[fx.Node, Any] = dict(zip(self.placeholders, inputs))
        load = env.__getitem__
        for k, (node, frees) in enumerate(zip(self.body, self.free_after)):
            if node.op == "get_attr":
                value = getattr(self.gm, node.target)
            else:
                args = fx.node.map_arg(node.args, load)
                kwargs = fx.node.map_arg(node.kwargs, load)
                value = ((places[k] if places is not None else None) or runnable(node.target))(*args, **kwargs)
            env[node] = value
            on_alloc(node, value)
            for dead in frees:
                on_free(dead, env.pop(dead))
        return list(fx.node.map_arg(self.output_node.args[0], load))

    # -- simulating ----------------------------------------------------------------------
    def simulate(self) -> GraphMemory:
        """Run the liveness rule over the traced fake values (node.meta['val'])."""
        ledger = StorageLedger()
        input_keys = []
        for p in self.placeholders:
            keys = [fake_storage_key(t) for t in tensors_of(p.meta.get("val"))]
            input_keys.append(keys)
            for k in keys:
                ledger.hold(p, k, 0)   # inputs are already counted by whoever owns them

        def alloc(node, _):
            for t in tensors_of(node.meta.get("val")):
                ledger.hold(node, fake_storage_key(t), t.untyped_storage().nbytes())

        def free(node, _):
            for t in tensors_of(node.meta.get("val")):
                ledger.drop(node, fake_storage_key(t))

        for node, frees in zip(self.body, self.free_after):
            alloc(node, None)
            for dead in frees:
                free(dead, None)
        outputs = list(self.output_node.args[0])
        groups: dict[Hashable, int] = {}
        output_groups, output_alias, group_bytes = [], [], []
        for o in outputs:
            ts = tensors_of(o.meta.get("val")) if isinstance(o, fx.Node) else []
            key = fake_storage_key(ts[0]) if ts else object()
            alias = next((i for i, keys in enumerate(input_keys) if key in keys), None)
            if key not in groups:
                groups[key] = len(groups)
                group_bytes.append(0 if alias is not None or not ts else ts[0].untyped_storage().nbytes())
            output_groups.append(groups[key])
            output_alias.append(alias)
        return GraphMemory(ledger.peak_bytes, ledger.live_bytes, output_groups, output_alias, group_bytes)

    def input_storage_keys(self) -> set:
        """The storages of the graph's inputs (fake): a result on one of them is a view, not made here."""
        if self._input_keys is None:
            self._input_keys = {fake_storage_key(t) for p in self.placeholders for t in tensors_of(p.meta.get("val"))}
        return self._input_keys

    def storages(self) -> list[GraphStorage]:
        """The storages the graph's ops make, in the order they are made, each with its first and
        last op: simulate()'s holds and drops, one storage per key (a view of it adds a holder,
        not bytes). Inputs' storages are not among them: their owners count them."""
        inputs = self.input_storage_keys()
        made: dict[Hashable, list] = {}          # key -> [op, bytes, first, last, holders]
        order: list[Hashable] = []
        for k, (node, frees) in enumerate(zip(self.body, self.free_after)):
            parts = 0
            for t in tensors_of(node.meta.get("val")):
                key = fake_storage_key(t)
                if key in inputs:
                    continue
                if key not in made:
                    made[key] = [node.name, t.untyped_storage().nbytes(), k, None, set(), parts]
                    order.append(key)
                    parts += 1
                made[key][4].add(node)
            for dead in frees:
                for t in tensors_of(dead.meta.get("val")):
                    entry = made.get(fake_storage_key(t))
                    if entry is not None and dead in entry[4]:
                        entry[4].discard(dead)
                        if not entry[4]:
                            entry[3] = k
        groups: dict[Hashable, int] = {}
        for o in self.output_node.args[0]:
            ts = tensors_of(o.meta.get("val")) if isinstance(o, fx.Node) else []
            key = fake_storage_key(ts[0]) if ts else object()
            groups.setdefault(key, len(groups))
        return [GraphStorage(made[key][0], made[key][1], made[key][2], made[key][3],
                             groups.get(key) if made[key][3] is None else None, made[key][5]) for key in order]
