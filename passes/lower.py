"""Lower a captured model to the plainest schedule: every stage forward, then every backward.

No transfers, no frees yet: later passes add them. Each compute node reads its inputs in the
order its graph takes them, so the runtime can run it without looking anywhere else.
"""
from __future__ import annotations

from megacompile.capture import CapturedModel, Port, StageInstance
from megacompile.errors import CaptureError
from megacompile.ir.program import (SEED, Node, Op, Program, Value, act, act_grad, grads, model_input,
                                    restored, saved, weights)
from megacompile.ir.stage_program import GraphMemory


def _output_parts(s: int, stage: StageInstance, mem: GraphMemory, values: dict[str, Value],
                  input_names: list[str], prefix: str) -> list[tuple[tuple[str, int], ...]]:
    """Storage parts of each graph output: its own new storage, or the input it aliases."""
    n_params = len(stage.template.params)
    parts = []
    for group, alias in zip(mem.output_groups, mem.output_alias):
        if alias is None:
            parts.append(((f"{prefix}{s}.{group}", mem.group_bytes[group]),))
        elif alias < n_params:
            parts.append(values[weights(s)].parts)
        else:
            parts.append(values[input_names[alias - n_params]].parts)
    return parts


def _port_value(port: Port) -> str:
    return model_input(port.index) if port.stage < 0 else act(port.stage, port.index)


def lower(captured: CapturedModel) -> Program:
    stages = captured.stages
    values: dict[str, Value] = {}
    for k, meta in enumerate(captured.inputs):
        values[model_input(k)] = Value(model_input(k), ((model_input(k), meta.nbytes),), "input")
    for s, stage in enumerate(stages):
        values[weights(s)] = Value(weights(s), ((weights(s), stage.template.weight_bytes),), "weights")
    nodes = [Node(Op.INPUT, writes=tuple(model_input(k) for k in range(len(captured.inputs))),
                  origin="model inputs")]
    if captured.train:
        values[SEED] = Value(SEED, ((SEED, captured.stages[captured.outputs[0].stage].template.outputs[0].nbytes),), "input")
        nodes[0] = Node(Op.INPUT, writes=nodes[0].writes + (SEED,), origin="model inputs, loss seed")

    for s, stage in enumerate(stages):
        t = stage.template
        inputs = [_port_value(p) for p in stage.inputs]
        mem = t.fwd_memory if captured.train else t.inf_memory
        parts = _output_parts(s, stage, mem, values, inputs, "f")
        outs = [act(s, k) for k in range(len(t.outputs))]
        for k, name in enumerate(outs):
            values[name] = Value(name, parts[k], "activation")
        writes = tuple(outs)
        if captured.train:
            saved_parts = tuple(dict.fromkeys(p for ps in parts[len(outs):] for p in ps))
            values[saved(s)] = Value(saved(s), saved_parts, "saved")
            # Offloaded saved values come back storage by storage (offload pass, runtime/stash.py):
            # the same bytes as the storages they left, now their own.
            values[restored(s)] = Value(restored(s), tuple((f"h{key}", nbytes) for key, nbytes in saved_parts),
                                        "saved")
            writes += (saved(s),)
        op = Op.FORWARD if captured.train else Op.INFER
        nodes.append(Node(op, s, (weights(s), *inputs), writes, origin=stage.origin,
                          note=f"{t.kind}", transient=mem.transient_peak))
    nodes.append(Node(Op.OUTPUT, reads=tuple(_port_value(p) for p in captured.outputs),
                      origin="loss" if captured.train else "outputs"))
    if not captured.train:
        return Program(nodes, values, [s.name for s in stages], ["lower"])

    tangent_of = _tangent_sources(captured)
    for s in reversed(range(len(stages))):
        stage, t = stages[s], stages[s].template
        if not t.grad_params and not t.grad_acts:
            continue   # frozen, and nothing before it trains: no backward to run
        inputs = [_port_value(p) for p in stage.inputs]
        reads = [weights(s)] + [inputs[i] for i in t.bwd_acts] + [saved(s)]
        reads += [tangent_of[(s, k)] for k in t.tangent_outputs]
        parts = _output_parts(s, stage, t.bwd_memory, values, [], "b")
        writes = []
        n_pg = len(t.grad_params)
        if n_pg:
            values[grads(s)] = Value(grads(s), tuple(dict.fromkeys(p for ps in parts[:n_pg] for p in ps)), "grads")
            writes.append(grads(s))
        for j, k in enumerate(t.grad_acts):
            values[act_grad(s, k)] = Value(act_grad(s, k), parts[n_pg + j], "activation")
            writes.append(act_grad(s, k))
        nodes.append(Node(Op.BACKWARD, s, tuple(reads), tuple(writes), origin=stage.origin,
                          note=t.kind, transient=t.bwd_memory.transient_peak))
    return Program(nodes, values, [s.name for s in stages], ["lower"])


def _tangent_sources(captured: CapturedModel) -> dict[tuple[int, int], str]:
    """For each differentiable stage output, the value holding its gradient."""
    sources: dict[tuple[int, int], str] = {}
    loss = captured.outputs[0]
    sources[(loss.stage, loss.index)] = SEED
    for c, stage in enumerate(captured.stages):
        for j, port in enumerate(stage.inputs):
            if port.stage >= 0 and stage.template.acts[j].requires_grad:
                key = (port.stage, port.index)
                if key in sources:
                    raise CaptureError(f"output {port.index} of {captured.stages[port.stage].name} feeds "
                                       "more than one differentiable consumer; megacompile streams a chain")
                sources[key] = act_grad(c, j)
    for s, stage in enumerate(captured.stages):
        for k in stage.template.tangent_outputs:
            if (s, k) not in sources:
                raise CaptureError(f"output {k} of {stage.name} needs a gradient that no later stage computes")
    return sources
