"""Run a schedule: one pass over its nodes per step, doing exactly what each node says.

Compute nodes run their stage graph op by op (ir/stage_program.py) on the compute thread;
PREFETCH and OFFLOAD go to the copy streams, each returning an event that the matching WAIT
(or the end of the step) blocks on. On cuda the WAIT for a gradient offload is stream-side, for
the copy alone; the host work after it (the add into the fp32 grads, which also checks them) is
waited for once, when the walk ends. Every device tensor is held in the backend's DeviceMemory
under the schedule's value names, so the budget is enforced and the peak measured with the
same rule the plan was simulated with.

A step either happens completely or not at all. CLIP_GRADS and OPTIMIZER_STEP are staged, not
started: `commit()` hands them to the host stream once the caller knows the step is sound (the
walk finished, loss and gradients finite). A step that raises anywhere commits nothing, and
leaves the device ledger as it found it. Under compile(..., updates="as_gradients_land") each
OPTIMIZER_STEP starts its update where it stands instead (runtime/early_updates.py).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..capture import CapturedModel
from ..ir.program import COMPUTE_OPS, SEED, Node, Op, Program, base_name, restored_of, weights
from ..passes.arena import graph_of
from .arena import flat_views
from .backend import Backend, Event, flat_empty
from .early_updates import EarlyUpdates
from .host import HostState, owner_map
from .placement import Copied, NodePlacement, place_node
from .stash import rebuild, stash_storages

# The host work of one optimizer step: update(stage, context) and clip(context), where context
# is a dict made when the step starts (step number, learning rate) that clip adds its scale to.
UpdateFn = Callable[[int, dict], None]
ClipFn = Callable[[dict], None]


# Value kinds an OFFLOAD keeps in host memory until a PREFETCH brings them back (the rest of the
# offloads are gradients, added into the fp32 grads).
STASHED = ("saved", "activation")


class NonFiniteLoss(Exception):
    """The loss of a training step is inf or NaN: raised when the walk ends, before any commit.
    `outputs`: the walk's OUTPUT values all the same (what run() would have returned)."""

    def __init__(self, loss: float, outputs: list | None = None):
        super().__init__(f"the loss is {loss}")
        self.loss, self.outputs = loss, outputs or []


