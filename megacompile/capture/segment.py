"""Cut the top-level graph into stages: prologue, the block templates, epilogue.

The prologue holds what runs before the first block (embeddings, rotary tables, masks), the
epilogue what runs after the last (final norm, lm head, loss). Values the prologue makes for
every block (rotary cos/sin, the causal mask) are "side inputs": they stay on the device
for the whole step. Block templates are traced from the block modules themselves: one per group
of blocks that compute the same thing (blocks.py), from the group's first block.
"""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.func import functional_call
from torch.utils import _pytree as pytree

from ..errors import CaptureError
from .blocks import BlockStack, TemplateGroups
from .checkpointing import without_gradient_checkpointing
from .chunk import active_chunks, chunk_block
from .leaf import BlockCall
from .loss import require_gradient
from .model_graph import Port, StageInstance
from .side_outputs import recording
from .stage import ParamSlot, StageTemplate, TensorMeta, trace_stage
from .top import TopGraph
from .untouched import as_it_was

BLOCK_CALL = torch.ops.megacompile.block_call.default
HANDED = "handed"     # the prefix of a model tensor handed to a block, by its place among them, in the block's stage


class _Segment:
    """A run of top-level nodes turned into its own GraphModule (params first, then acts)."""

    def __init__(self, top: fx.GraphModule, members: list[fx.Node], outputs: list[fx.Node],
                 state_ph: dict[fx.Node, str]):
        member_set = set(members)
        externals: list[fx.Node] = []
        for n in members:
            for a in n.all_input_nodes:
                if a not in member_set and a.op != "get_attr" and a not in externals:
                    externals.append(a)
        for o in outputs:
            if o not in member_set and o not in externals:
                externals.append(o)
        self.param_inputs = [a for a in externals if a in state_ph]
        self.act_inputs = [a for a in externals if a not in state_ph]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in self.param_inputs + self.act_inputs:
            env[a] = graph.placeholder(a.name)
            env[a].meta = dict(a.meta)

        def load(a: fx.Node) -> fx.Node:
            if a not in env and a.op == "get_attr":   # constants are copied into every user
                env[a] = graph.node_copy(a)
            return env[a]
        for n in members:
            env[n] = graph.node_copy(n, load)
        graph.output([env[o] for o in outputs])
        self.gm = fx.GraphModule(top, graph)
        self.outputs = outputs
        # In-place writes into views of its own values (Qwen3-VL's rotary tables) read nowhere
        # else: traced through functionalization, they become the values their readers take, and
        # its views copies the plan places. A segment that hands a value out (a .detach():
        # LossAndOutputs' handed-out values, beside Mixtral's `loss += aux_loss`) keeps its views as
        # views: removed, the detach would become detach_copy, which has no derivative.
        self.writes = any(_writers(n) for n in members)
        self.removed = "mutations" if any(n.target is torch.ops.aten.detach.default for n in members) \
            else "mutations_and_views"

    def __call__(self, params: list[torch.Tensor], acts: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.writes:
            return list(torch.func.functionalize(self.gm, remove=self.removed)(*params, *acts))
        return list(self.gm(*params, *acts))


def build_stages(top: TopGraph, model: torch.nn.Module, stack: BlockStack | None,
                 fakes: dict[str, torch.Tensor], trainable: dict[str, bool], input_fakes: list[torch.Tensor],
                 train: bool) -> tuple[list[StageInstance], list[Port], dict[str, str]]:
    """The stages in order, the ports of the graph's outputs, and for each block stage that starts
    a template of its own, why it could not share the first block's. The model comes out as it
    went in (untouched.py), and its layers are traced without Hugging Face's gradient checkpointing
    (checkpointing.py)."""
    with as_it_was(model), without_gradient_checkpointing(model):
        return _build_stages(top, model, stack, fakes, trainable, input_fakes, train)


def _build_stages(top: TopGraph, model: torch.nn.Module, stack: BlockStack | None,
                  fakes: dict[str, torch.Tensor], trainable: dict[str, bool], input_fakes: list[torch.Tensor],
                  train: bool) -> tuple[list[StageInstance], list[Port], dict[str, str]]:
    gm = top.gm
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    state_ph = dict(zip(placeholders[:len(top.state_names)], top.state_names))
    input_ph = {n: i for i, n in enumerate(placeholders[len(top.state_names):])}
    out_node = next(n for n in nodes if n.op == "output")
    graph_outputs = list(pytree.tree_leaves(out_node.args[0]))

    calls = [n for n in nodes if n.target is BLOCK_CALL]
    produced_by: set[fx.Node] = {u for c in calls for u in c.users if u.target is operator.getitem}
    runs = _runs(calls, stack)
    computed = [n for n in nodes if n.op == "call_function" and n.target is not BLOCK_CALL and n not in produced_by]
    before = _segments(computed, runs)
    epilogue = [n for n in computed if n not in before]

    stages: list[StageInstance] = []
    notes: dict[str, str] = {}
    where: dict[fx.Node, Port] = {n: Port(-1, i) for n, i in input_ph.items()}
    metas: dict[fx.Node, TensorMeta] = {}

    def fake_act(n: fx.Node) -> torch.Tensor:
        if n in input_ph:
            return input_fakes[input_ph[n]]
        if n not in metas:
            raise CaptureError(
                f"'{n.name}' is computed between two blocks of one stack (by a forward hook on a block, or "
                "code run between the layers), which megacompile does not train yet: it streams each stack's "
                "blocks as a chain with nothing run between them. Move that computation into a block's forward")
        meta = metas[n]
        return torch.empty(meta.shape, dtype=meta.dtype, device=input_fakes[0].device).requires_grad_(meta.requires_grad)

    def add_segment(name: str, members: list[fx.Node], outputs: list[fx.Node], origin: str) -> None:
        kind = name.split(".")[0]
        seg = _Segment(gm, members, outputs, state_ph)
        for a in seg.act_inputs:
            if a in state_ph or (a not in where):
                raise CaptureError(f"the {kind} reads '{a.name}', which no earlier stage produces")
        names = [state_ph[p] for p in seg.param_inputs]
        slots = [ParamSlot(n, TensorMeta.of(fakes[n], False), trainable[n]) for n in names]
        template = trace_stage(kind, seg, slots, [fakes[n] for n in names],
                               [fake_act(a) for a in seg.act_inputs], train, origin)
        index = len(stages)
        stages.append(StageInstance(name, template, names, [where[a] for a in seg.act_inputs], origin))
        for k, o in enumerate(outputs):
            where[o] = Port(index, k)
            metas[o] = template.outputs[k]

    groups, templates = (TemplateGroups(stack, top.calls), {}) if calls else (None, None)
    # Each tensor by the model's own (deduplicated) name: a block's parameter tied to another
    # block's (or the same module twice in the list) is one tensor of the host state.
    model_names = {id(t): n for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    boundary = set(a for c in calls for a in c.args[0]) | set(graph_outputs)
    for r, run in enumerate(runs):
        members = [n for n in computed if before.get(n) == r]
        if members:
            inside = set(members)
            out = [n for n in members if any(u not in inside for u in n.users) or n in boundary]
            name = "prologue" if r == 0 else "bridge" if len(runs) == 2 else f"bridge.{r}"
            add_segment(name, members, out, type(model).__name__)
        notes.update(_add_blocks(stages, run, calls.index(run[0]), groups, templates, top, stack, fakes,
                                 trainable, where, metas, train, fake_act, state_ph, model_names))
    e_out = list(graph_outputs)
    if epilogue or not calls:
        add_segment("epilogue" if calls else "whole", epilogue, e_out, type(model).__name__)
    if train:
        side = {Port(s, k) for s, st in enumerate(stages) if st.name.startswith("block.")
                for k in range(_returned(top.calls[int(st.name.split(".")[1])]), len(st.template.outputs))}
        for stage in stages:
            b = int(stage.name.split(".")[1]) if stage.name.startswith("block.") else None
            own = (len(stage.inputs) if b is None
                   else len(top.calls[b].tensor_positions) - len(_handed(calls[b], top.calls[b], state_ph)))
            _check_no_grad_bypass(stage, stages, side, own)
        loss = where[e_out[0]]
        require_gradient(loss.stage >= 0 and stages[loss.stage].template.outputs[loss.index].requires_grad)
        _refuse_cut_gradients(stages)
    return stages, [where[o] for o in e_out], notes


def _add_blocks(stages, calls, first: int, groups: TemplateGroups, templates: dict[int, StageTemplate],
                top: TopGraph, stack: BlockStack, fakes, trainable, where, metas, train, fake_act,
                state_ph: dict[fx.Node, str], model_names: dict[int, str]) -> dict[str, str]:
    """One stage per block call; one template per group of calls that compute the same thing and
    pass the same gradients, traced from the group's first block. Returns, for each block that
    starts a new template, how it differs from the first block.

    Which parameters train is part of a block's structure (blocks.py); which inputs carry a
    gradient and which outputs a later stage differentiates is known only here. A frozen block
    still passes the gradient of its output back to its input when an earlier stage trains; a
    block output nothing reads (GPT-J's attention weights) gets no gradient.

    A parameter or buffer of the model handed to the block as it is (a causal mask kept as a
    buffer, a bias shared by every layer) is one of the block stage's own tensors, read from the
    host state as its weights are; a trainable one gets the gradients of every block that reads
    it summed on the host, as a tied weight does."""
    notes: dict[str, str] = {}
    for b, (node, call) in enumerate(zip(calls, top.calls[first:]), start=first):
        block, path = stack.blocks[call.index], stack.block_path(call.index)
        own = list(block.named_parameters()) + list(block.named_buffers())
        local = [n for n, _ in own]
        full = [model_names[id(t)] for _, t in own]
        if call.attached is not None:
            local += [n for n, _ in call.attached.param_names()]
            full += [f for _, f in call.attached.param_names()]
        handed = _handed(node, call, state_ph)
        shared = list(dict.fromkeys(handed.values()))
        slots = tuple(len(local) + shared.index(handed[k]) if k in handed else None for k in range(len(node.args[0])))
        local += [f"{HANDED}.{k}" for k in range(len(shared))]
        full += shared
        acts = [fake_act(a) for k, a in enumerate(node.args[0]) if k not in handed]
        read = _outputs_read(node, _returned(call) + len(call.side_keys) + len(call.attached_meta))
        grads = tuple(bool(train and a.requires_grad) for a in acts) + read
        source = groups.source(b, grads, slots, inputs=len(acts))
        if source == b:
            templates[b] = _trace_block(block, path, call, local, full, len(own), slots, acts, fakes, trainable,
                                        train, read, chunk=call.index in stack.decoder)
            if b in groups.why:
                other, why = groups.why[b]
                notes[f"block.{b}"] = f"{path} has its own template: it differs from {stack.block_path(other)} in {why}"
        template = templates[source]
        ports = []
        for k, a in enumerate(node.args[0]):
            if k in handed:
                continue
            if a not in where:
                raise CaptureError(f"input {k} of block {path} ('{a.name}') is not made "
                                   "by the prologue or the previous block")
            port = where[a]
            attached_input = k >= len(call.tensor_positions)    # deepstack features, from the bridge
            if train and template.acts[len(ports)].requires_grad and b > 0 and port.stage != len(stages) - 1 \
                    and not attached_input:
                raise CaptureError(
                    f"input {k} of block {path} needs a gradient but does not come from the "
                    "previous block; megacompile streams blocks as a chain (block i feeds block i+1)"
                    + _made_from_parameters_hint(a, state_ph))
            ports.append(port)
        stages.append(StageInstance(f"block.{b}", template, full, ports, path))
        for u in node.users:
            if u.target is operator.getitem:
                where[u] = Port(len(stages) - 1, u.args[1])
                metas[u] = template.outputs[u.args[1]]
    return notes


def _made_from_parameters_hint(value: fx.Node, state_ph: dict[fx.Node, str]) -> str:
    """Where a value computed outside the blocks is made from the model's parameters alone (a shared
    scale reshaped or cast before the layers), how to pass it so that it trains; else nothing."""
    names, seen, frontier = [], set(), [value]
    while frontier:
        n = frontier.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in state_ph:
            names.append(state_ph[n])
        elif n.op == "placeholder":
            return ""           # made from the model's inputs too: an activation
        frontier.extend(n.all_input_nodes)
    if not names:
        return ""
    return (f": it is computed from the model's {', '.join(sorted(names))} outside the blocks. Hand each block the "
            "parameter itself (each block then reads it as one of its own weights, and its gradients from every "
            "block are summed, as eagerly), and compute with it inside the block's forward")


def _handed(node: fx.Node, call: BlockCall, state_ph: dict[fx.Node, str]) -> dict[int, str]:
    """The block call's inputs that are the model's parameters or buffers as they are: position ->
    the model's name."""
    return {k: state_ph[a] for k, a in enumerate(node.args[0][:len(call.tensor_positions)]) if a in state_ph}


def _trace_block(block: torch.nn.Module, path: str, call: BlockCall, local: list[str], full: list[str], n_own: int,
                 slots: tuple[int | None, ...], fake_acts: list[torch.Tensor], fakes, trainable, train: bool,
                 read: tuple[bool, ...], chunk: bool) -> StageTemplate:
    """The template of one block, traced from its own module and the way the model called it, with
    the work folded into it (deepstack.py): `local` names its tensors inside the stage, `full` in
    the model; the first `n_own` are the block module's own, then the folded work's, then the
    model's tensors handed to it (`slots`: for each input of the call, the stage tensor it is, or
    None for an activation). `chunk`: the decoder's blocks may run over sequence chunks (chunk.py);
    a tower's sequence is its images' patches, fixed by the images, and stays whole."""
    params = [ParamSlot(n, TensorMeta.of(fakes[f], False), trainable[f]) for n, f in zip(local, full)]
    n_args = len(call.tensor_positions)
    n_attached = len(call.attached.param_names()) if call.attached else 0

    def source(params, acts):
        it = iter(acts)
        inputs = [next(it) if s is None else params[s] for s in slots]
        args, kwargs = call.rebuild_args(inputs[:n_args])
        with recording(call.collect_keys) as side, _own_hooks_off(block):
            out = functional_call(block, dict(zip(local[:n_own], params[:n_own])), args, kwargs, strict=False)
        added = []
        if call.attached is not None:
            out, added = call.attached.apply(out, params[n_own:n_own + n_attached], inputs[n_args:])
        return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor)] + side.tensors + added
    fake_params = [fakes[f] for f in full]
    with (chunk_block(block, local[:n_own], fake_params[:n_own], lambda: source(fake_params, fake_acts)) if chunk
          else contextlib.nullcontext(())) as chunked:
        template = trace_stage("block", source, params, fake_params, fake_acts, train, path,
                               differentiable=list(read))
    if chunked:
        template.chunks, template.chunked = active_chunks(), tuple(chunked)
        if template.selective is not None:
            template.selective.chunks, template.selective.chunked = template.chunks, template.chunked
    return template


