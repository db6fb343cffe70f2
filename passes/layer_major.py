"""Layer-major accumulation: k micro-batches through each block while its weights are on the device.

Micro-batch-major accumulation runs the whole one-micro-batch schedule k times per optimizer
step: every stage's weights cross the link twice per micro-batch (2k per step) and each
micro-batch's gradients go to the host, where an fp32 sum collects them. Layer-major runs the
one-micro-batch schedule's units k times in place instead: a unit is a run of back-to-back
compute nodes of one stage (a forward; a recompute and its backward; the epilogue's forward and
backward) with the transfers and frees placed around it, copied once per micro-batch, its values
renamed `<name>@m`. The transfers pass, which runs after this one, sees k back-to-back uses of a
stage and fetches its weights once per direction per optimizer step.

Gradients add up on the device: the backward of micro-batch m > 0 reads the running sum and adds
its own gradients into it, in place; the sum of the
last micro-batch is `g<s>`, the one value the transfers pass offloads. The host receives one
gradient per step, as with grad_accum=1. Micro-batch boundaries (a block's output for each
micro-batch) wait on the device, or in host memory where the boundary pass sent them.

Random ops draw in another order than eager accumulation (layer by layer, not micro-batch by
micro-batch), so the planner offers this schedule only for stages without random ops.
"""
from __future__ import annotations

from megacompile.ir.program import COMPUTE_OPS, Node, Op, Program, Value, grads, of_micro

SHARED = ("weights", "host")     # one copy for every micro-batch


def _units(nodes: list[Node]) -> tuple[list[Node], list[list[Node]]]:
    """The nodes before the first compute node, and the units: each a run of back-to-back compute
    nodes of one stage with the nodes placed for it. A PREFETCH, or a WAIT the next compute node
    reads, was placed before that node; every other node was placed after the one before it."""
    compute = [i for i, n in enumerate(nodes) if n.op in COMPUTE_OPS]
    if not compute:
        return list(nodes), []
    head = list(nodes[:compute[0]])
    units: list[list[Node]] = []
    pending: list[Node] = []          # placed before the next compute node
    next_compute = {}
    for rank, i in enumerate(compute):
        for j in range(compute[rank - 1] + 1 if rank else 0, i + 1):
            next_compute[j] = nodes[i]
    for i, n in enumerate(nodes[compute[0]:], start=compute[0]):
        if n.op in COMPUTE_OPS:
            if not units or not _ends_in_run(units[-1], n.stage):
                units.append([])
            units[-1].extend(pending)
            units[-1].append(n)
            pending = []
            continue
        nxt = next_compute.get(i)
        if nxt is not None and (n.op is Op.PREFETCH or (n.op is Op.WAIT and n.reads[0] in nxt.reads)):
            pending.append(n)
        else:
            units[-1].append(n)
    units[-1].extend(pending)
    return head, units


def _ends_in_run(unit: list[Node], stage: int) -> bool:
    last = next(n for n in reversed(unit) if n.op in COMPUTE_OPS)
    return last.stage == stage


def layer_major(program: Program, k: int) -> Program:
    if k <= 1:
        return program
    values = program.values
    shared_keys = {key for v in values.values() if v.kind in SHARED for key, _ in v.parts}
    grad_keys = {key for v in values.values() if v.kind == "grads" for key, _ in v.parts}
    stage_of_grads = {grads(n.stage): n.stage for n in program.nodes if n.op is Op.BACKWARD and grads(n.stage) in n.writes}

    def sum_name(s: int, m: int) -> str:
        """The running gradient sum of stage s after micro-batch m; the last is the one offloaded."""
        return grads(s) if m == k - 1 else of_micro(grads(s), m)

    # The solver lays out thousands of candidate schedules this way, so the renaming is written
    # out: `v + at[m]` is of_micro(v, m).
    at = [of_micro("", m) for m in range(k)]
    names: list[dict[str, str]] = [{} for _ in range(k)]
    new_values: dict[str, Value] = {}
    for v, val in values.items():
        if val.kind in SHARED:
            renamed = [v] * k
        elif v in stage_of_grads:
            renamed = [sum_name(stage_of_grads[v], m) for m in range(k)]
        else:
            renamed = [v + a for a in at]
        own = [key not in shared_keys and key not in grad_keys for key, _ in val.parts]
        for m, name in enumerate(renamed):
            names[m][v] = name
            parts = (tuple((key + at[m] if o else key, b) for (key, b), o in zip(val.parts, own))
                     if any(own) else val.parts)
            new_values[name] = Value(name, parts, val.kind)

    def copy(n: Node, m: int) -> Node:
        name = names[m].__getitem__
        reads = tuple(map(name, n.reads))
        if n.op is Op.BACKWARD and m > 0 and grads(n.stage) in n.writes:
            # Adds into the running sum, read last. Its own fresh gradients are graph outputs, which
            # its transient already counts beside everything live (the sum included).
            reads += (sum_name(n.stage, m - 1),)
        return Node(n.op, n.stage, reads, tuple(map(name, n.writes)), tuple(map(name, n.frees)),
                    n.origin, f"{n.note} (micro-batch {m})".strip(), n.transient, m)

    head, units = _units(program.nodes)
    out = [copy(n, m) for m in range(k) for n in head]
    for unit in units:
        out.extend(copy(n, m) for m in range(k) for n in unit)
    result = program.copy(out, micro_batches=k)
    result.values = new_values
    return result

