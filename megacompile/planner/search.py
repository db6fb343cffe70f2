"""From a captured model and a budget to a verified plan, or an error naming the smallest budget."""
from __future__ import annotations

import math

import dataclasses
from typing import Callable

from ..capture import CapturedModel
from ..errors import ArgumentError, BudgetTooSmallError, HostMemoryError
from ..ir.printer import fmt_bytes, fmt_need, gib_need
from ..ir.simulate import simulate
from ..ir.verify import verify
from ..capture.model_graph import owners
from ..cost import HardwareProfile, predict
from ..cost.predict import compute_seconds
from ..cost.host_memory import HostCost, choose_placement, host_costs, why_not
from ..cost.reserve import device_reserve, smallest_budget
from ..ir.arena import DeviceArena
from ..ir.program import COMPUTE_OPS, Op, Program, weights
from ..passes import ScheduleChoice, StepKind, build_schedule
from .solve import solve
from ..passes.lower import lower
from ..passes.selective import with_selective
from .shorten import Short, held_bytes, live_bytes, peak_with_cut, shorten, span
from .host_advice import disk_advice, lora_advice, lora_base_bytes
from .solve import Family, Selective, candidates, families, lowest
from ..passes.baselines import baseline_choice
from .chunk_count import plan_chunked
from .floor import compute_floor
from .judged import judged_before
from .request import PlanRequest
from .result import Plan
from .update_order import fastest_step_s, fastest_update_order

GiB = 2 ** 30
# The m of the families that recompute every m-th block of the offloaded stretch (solve.py).
STRIDES = (2, 3, 4)