@contextlib.contextmanager
def _own_hooks_off(block: torch.nn.Module):
    """The block's own forward hooks and pre-hooks ran around its call in the top-level trace (the
    leaf stands for its forward alone): its template must not run them again. A hook that
    transformers uses to collect each layer's hidden state would otherwise record it twice."""
    names = [n for n in vars(block) if n.startswith("_forward_") and "hooks" in n]
    kept = {n: getattr(block, n) for n in names}
    try:
        for n, hooks in kept.items():
            setattr(block, n, type(hooks)())
        yield
    finally:
        for n, hooks in kept.items():
            setattr(block, n, hooks)


def _runs(calls: list[fx.Node], stack: BlockStack | None) -> list[list[fx.Node]]:
    """The block calls in runs of consecutive calls into one list: a vision tower's layers, then
    the decoder's."""
    runs: list[list[fx.Node]] = []
    for c in calls:
        if runs and stack.list_of(runs[-1][-1].args[1]) == stack.list_of(c.args[1]):
            runs[-1].append(c)
        else:
            runs.append([c])
    return runs


def _segments(computed: list[fx.Node], runs: list[list[fx.Node]]) -> dict[fx.Node, int]:
    """For each op that runs before some run of blocks, the run it goes before: the first one it
    feeds. Run 0's segment is the prologue (embeddings, rotary tables, masks; a tower's patch
    embedding); run r's, the bridge from run r-1 (a tower's last norm, the projector, the token
    embedding and the merge of the image features into it). An op placed as late as it may go
    hands its value to the next run directly. An op between two blocks of one run has no segment:
    it falls to the epilogue, where the first block reading it is refused (_add_blocks)."""
    first_fed: dict[fx.Node, int] = {}
    for r, run in enumerate(runs):
        frontier = [a for c in run for a in c.args[0]]
        while frontier:
            n = frontier.pop()
            if n not in first_fed and n.target is not BLOCK_CALL:
                first_fed[n] = r
                frontier.extend(n.all_input_nodes)
                frontier.extend(_writers(n))
    after: dict[fx.Node, int] = {}      # the last run an op is downstream of
    for r in reversed(range(len(runs))):
        frontier = list(runs[r])
        while frontier:
            n = frontier.pop()
            for u in n.users:
                if u not in after:
                    after[u] = r
                    frontier.append(u)
    before = {n: first_fed[n] for n in computed if n in first_fed and after.get(n, -1) < first_fed[n]}
    # An element of a multi-output op that no block reads (a layer norm's mean and rstd) stays
    # beside the op: a stage cannot hand out a tuple.
    for n in computed:
        if n.target is operator.getitem and n.args[0] in before:
            before[n] = before[n.args[0]]
    return before


