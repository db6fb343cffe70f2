"""Lay out the step's device memory: every device tensor at an offset in one arena.

The tensors are the storages the memory simulator counts (ir/simulate.py), on a timeline of
steps: one step per schedule node, and one per op for a compute node, whose graph's ops make
their outputs one after the other (ir/stage_program.py's `storages`, the rule of its `simulate`):
  - a schedule value's storage (streamed weights, model inputs, the loss seed, restored saved
    values, gradient sums) lives from the node that writes it, or from the op of the graph that
    makes it, to the FREE of its last holder (the ledger's rule: a storage shared by several values
    lives until the last one lets go; weights fetched twice are two tensors);
  - an op's output that no value keeps lives from its op to its last reader in the graph, or to
    the graph's end when it is an output nothing after the node holds (a recompute's block output,
    a layer-major backward's fresh gradients before they join the running sum).
The bytes live at each step are then the simulator's curve, op by op: at its busiest step the
arena must hold the predicted peak, and the solver's packing adds only its own holes
(ir/arena.py: greedy by size over these lifetimes).

A compute node's value storage is matched to the graph output that makes it by the key `lower`
gave it (`f<stage>.<group>`, `b<stage>.<group>`, `r`/`x` for a recompute's, `@m` per
micro-batch). A key that names no output of the graph is taken as live from the node's first op,
never later than the runtime would make it.
"""
from __future__ import annotations

from megacompile.capture import CapturedModel
from megacompile.ir.arena import lay_out
from megacompile.ir.program import COMPUTE_OPS, Node, Op, Program
from megacompile.ir.simulate import simulate
from megacompile.ir.stage_program import GraphStorage, StageProgram


def place_in_arena(program: Program, captured: CapturedModel | None) -> Program:
    """`program` with `facts["arena"]`, its DeviceArena. Without `captured` (a hand-built schedule),
    a compute node's working set is one tensor of its `transient` bytes."""
    names: list[tuple[str, int, str, int]] = []
    sizes: list[int] = []
    firsts: list[int] = []
    lasts: list[int] = []

    def add(name: str, node: int, op: str, nbytes: int, first: int, last: int, part: int = 0) -> None:
        if nbytes:
            names.append((name, node, op, part))
            sizes.append(nbytes)
            firsts.append(first)
            lasts.append(last)

    # storage key -> [node that made it, the graph op that made it or "", bytes, first step, holders,
    #                 which of the op's storages it is]
    live: dict[str, list] = {}
    storages: dict[int, list[GraphStorage]] = {}     # per graph, read once however many stages run it
    node_steps: list[int] = []
    step = 0
    for i, n in enumerate(program.nodes):
        node_steps.append(step)
        if n.op is Op.FREE:
            for v in n.frees:
                for key, _ in program.values[v].parts:
                    entry = live.get(key)
                    if entry is not None and v in entry[4]:
                        entry[4].discard(v)
                        if not entry[4]:
                            del live[key]
                            add(key, *entry[:4], step - 1, entry[5])    # not live at the FREE
            step += 1
            continue
        written = {key: nbytes for v in n.writes for key, nbytes in program.values[v].parts}
        new = [(key, nbytes) for key, nbytes in written.items() if key not in live]
        graph = graph_of(captured, n) if n.op in COMPUTE_OPS else None
        made_by: dict[str, GraphStorage] = {}        # new value storages an op of the graph makes
        if graph is None:
            width = 1
            if n.op in COMPUTE_OPS:   # the working set beside what the node writes, as simulate() counts it
                add(f"{program.stage_names[n.stage] if n.stage is not None else i}.working", i, "",
                    max(0, n.transient - sum(b for _, b in new)), step, step)
        else:
            if id(graph) not in storages:
                storages[id(graph)] = graph.storages()
            made = storages[id(graph)]
            width = max(1, len(graph.body))
            outputs = {s.group: s for s in made if s.last is None and s.group is not None}
            for key, nbytes in new:
                s = outputs.get(_group(key))
                if s is not None and s.nbytes == nbytes and s not in made_by.values():
                    made_by[key] = s
            claimed = set(made_by.values())
            for s in made:
                if s.last is not None:
                    add(s.op, i, s.op, s.nbytes, step + s.first, step + s.last, s.part)
                elif s not in claimed:
                    add(s.op, i, s.op, s.nbytes, step + s.first, step + width - 1, s.part)
        for v in n.writes:
            for key, nbytes in program.values[v].parts:
                if key in live:
                    live[key][4].add(v)
                else:
                    s = made_by.get(key)
                    live[key] = [i, s.op if s else "", nbytes, step + s.first if s else step, {v}, s.part if s else 0]
        step += width
    for key, entry in live.items():
        add(key, *entry[:4], step - 1, entry[5])
    return program.copy(arena=lay_out(names, sizes, firsts, lasts, simulate(program).peak, node_steps, step))


def graph_of(captured: CapturedModel | None, n: Node) -> StageProgram | None:
    """The stage graph a compute node runs (the runtime places its ops by the same answer)."""
    if captured is None or n.stage is None:
        return None
    t = captured.stages[n.stage].template
    return {Op.FORWARD: t.forward, Op.RECOMPUTE: t.forward, Op.BACKWARD: t.backward, Op.INFER: t.inference}[n.op]


def _group(key: str) -> int | None:
    """The output storage group a compute node's storage key names (`f3.12@1` -> 12), or None."""
    group = key.split("@", 1)[0].rpartition(".")[2]
    return int(group) if group.isdigit() else None