def make_plan(captured: CapturedModel, request: PlanRequest) -> Plan:
    """The verified plan for `captured` as `request` asks (planner/request.py). With `request.fuse`,
    the stage graphs are first rewritten onto the fused kernels (megacompile/fusion), and the plan
    runs those graphs. `request.host_bytes`: host RAM the masters and AdamW state take; with
    `host_budget_bytes`, activations are offloaded only as far as the rest of that budget holds them.
    With `grad_accum` k > 1 and `accumulation` "layer", the plan runs the k micro-batches of a step in
    one program, layer by layer (passes/layer_major.py); "auto" takes it when its predicted step is
    shorter than k micro-batch-major steps."""
    budget_bytes, kind, backend, hardware = request.budget_bytes, request.kind, request.backend, request.hardware
    host_bytes, host_budget_bytes, host_cost = request.host_bytes, request.host_budget_bytes, request.host_cost
    grad_accum, accumulation, dump_dir = request.grad_accum, request.accumulation, request.dump_dir
    require_host_room(host_bytes, host_budget_bytes)
    if request.fuse:
        from ..fusion import fuse as fuse_stages
        captured = fuse_stages(captured)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    disk_per_param = host_cost.disk_bytes / max(host_cost.params, 1) if host_cost is not None else 0.0
    built: dict[ScheduleChoice, Program] = {}
    lowered: dict[tuple, Program] = {}
    placed: dict[tuple, tuple] = {}      # build_schedule's: what the block passes made, shared by candidates

    def lower_once(c: CapturedModel) -> Program:
        # Keyed by the templates the stages run (the selective set); passes never edit their input.
        key = tuple(id(st.template) for st in c.stages)
        if key not in lowered:
            lowered[key] = lower(c)
        return lowered[key].copy()

    def schedule(choice: ScheduleChoice) -> Program:
        if choice not in built:
            built[choice] = build_schedule(captured, choice, kind, check=False, lowered=lower_once, placed=placed)
        return built[choice]

    peak_of, seconds_of = judges(captured, blocks, hardware, schedule, lower_once, kind, disk_per_param, placed)
    # Figures judged in an earlier plan of this model are taken as they were (planner/judged.py).
    timed = (kind, hardware, disk_per_param)
    peak_of = remembered(peak_of, judged_before(captured, "peak", kind))
    seconds_of = remembered(seconds_of, judged_before(captured, "seconds", *timed))
    floor_of = compute_floor(captured, hardware)

    def whole_step_s(c: ScheduleChoice) -> float:
        if kind.updates == "as_gradients_land":     # timed with the updates as the plan will order them
            return fastest_step_s(schedule(c), with_selective(captured, c.selective), hardware, disk_per_param)
        return predict(schedule(c), with_selective(captured, c.selective), hardware, disk_per_param).step_s
    exact_of = remembered(whole_step_s, judged_before(captured, "whole step", *timed))

    host_room = None if host_budget_bytes is None else host_budget_bytes - host_bytes
    layer = layer_major_k(captured, kind, grad_accum, accumulation)

    def choose(room: int) -> tuple[ScheduleChoice | None, ScheduleChoice]:
        """The fastest choice whose simulated peak fits `room` (None if none does), and the choice of
        the smallest peak."""
        choice, least = None, None
        if accumulation != "layer" or layer == 1:
            # The fastest of each stride by the short-stack estimate, then on the whole stack.
            space = search_space(captured, blocks, hardware, host_room, device_room=room)
            choice, minimum = solve(blocks, room, peak_of, seconds_of, space, exact_of, floor_of=floor_of)
            least = lowest(blocks, space, peak_of)
        if layer > 1:
            # Every micro-batch of a layer-major step stashes what one would: k times the host bytes.
            space = search_space(captured, blocks, hardware, None if host_room is None else host_room // layer,
                                 device_room=room)
            choice, _ = pick_accumulation(blocks, room, peak_of, seconds_of, space, layer, choice,
                                          None if least is None else minimum, floor_of)
            least_layer = dataclasses.replace(lowest(blocks, space, lambda c: peak_of(
                dataclasses.replace(c, micro_batches=layer))), micro_batches=layer)
            if least is None or peak_of(least_layer) < peak_of(least):
                least = least_layer
        return choice, least

    laid_out: dict[ScheduleChoice, Program] = {}     # whole schedules, verified, with their arenas

    def arena_of(c: ScheduleChoice) -> DeviceArena:
        if c not in laid_out:
            laid_out[c] = build_schedule(captured, c, kind, check=True, lowered=lower_once, arena=True)
        return laid_out[c].facts["arena"]

    # A plan fits when its arena fits what the budget leaves after the workspaces and op scratch the
    # ledger cannot see, and its peak leaves the reserve free (cost/reserve.py: the runtime serves the
    # step's tensors from the arena; the caching allocator serves only the workspaces and scratch, and
    # the reserve keeps a share of those for its fragmentation). The solver judges candidates by their
    # peak, a lower bound of their arena; only the choice it keeps is laid out. Where its arena
    # overshoots, the solver chooses again with room for a peak that leaves as much packing as that
    # choice needed: the choice itself no longer fits (its peak is its arena less its packing), so
    # each round takes another.
    reserve = device_reserve(captured, budget_bytes, hardware, backend)
    plan_bytes = max(0, budget_bytes - reserve.total)
    arena_room = budget_bytes - reserve.workspace_bytes - reserve.scratch_bytes
    choice, least = choose(plan_bytes)
    room = plan_bytes
    for _ in range(4):
        if choice is None or arena_of(choice).size <= arena_room:
            break
        room = min(room, arena_room - arena_of(choice).fragmentation)
        choice = choose(room)[0]
    if choice is None or arena_of(choice).size > arena_room:
        # No round settled it (or a round found nothing): the schedule of the smallest peak, whose
        # arena is the smallest budget named, where it fits.
        choice = least if peak_of(least) <= plan_bytes and arena_of(least).size <= arena_room else None
    ledger_minimum = peak_of(least)
    minimum = smallest_budget(ledger_minimum, captured, hardware, backend, arena_of(least).size)
    if choice is None:
        largest = max(captured.stages, key=lambda s: s.template.weight_bytes)
        arena_note = (f", its device arena (every tensor at a planned offset) {fmt_bytes(arena_of(least).size)} "
                      f"for a peak of {fmt_bytes(ledger_minimum)}")
        at_minimum = device_reserve(captured, minimum, hardware, backend).total
        reserved = (f"; that includes a device reserve of {fmt_bytes(at_minimum)} for workspaces, op scratch and "
                    "fragmentation" if at_minimum else "")
        refused = BudgetTooSmallError(
            f"hbm_budget of {budget_bytes / GiB:.4g} GiB is too small: the smallest budget that fits this model "
            f"at these input shapes is {gib_need(minimum)} GiB ({fmt_need(minimum)}), with every block "
            f"recomputed (its input in host memory where the host budget allows) and no prefetch overlap{arena_note} "
            f"(the largest stage, {largest.name}, holds "
            f"{fmt_bytes(largest.template.weight_bytes)} of weights{reserved}). Raise hbm_budget to at least "
            f"{gib_need(minimum)}, or lower the batch size or sequence length.", minimum)
        if captured.rechunk is None:
            raise refused
        # Blocks run over sequence chunks (megacompile/planner/chunk_count.py) when they do not fit whole.
        return plan_chunked(captured, lambda c: make_plan(c, dataclasses.replace(request, fuse=False)), refused)
    arena_of(choice)
    program = laid_out[choice] if dump_dir is None else build_schedule(captured, choice, kind, check=True,
                                                                       dump_dir=dump_dir, arena=True)
    captured = with_selective(captured, choice.selective)
    if kind.updates == "as_gradients_land":
        program = fastest_update_order(program, captured, hardware, disk_per_param)
    verify(program, budget_bytes=plan_bytes, owners=owners(captured)[1] if captured.train else None,
           arena_budget_bytes=arena_room)
    return Plan(program, captured, budget_bytes, host_bytes, backend, minimum, hardware=hardware,
                prediction=predict(program, captured, hardware, disk_per_param), host_budget_bytes=host_budget_bytes,
                reserve=reserve, host_cost=host_cost, grad_accum=grad_accum)