def _writers(n: fx.Node) -> list[fx.Node]:
    """The in-place ops that write `n` or a view of it. Nothing reads their outputs (Qwen3-VL's
    rotary tables interleave their sections by writing into a slice of a view), yet they belong
    with the value they change, before its readers."""
    found = []
    for u in n.users:
        schema = getattr(u.target, "_schema", None)
        if schema is None:
            continue
        for k, arg in enumerate(schema.arguments):
            value = u.args[k] if k < len(u.args) else u.kwargs.get(arg.name)
            if value is n and arg.alias_info is not None and arg.alias_info.is_write:
                found.append(u)
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) and u.args \
                and u.args[0] is n:
            found.extend(_writers(u))    # a view of n: what writes it writes n
    return found


def _returned(call: BlockCall) -> int:
    """How many tensors the block returns; its side outputs (side_outputs.py) follow them."""
    return sum(m is not None for m in call.out_meta)


def _outputs_read(call: fx.Node, n_outputs: int) -> tuple[bool, ...]:
    """Which of a block call's tensor outputs the rest of the model reads."""
    read = [False] * n_outputs
    for u in call.users:
        if u.target is operator.getitem and u.users:
            read[u.args[1]] = True
    return tuple(read)


def _refuse_cut_gradients(stages: list[StageInstance]) -> None:
    """A stage output that needs a gradient and that no reader differentiates (the epilogue reads
    the last hidden state through .detach()) would send zeros back where eagerly the parameters
    before it get no gradient at all, and torch.optim.AdamW skips them: megacompile would decay
    them and step their moments. Within one stage such parameters are found and skipped
    (stage.py); across stages the model is refused."""
    differentiated: dict[Port, bool] = {}
    for stage in stages:
        for k, port in enumerate(stage.inputs):
            if port.stage >= 0 and stage.template.acts[k].requires_grad:
                differentiated[port] = differentiated.get(port, False) or k not in stage.template.cut_acts
    for stage in stages:
        for k in stage.template.cut_acts:
            port = stage.inputs[k]
            if port.stage >= 0 and not differentiated[port]:
                raise CaptureError(
                    f"the {stage.name} stage reads output {port.index} of {stages[port.stage].name} without "
                    "differentiating it (through .detach(), or only by ops without a gradient), so the parameters "
                    "before it get no gradient from the loss along that path; megacompile cannot yet skip them as "
                    "torch.optim.AdamW does. Freeze them instead (param.requires_grad_(False)) and drop the "
                    ".detach()")


def _check_no_grad_bypass(stage: StageInstance, stages: list[StageInstance], side: set[Port], own: int) -> None:
    """A gradient may only flow back along the chain, to a block's side output (a layer's router
    logits, which the epilogue's auxiliary loss reads; a tower layer's deepstack features), or from
    the extra inputs of the work folded into a block (inputs from `own` on: the deepstack features
    the bridge hands a decoder block): a few bytes per token, whose gradient waits on the device
    from the reader's backward until the producer's."""
    for k, port in enumerate(stage.inputs):
        if port.stage < 0 or not stage.template.acts[k].requires_grad or port in side or k >= own:
            continue
        producer = stages[port.stage]
        index = stages.index(stage)
        if port.stage != index - 1:
            raise CaptureError(
                f"the {stage.name} reads output {port.index} of {producer.name}, which needs a gradient "
                "and skips the blocks in between; only the block chain may carry gradients")