class Executor:
    def __init__(self, captured: CapturedModel, program: Program, backend: Backend, host: HostState,
                 update: UpdateFn | None = None, clip: ClipFn | None = None):
        self.captured, self.program, self.backend, self.host = captured, program, backend, host
        self.update, self.clip = update, clip
        self.memory = backend.memory
        self._env: dict[str, Any] = {}
        self._events: dict[str, Event] = {}
        self._rng: dict[tuple[int, int], torch.Tensor] = {}     # (stage, micro-batch) -> state at its forward
        self._outputs: list[torch.Tensor] = []
        self._context: dict = {}
        # Host copies of offloaded values (a stage's saved bundle, a block input), by value name.
        self._stash: dict[str, list[torch.Tensor]] = {}
        self._clip_staged = False
        self._staged: list[int] = []      # owners whose update waits for commit()
        self._moved: dict[str, list] = {}     # where each stashed tensor sat (runtime/stash.py)
        self._landed: dict[int, Event] = {}               # per stage: its gradients added on the host
        self._clip_node: int | None = None                # the staged nodes, for the timeline
        self._update_node: dict[int, int | None] = {}
        # The host owner each owning stage updates: itself for the program the host state was laid
        # out from; by its parameters for another (runtime/host.py owner_map).
        self._owners: dict[int, int] | None = None
        self._update_label: dict[int, str] = {}
        # The device arena (runtime/arena.py): the plan's tensors of each node, made at the node's
        # first run and reused every step while the arena stays the same.
        facts = getattr(program, "facts", None) or {}
        self.arena_plan = facts.get("arena") if getattr(backend, "arena", None) is not None else None
        self._arena_tensors: dict[int, list] = {}
        for t in self.arena_plan.tensors if self.arena_plan is not None else ():
            self._arena_tensors.setdefault(t.node, []).append(t)
        self._placed: dict[int, NodePlacement] = {}
        self._generation = None
        self._at: NodePlacement | None = None     # the placement of the node running now
        self._i = 0                                # the index of the node running now
        kind = facts.get("step_kind")
        self.early = (EarlyUpdates(captured, program, host, self._owner)
                      if getattr(kind, "updates", None) == "as_gradients_land" else None)
        self.copied = Copied()                     # op results copied into the arena, this step

    # -- one step ------------------------------------------------------------------------
    def run(self, inputs: list[torch.Tensor], seed: float | list[float] = 1.0, context: dict | None = None,
            check_loss: bool = False) -> list[torch.Tensor]:
        """Execute the schedule once; returns the OUTPUT node's values on the host.

        `seed` is the loss gradient (1/k for one of k accumulated micro-batches, or the micro-batch's
        weight). A layer-major program (passes/layer_major.py) takes one list of inputs per
        micro-batch (and a seed for each, or one for all) and returns the outputs of each
        micro-batch in turn. With
        `check_loss`, a non-finite loss raises NonFiniteLoss once the walk ends. The
        updates this step stages start only at `commit()`.
        """
        self._inputs, self._seed, self._context = inputs, seed, context or {}
        self._check_loss = check_loss
        self._clip_staged, self._staged = False, []
        self._outputs = []
        if self.early is not None:
            self.early.begin(self._context.get("step"))
        self.memory.reset_peak()
        self.backend.reset_allocator_peak()
        self._serve_arena()
        self.backend.begin_step(self.program)     # the timeline's record of this step (runtime/timeline.py)
        held = self.memory.ledger.snapshot()
        failed = True
        with self.backend.scope():
            try:
                for i, node in enumerate(self.program.nodes):
                    self._node(i, node)
                # Every gradient added in (and checked) on the host before the caller decides.
                for event in self._landed.values():
                    event.wait()
                failed = False
            finally:
                self._release_all(drain_host=failed)
                if failed:
                    self.commit_nothing()
                    # Values a stage graph held when an op raised inside it are named by graph node,
                    # not in the schedule's env: give back everything the step took.
                    self.memory.ledger.restore(held)
        # The loss is read once its copy has landed (the end of the walk waits for it): on a GPU a
        # check at the OUTPUT node would stall the step mid-way. Nothing was committed yet.
        if self._check_loss:
            for loss in self._outputs[::len(self.captured.outputs)]:    # each micro-batch's loss
                if not torch.isfinite(loss).all():
                    raise NonFiniteLoss(float(loss.float().sum()), self._outputs)
        return self._outputs

    def _node(self, i: int, node: Node) -> None:
        """Run one node, recording it in the timeline: the span of the compute thread's part (a stage's
        own span comes from the backend, device-timed on cuda; a transfer's from its stream) and the
        device bytes live after it and at most while it ran."""
        timeline, ledger = self.backend.timeline, self.memory.ledger
        timeline.node = self._i = i
        self._at = self._placement(i, node) if self.arena_plan is not None else None
        peak_so_far, ledger.peak_bytes = ledger.peak_bytes, ledger.live_bytes
        start = time.perf_counter()
        try:
            getattr(self, "_" + node.op.value)(node)
        finally:
            end = time.perf_counter()
            node_peak, ledger.peak_bytes = ledger.peak_bytes, max(peak_so_far, ledger.peak_bytes)
            timeline.node = None
        if node.stream == "compute" and node.op not in COMPUTE_OPS:
            timeline.add("compute", self._label(node), start, end, (i, timeline.step))
        # A FREE holds at most what it leaves (the simulator's rule), not what was there before it.
        timeline.sample(i, end, ledger.live_bytes, ledger.live_bytes if node.op is Op.FREE else node_peak)

    def _label(self, node: Node) -> str:
        return node.op.value + ("" if node.stage is None else f" {self.program.stage_names[node.stage]}")

    def commit(self) -> None:
        """Start the staged host work, in schedule order: the clip scale, then each update."""
        timeline = self.backend.timeline
        if self._clip_staged:
            timeline.node = self._clip_node
            start = time.perf_counter()
            self.clip(self._context)   # a sum of the norms taken as gradients landed: no pass
            timeline.add("host", "clip_grads", start, time.perf_counter())
        context = self._context
        if self._staged:
            # The step's last micro-batch updates every owner its micro-batches reached, also those
            # no stage of this program owns (a tower's, after an image micro-batch, when this one
            # holds none; with data parallelism, after another rank's).
            for owner in self.host.reached_owners():
                if owner not in self._staged:
                    self._staged.append(owner)
                    self._update_label[owner] = f"owner {owner}, reached by another micro-batch"
            self._staged = self.host.update_order(self._staged)
        self.host.schedule_updates(self._staged, context.get("step") if self._staged else None)
        for s in self._staged:
            timeline.node = self._update_node.get(s)
            self.host.pending[s] = self.backend.host_task(
                lambda s=s: self.update(s, context), f"adamw {self._update_label[s]}")
        timeline.node = None
        self._clip_staged, self._staged = False, []

    def commit_nothing(self) -> None:
        """The step was dropped: forget what it staged."""
        self._clip_staged, self._staged = False, []

    def _release_all(self, drain_host: bool) -> None:
        """Leave no device value or copy in flight behind, even after an error."""
        self.backend.synchronize(host=drain_host)
        for name, value in self._env.items():
            self.memory.drop(name, value)
        self._env.clear()
        self._events.clear()
        for host in self._stash.values():    # stashed, never restored (a step that failed)
            self.backend.release_stash(host, None)
        self._stash.clear()
        self.backend.give_back_freed()
        self._moved.clear()
        self._landed.clear()

    # -- the device arena ----------------------------------------------------------------------
    def _serve_arena(self) -> None:
        """The arena holds this plan's (allocated at the first step; replaced by a larger one only
        when another plan of the engine needed more since); placements of an older one go."""
        self.copied.count = 0
        self.memory.outside = []
        if self.arena_plan is None:
            self.memory.arena = None
            return
        generation = self.backend.arena.serve(self.arena_plan)
        if generation != self._generation:
            self._placed.clear()
            self._generation = generation
        self.memory.arena = self.backend.arena

    def _placement(self, i: int, node: Node) -> NodePlacement:
        placed = self._placed.get(i)
        if placed is None:
            graph = graph_of(self.captured, node) if node.op in COMPUTE_OPS else None
            placed = self._placed[i] = place_node(self.backend.arena, self._arena_tensors.get(i, []), graph,
                                                  self.copied)
        return placed

    def _slot(self, name: str) -> torch.Tensor | None:
        """The arena tensor (uint8, its bytes) of the one storage value `name` keeps, when the plan
        placed it at this node."""
        if self._at is None:
            return None
        parts = self.program.values[name].parts
        return self._at.values.get(parts[0][0]) if len(parts) == 1 else None

    def _put(self, name: str, value: Any) -> None:
        self._env[name] = value
        self.memory.hold(name, value, what=name)

    # -- nodes ---------------------------------------------------------------------------
    def _input(self, node: Node) -> None:
        names = [w for w in node.writes if base_name(w) != SEED]
        given = self._inputs[node.micro] if self.program.facts.get("micro_batches", 1) > 1 else self._inputs
        for name, t in zip(names, given):
            slot = self._slot(name)
            if slot is not None and slot.numel() != t.numel() * t.element_size():
                slot = None          # not the shape it was planned for: torch allocates it
            self._put(name, self.backend.to_device(t, None if slot is None else slot.view(t.dtype).view(t.shape)))
        for name in node.writes:
            if base_name(name) == SEED:
                loss_meta = self.captured.stages[self.captured.outputs[0].stage].template.outputs[0]
                slot = self._slot(name)
                seed = (self.backend.empty((), loss_meta.dtype) if slot is None
                        else slot[:loss_meta.dtype.itemsize].view(loss_meta.dtype).view(()))
                seed.fill_(self._seed[node.micro] if isinstance(self._seed, list) else self._seed)
                self._put(name, seed)

    def _prefetch(self, node: Node) -> None:
        if self.program.values[node.writes[0]].kind in STASHED:
            return self._restore(node)
        stage = self.captured.stages[node.stage]
        metas = [p.meta for p in stage.template.params]
        placed = self._slot(node.writes[0])
        slot = flat_empty(self.backend, metas) if placed is None else flat_views(placed, metas)
        self._put(weights(node.stage), slot)
        srcs = [self.host.source(name) for name in stage.params]
        self._events[weights(node.stage)] = self.backend.prefetch(slot, srcs, f"prefetch {stage.name}")

    def _wait(self, node: Node) -> None:
        (value,) = node.reads
        if self.program.values[value].kind == "host":
            self.host.wait_update(self._owner(node.stage))
        else:
            self._events.pop(value).wait()

    def _free(self, node: Node) -> None:
        for name in node.frees:
            self.memory.drop(name, self._env.pop(name))

    def _run_graph(self, program, inputs: list[Any], what: str) -> list[Any]:
        memory = self.memory
        start = self.backend.clock()
        places = self._at.places if self._at is not None else None
        outs = program.run(inputs, lambda n, v: memory.hold(n, v, what), memory.drop, places)
        self.backend.compute_span(what, start)
        return outs

    def _adopt(self, program, outs: list[Any], names: list[str | list]) -> None:
        """Move graph outputs from their graph-node holders to the schedule's value names."""
        nodes = list(program.output_node.args[0])
        for name, value in zip(names, outs):
            if name is not None:
                self.memory.hold(name, value, what=name)
        for n, value in zip(nodes, outs):
            if hasattr(n, "op") and n.op != "placeholder":
                self.memory.drop(n, value)

    def _forward(self, node: Node, recompute: bool = False) -> None:
        s = node.stage
        stage = self.captured.stages[s]
        t = stage.template
        inputs = list(self._env[weights(s)]) + [self._env[r] for r in node.reads[1:]]
        # Only a stage with random ops has a random state to replay: the forward of any other
        # stage records none.
        replay = recompute and t.random
        if replay:
            current = self.backend.get_rng_state()
            self.backend.set_rng_state(self._rng[(s, node.micro)])
        elif t.random:
            self._rng[(s, node.micro)] = self.backend.get_rng_state()
        try:
            outs = self._run_graph(t.forward, inputs, f"{'recompute' if recompute else 'forward'} {stage.name}")
        finally:
            if replay:
                self.backend.set_rng_state(current)
        n_out = len(t.outputs)
        bundle = outs[n_out:]
        if recompute:
            holders = [None] * n_out + [node.writes[0]] * len(bundle)
        else:
            holders = list(node.writes[:n_out]) + [node.writes[n_out]] * len(bundle)
        self._adopt(t.forward, outs, holders)
        if not recompute:
            for name, value in zip(node.writes[:n_out], outs[:n_out]):
                self._env[name] = value
        self._env[node.writes[-1]] = bundle

    def _recompute(self, node: Node) -> None:
        self._forward(node, recompute=True)

    def _infer(self, node: Node) -> None:
        s = node.stage
        stage = self.captured.stages[s]
        inputs = list(self._env[weights(s)]) + [self._env[r] for r in node.reads[1:]]
        outs = self._run_graph(stage.template.inference, inputs, f"infer {stage.name}")
        self._adopt(stage.template.inference, outs, list(node.writes))
        for name, value in zip(node.writes, outs):
            self._env[name] = value

    def _backward(self, node: Node) -> None:
        s = node.stage
        stage = self.captured.stages[s]
        t = stage.template
        w = self._env[weights(s)]
        n_acts = len(t.bwd_acts)
        acts = [self._env[r] for r in node.reads[1:1 + n_acts]]
        bundle = self._env[node.reads[1 + n_acts]]
        n_tan = len(t.tangent_outputs)
        tangents = [self._env[r] for r in node.reads[2 + n_acts:2 + n_acts + n_tan]]
        running = node.reads[2 + n_acts + n_tan:]    # layer-major: the gradient sum this one adds into
        inputs = [w[i] for i in t.bwd_params] + acts + list(bundle) + tangents
        outs = self._run_graph(t.backward, inputs, f"backward {stage.name}")
        n_pg = len(t.grad_params)
        names = list(node.writes)
        holders = [names[0]] * n_pg + names[1 if n_pg else 0:]
        self._adopt(t.backward, outs, holders)
        if n_pg:
            self._env[names[0]] = outs[:n_pg]
            if running:
                self._add_into(running[0], names[0])
        for name, value in zip(names[1 if n_pg else 0:], outs[n_pg:]):
            self._env[name] = value

    def _add_into(self, total: str, fresh: str) -> None:
        """Add a micro-batch's gradients into the running sum, in place; the sum goes on as `fresh`
        (the older name is freed after this node, the storage stays) and the fresh ones are dropped."""
        sums, new = self._env[total], self._env[fresh]
        for acc, g in zip(sums, new):
            acc.add_(g)
        self.memory.drop(fresh, new)
        self._env[fresh] = sums
        self.memory.hold(fresh, sums, what=fresh)

    def _restore(self, node: Node) -> None:
        """Saved activations (or a block's input) back from host memory: each stashed storage into a
        device buffer of its size, the tensors rebuilt on them with their layouts (runtime/stash.py)."""
        s, name = node.stage, node.writes[0]
        bundle = self.program.values[name].kind == "saved"
        key = next(v for v in self._stash if restored_of(v) == name)
        host, places = self._stash.pop(key), self._moved.pop(key)
        slots = [] if self._at is None else [self._at.values.get(k) for k, _ in self.program.values[name].parts]
        storages = [slots[j] if j < len(slots) and slots[j] is not None and slots[j].numel() == h.numel()
                    else self.backend.empty((h.numel(),), torch.uint8) for j, h in enumerate(host)]
        values = rebuild(places, storages)
        self._put(name, values if bundle else values[0])
        self._events[name] = self.backend.prefetch(storages, host, f"restore {self.program.stage_names[s]}")
        self.backend.release_stash(host, self._events[name])

    def _offload(self, node: Node) -> None:
        if self.program.values[node.reads[0]].kind in STASHED:
            return self._stash_saved(node)
        s = node.stage
        stage = self.captured.stages[s]
        names = [stage.params[i] for i in stage.template.grad_params]
        event = self.host.offload_grads(self.backend, names, list(self._env[node.reads[0]]), stage.name)
        self._events[node.reads[0]] = event
        # The gradients' host side: on cuda the WAIT is stream-side; run() waits for it at the end.
        self._landed[s] = getattr(event, "landed", event)

    def _stash_saved(self, node: Node) -> None:
        """Saved activations (a bundle) or a block's input (one tensor) to host memory until the
        backward half brings them back: each device storage once (runtime/stash.py)."""
        s, name = node.stage, node.reads[0]
        stash = self._stash
        value = self._env[name]
        tensors = list(value) if isinstance(value, (list, tuple)) else [value]
        storages, self._moved[name] = stash_storages(tensors, self.backend.device)

        def sink(host_copies: list[torch.Tensor]) -> None:
            stash[name] = host_copies
        self._events[name] = self.backend.offload(storages, sink, f"stash {name} of {self.program.stage_names[s]}",
                                                  keep=True)

    def _clip_grads(self, node: Node) -> None:
        self._clip_staged = True
        self._clip_node = self.backend.timeline.node

    def _owner(self, stage: int) -> int:
        """The host owner an owning stage of this program updates (runtime/host.py owner_map)."""
        if self._owners is None:
            self._owners = owner_map(self.captured, self.host.slots)[0]
        return self._owners.get(stage, stage)

    def _optimizer_step(self, node: Node) -> None:
        owner = self._owner(node.stage)
        if self.early is not None:
            context = self._context
            self.early.start(self._i, owner, self._landed, self.backend, lambda: self.update(owner, context),
                             f"adamw {self.program.stage_names[node.stage]}")
            return
        if owner not in self._staged:      # several stages of this program may update one owner
            self._staged.append(owner)
            self._update_node[owner] = self.backend.timeline.node
            self._update_label[owner] = self.program.stage_names[node.stage]

    def _output(self, node: Node) -> None:
        self._outputs += [self.backend.to_host(self._env[r]) for r in node.reads]