def remembered(judge: Callable[[ScheduleChoice], float], table: dict) -> Callable[[ScheduleChoice], float]:
    """`judge`, asked once per choice: its answers are kept in `table`."""
    def judged(choice: ScheduleChoice) -> float:
        if choice not in table:
            table[choice] = judge(choice)
        return table[choice]
    return judged


def lowest_budget(plan_at: Callable[[int], Plan]) -> int:
    """The smallest budget any plan fits: planned at no budget, make_plan's refusal names the
    lowest over the whole blocks and the sequence chunk counts it tries (megacompile/planner/chunk_count.py). A plan's
    own `minimum_budget_bytes` is that of its blocks as they are, which chunking may undercut."""
    try:
        plan_at(0)
    except BudgetTooSmallError as e:
        return e.minimum_bytes
    raise AssertionError("a plan fitted in no device memory")


def layer_major_k(captured: CapturedModel, kind: StepKind, grad_accum: int, accumulation: str) -> int:
    """Micro-batches a layer-major program would take (1: micro-batch-major only). Random ops would
    draw in another order than eager accumulation: 'layer' is refused for them, 'auto' never offers it."""
    if grad_accum == 1 or accumulation == "micro" or not captured.train or not kind.update:
        return 1
    random = [st.name for st in captured.stages if st.template.random and _draws(st.template.forward.body)]
    if random and accumulation == "layer":
        raise ArgumentError(f"accumulation='layer' runs the micro-batches of a step block by block, so random ops "
                        f"({', '.join(random[:3])}) would draw other values than eager accumulation; set dropout "
                        "to 0 or use accumulation='micro'")
    return 1 if random else grad_accum


def _draws(body) -> bool:
    """Whether a graph's random ops can change a result: SDPA and dropout with probability 0 carry
    the random tag but give the same values whatever they draw."""
    from ..capture.split import is_random
    for n in body:
        if n.op != "call_function" or not is_random(n):
            continue
        schema = n.target._schema.arguments
        # An argument left out takes its schema default (SDPA's dropout_p is 0.0).
        given = {a.name: a.default_value for a in schema if a.has_default_value()}
        given |= dict(zip([a.name for a in schema], n.args)) | dict(n.kwargs)
        p = given.get("dropout_p", given.get("p"))
        if not isinstance(p, (int, float)) or p != 0:
            return True
    return False


def pick_accumulation(blocks: list[int], plan_bytes: int, peak_of, seconds_of, space, k: int,
                      micro_choice: ScheduleChoice | None, micro_minimum: int | None, floor_of=None):
    """The layer-major choice for k micro-batches, unless k micro-batch-major steps (`micro_choice`,
    None when not offered or nothing fit) are predicted shorter."""
    def lm(c: ScheduleChoice) -> ScheduleChoice:
        return dataclasses.replace(c, micro_batches=k)
    # Only a layer-major step shorter than k micro-batch-major ones is taken: none slower is sought.
    bound = float("inf") if micro_choice is None else k * seconds_of(micro_choice)
    choice, minimum = solve(blocks, plan_bytes, lambda c: peak_of(lm(c)), lambda c: seconds_of(lm(c)), space,
                            bound=bound, floor_of=None if floor_of is None else lambda c: floor_of(lm(c)))
    minimum = minimum if micro_minimum is None else min(minimum, micro_minimum)
    if choice is None:
        return micro_choice, minimum
    if micro_choice is not None and k * seconds_of(micro_choice) <= seconds_of(lm(choice)):
        return micro_choice, minimum
    return lm(choice), minimum


def judges(captured: CapturedModel, blocks: list[int], hardware: HardwareProfile,
           schedule: Callable[[ScheduleChoice], Program], lowered: Callable[[CapturedModel], Program],
           kind: StepKind, disk_per_param: float = 0.0, placed: dict | None = None
           ) -> tuple[Callable[[ScheduleChoice], int], Callable[[ScheduleChoice], float]]:
    """The solver's two functions, choice -> peak bytes and choice -> predicted seconds, judged on
    the stack with each run of like blocks cut short (megacompile/planner/shorten.py): the peak exactly, the
    seconds as the short step plus each cut block's period (the busiest stream's time for one
    block of its run). Stacks too short to cut, and forward-only plans, are judged whole.
    `placed`: build_schedule's table for the short schedules, kept with `lowered`."""
    judged: dict[tuple, _ShortJudge] = {}
    cuts: dict[ScheduleChoice, tuple[Short, _ShortJudge | None]] = {}
    peaks: dict[ScheduleChoice, int] = {}

    def short(choice: ScheduleChoice) -> tuple[Short, "_ShortJudge | None"]:
        if not captured.train:      # forward only: a few choices, no backward to bound a span
            return Short(captured, choice, ()), None
        if choice in cuts:
            return cuts[choice]
        cut = shortened(choice)
        if not cut.runs:
            cuts[choice] = cut, None
            return cuts[choice]
        # Choices that differ only in how many blocks each run loses share one short schedule.
        key = (len(cut.captured.stages), cut.choice, tuple((r.first, r.key) for r in cut.runs))
        if key not in judged:
            program = build_schedule(cut.captured, cut.choice, kind, check=False, lowered=lowered, placed=placed)
            judged[key] = _ShortJudge(program, with_selective(cut.captured, cut.choice.selective), cut.runs, hardware,
                                      disk_per_param, cut.choice.resident)
        cuts[choice] = cut, judged[key]
        return cuts[choice]

    by_blocks: dict[ScheduleChoice, Short] = {}

    def shortened(choice: ScheduleChoice) -> Short:
        # The cut depends on what the blocks do, not on how many micro-batches run through them.
        base = dataclasses.replace(choice, micro_batches=1)
        if base not in by_blocks:
            by_blocks[base] = shorten(captured, blocks, base, max(base.offload_lag, base.prefetch_depth) + 1)
        cut = by_blocks[base]
        return cut if base == choice else Short(cut.captured, dataclasses.replace(
            cut.choice, micro_batches=choice.micro_batches), cut.runs)

    def peak_of(choice: ScheduleChoice) -> int:
        if choice not in peaks:
            cut, judge = short(choice)
            peaks[choice] = simulate(schedule(choice)).peak if judge is None else judge.peak(cut.runs)
        return peaks[choice]

    times: dict[ScheduleChoice, float] = {}

    def seconds_of(choice: ScheduleChoice) -> float:
        if choice not in times:
            cut, judge = short(choice)
            times[choice] = (predict(schedule(choice), with_selective(captured, choice.selective), hardware,
                                     disk_per_param).step_s if judge is None else judge.seconds(cut.runs))
        return times[choice]
    return peak_of, seconds_of


class _ShortJudge:
    """One short schedule and what each cut block of its runs adds: bytes over a span, seconds.
    Each half is worked out when first asked: most short schedules are only timed (a family's
    fastest choice held to a bar), fewer only have their peak found (a bisection's probes)."""

    def __init__(self, program: Program, captured: CapturedModel, runs: tuple, hardware: HardwareProfile,
                 disk_per_param: float = 0.0, resident: frozenset[int] = frozenset()):
        self.program, self.captured, self.hardware = program, captured, hardware
        self.disk_per_param, self.runs, self.resident = disk_per_param, runs, resident
        self._bytes: tuple[list[int], list, list[int]] | None = None
        self._periods: list[float] | None = None
        self._step_s: float | None = None

    def _held(self) -> tuple[list[int], list, list[int]]:
        if self._bytes is None:
            program = self.program
            middle = next(i for i, n in enumerate(program.nodes) if n.op is Op.BACKWARD)
            live = live_bytes(program, middle)
            # Per run, what one period of its pattern holds (summed over its blocks): its saved
            # values, and the weights of blocks resident from their forward to their backward.
            held = [sum(held_bytes(program, middle, f"f{s}.", weights(s) if s in self.resident else None, live)
                        for s in range(r.first, r.first + r.period)) for r in self.runs]
            self._bytes = simulate(program).peak_during, [span(program, r.first) for r in self.runs], held
        return self._bytes

    def peak(self, runs: tuple) -> int:
        peak_during, spans, held = self._held()
        return peak_with_cut(peak_during, [(*sp, r.removed // r.period * b) for sp, r, b in zip(spans, runs, held)])

    def seconds(self, runs: tuple) -> float:
        if self._step_s is None:
            self._step_s = predict(self.program, self.captured, self.hardware, self.disk_per_param).step_s
            self._periods = [_period(self.program, self.captured, range(r.first, r.first + r.period), self.hardware,
                                     self.disk_per_param) for r in self.runs]
        return self._step_s + sum(r.removed // r.period * p for r, p in zip(runs, self._periods))


def _period(program: Program, captured: CapturedModel, stages: range, hw: HardwareProfile,
            disk_per_param: float = 0.0) -> float:
    """One period's share of a long run's step: the busiest stream's seconds for its `stages`
    together (a pattern that mixes recompute and offload balances the streams over the period)."""
    busy = {"compute": 0.0, "h2d": 0.0, "d2h": 0.0, "host": 0.0}
    for n in program.nodes:
        if n.stage not in stages:
            continue
        s = n.stage
        busy["compute"] += hw.node_overhead_s
        if n.op in COMPUTE_OPS:
            busy["compute"] += compute_seconds(captured, n, hw)[0]
        elif n.op is Op.PREFETCH:
            busy["h2d"] += program.values[n.writes[0]].nbytes / hw.h2d_bw
        elif n.op is Op.OFFLOAD:
            busy["d2h"] += program.values[n.reads[0]].nbytes / hw.d2h_bw
        elif n.op is Op.OPTIMIZER_STEP:    # as cost/predict.py times an update
            params = sum(p.meta.nbytes // p.meta.dtype.itemsize for p in captured.stages[s].template.params
                         if p.trainable)
            disk = params * disk_per_param
            busy["host"] += max(params / hw.host_adam_params_per_s, disk / hw.disk_read_bw + disk / hw.disk_write_bw)
    return max(busy.values())


def require_host_room(host_bytes: int, host_budget_bytes: int | None, detail: str = "",
                      facts: dict | None = None) -> None:
    """HostMemoryError unless the masters and AdamW state fit the host budget; `facts` go with it."""
    if host_budget_bytes is not None and host_bytes > host_budget_bytes:
        raise HostMemoryError(
            f"the host RAM budget of {host_budget_bytes / GiB:.4g} GiB cannot hold the fp32 masters, AdamW "
            f"moments, gradients and compute copies, which take {fmt_need(host_bytes)}; raise the host budget, "
            f"or train a smaller model{detail}", facts)


def _host_facts(costs: list[HostCost], smallest_bytes: int) -> dict:
    """HostMemoryError's fields: the smallest host budget that fits, the parameters, each placement's tiers."""
    return {"smallest_host_budget_bytes": smallest_bytes, "trainable_params": costs[0].params,
            "host_placements": [{"placement": c.placement.describe(), "ram_bytes": c.ram_bytes,
                                 "disk_bytes": c.disk_bytes, "disk_pool_bytes": c.pool_bytes,
                                 "tiers": {k: {"where": w, "bytes": n} for k, (w, n) in c.tiers.items()}}
                                for c in costs]}


def place_host_state(captured: CapturedModel, compute_dtype, grad_accum: int, host_budget_bytes: int | None,
                     nvme_budget_bytes: int | None, ranks: tuple[int, int] | None = None,
                     module_resident: frozenset[str] = frozenset(), borrowed: frozenset[str] = frozenset(),
                     updates: str = "at_commit") -> HostCost:
    """Where the masters and AdamW state live: all in host RAM if they fit the host budget, else
    the moments on disk, else the masters too (cost/host_memory.py); HostMemoryError, saying what
    each placement needs, when none fits both budgets. `ranks`: (R, L), data parallelism over R
    ranks, L per node: the rank's sharded figure against its budget (cost/host_shards.py).
    `module_resident`: the names of the user's module's tensors that hold real host memory, whose
    bytes count where the host state cannot share them (host_memory.module_bytes). `borrowed`: frozen
    weights another engine holds for this one (runtime/host.py), not counted. `updates`: compile()'s,
    which a refusal's advice of a disk tier names (updates as gradients land take none)."""
    if ranks is not None:
        from ..cost.host_shards import sharded_host_cost
        module = sum(e.numel * e.dtype.itemsize for n, e in captured.state.items() if n in module_resident)
        cost = sharded_host_cost(captured, compute_dtype, grad_accum, *ranks, module=module)
        require_host_room(cost.ram_bytes, host_budget_bytes, f" ({cost.describe()}; the budget is 1/{ranks[1]} "
                          "of the node's host budget)", _host_facts([cost], cost.ram_bytes * ranks[1]))
        return cost
    costs = host_costs(captured, compute_dtype, grad_accum, module_resident, borrowed)
    chosen = choose_placement(costs, host_budget_bytes, nvme_budget_bytes)
    if chosen is None:
        base = lora_base_bytes(captured, compute_dtype)
        hint = (disk_advice(costs, host_budget_bytes, nvme_budget_bytes, updates)
                + lora_advice(base, compute_dtype, host_budget_bytes))
        room = [c for c in costs if c.disk_bytes == 0 or (nvme_budget_bytes is not None and c.disk_bytes <= nvme_budget_bytes)]
        least = min(room, key=lambda c: c.ram_bytes)
        smallest = f"{math.ceil(least.ram_bytes / GiB * 100) / 100:.2f} GiB ({least.placement.describe()})"
        placements = f". Placements: {why_not(costs, host_budget_bytes, nvme_budget_bytes)}"
        facts = _host_facts(costs, least.ram_bytes) | ({} if base is None else {"lora_base_bytes": base})
        if least.disk_bytes:
            # The disk tier given takes part of the state: the RAM it leaves is the figure to act on.
            raise HostMemoryError(
                f"the host RAM budget of {host_budget_bytes / GiB:.4g} GiB cannot hold the host state even with the "
                f"disk tier: the smallest host budget that fits is {smallest}, {fmt_need(costs[0].ram_bytes)} with "
                f"all of it in RAM; raise the host budget, or train a smaller model{hint}{placements}", facts)
        require_host_room(costs[0].ram_bytes, host_budget_bytes,
                          f"{hint}. The smallest host budget that fits is {smallest}{placements}", facts)
    return chosen


def search_space(captured: CapturedModel, blocks: list[int], hardware: HardwareProfile,
                 host_room: int | None = None, device_room: int | None = None) -> list[Family]:
    """The candidate families the solver searches for this model; `host_room`: host bytes left for
    offloaded activations (None: no limit); `device_room`: the bytes the plan may fill."""
    if not captured.train or not blocks:
        return families()
    # The prologue (embeddings) and a bridge (a vision tower's projector and the token embedding)
    # may stay on the device for the whole step instead of coming twice.
    small = frozenset(s for s, st in enumerate(captured.stages) if st.template.kind in ("prologue", "bridge"))
    residents = (frozenset(), small) if small else (frozenset(),)
    # Weights that take at most half the room may all stay from their forward to their backward:
    # each crosses the link once a step instead of twice (a small model is link-bound otherwise).
    if device_room is not None and 2 * sum(st.template.weight_bytes for st in captured.stages) <= device_room:
        residents += (frozenset(range(len(captured.stages))),)
    # Offloading saved activations trades link time for recompute time: the first 0, n/8, .., n.
    n = len(blocks)
    offload_counts = sorted({round(n * i / 8) for i in range(9)})
    # Blocks may run several templates (blocks.py): each is asked for its own variant and lag.
    def held(s: int, selective: Selective):
        t = captured.stages[s].template
        return t if selective is Selective.NONE or t.selective is None else t.selective
    any_selective = any(captured.stages[s].template.selective is not None for s in blocks)
    selective = tuple(Selective) if any_selective else (Selective.NONE,)
    distinct = {id(captured.stages[s].template): s for s in blocks}.values()
    # A block that neither keeps nor saves may also send its input to host memory (boundary.py).
    # Every m-th block of the offloaded stretch may recompute instead (solve.py: `stride`); tried
    # for stretches of half the blocks or more, where the copies out bind the forward.
    lags = {mode: max(_offload_lag(captured, held(s, mode), hardware) for s in distinct) for mode in selective}
    options = families(residents, offload_counts, selective, lags.__getitem__, (False, True), (0, *STRIDES))
    options = [f for f in options if not f.stride or 2 * f.offloaded >= n]
    if host_room is None:
        return options

    def stash(f: Family) -> int:    # offloaded blocks never recompute, so KEPT offloads the variant
        inputs = sum(_input_bytes(captured, s) for s in blocks) if f.boundary else 0   # at most every block's
        return inputs + sum(held(s, f.selective).saved_bytes for s in candidates(blocks, f).stash)
    return [f for f in options if stash(f) <= host_room]


def _input_bytes(captured: CapturedModel, s: int) -> int:
    """Bytes of a block's inputs that carry a gradient: its boundary with the block before it."""
    return sum(a.nbytes for a in captured.stages[s].template.acts if a.requires_grad)


def _offload_lag(captured: CapturedModel, t, hardware: HardwareProfile) -> int:
    """How many block computes one saved-activation copy of template `t` spans on this hardware (1 to 8)."""
    import math

    from ..cost import graph_cost
    compute = graph_cost(t.forward, hardware, captured.compute_dtype).seconds
    return max(1, min(8, math.ceil(t.saved_bytes / hardware.d2h_bw / max(compute, 1e-9))))


def make_baseline_plan(captured: CapturedModel, budget_bytes: int, style: str, *, backend: str, host_bytes: int,
                       hardware: HardwareProfile) -> Plan:
    """Another system's schedule (passes/baselines.py) for the same graphs, timed by the same cost
    model; it is not held to the budget (Plan.fits says whether it would fit)."""
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    program = build_schedule(captured, baseline_choice(style, blocks), check=True, arena=True)
    program.passes.append(f"style={style}")
    minimum = simulate(program).peak
    return Plan(program, captured, budget_bytes, host_bytes, f"{style}-style schedule on {hardware.name}", minimum,
                hardware=hardware, prediction=predict(program, captured, hardware))
