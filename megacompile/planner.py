"""From a captured model and a budget to a verified plan, or an error naming the smallest budget."""
from __future__ import annotations

from .capture import CapturedModel
from .errors import BudgetTooSmallError, HostMemoryError
from .ir.printer import fmt_bytes
from .ir.simulate import simulate
from .ir.verify import verify
from .capture.model_graph import owners
from .cost import HardwareProfile, get_profile, predict
from .cost.host_memory import HostCost, choose_placement, host_costs, why_not
from .cost.reserve import device_reserve, smallest_budget
from .ir.program import Program
from .passes import ScheduleChoice, StepKind, build_schedule, solve
from .passes.lower import lower
from .passes.selective import with_selective
from .passes.solve import Family, Selective, families
from .passes.baselines import baseline_choice
from .plan import Plan

GiB = 2 ** 30


def make_plan(captured: CapturedModel, budget_bytes: int, kind: StepKind = StepKind(), *, backend: str,
              host_bytes: int, dump_dir: str | None = None, fuse: bool = False,
              hardware: HardwareProfile | None = None, host_budget_bytes: int | None = None,
              host_cost: HostCost | None = None) -> Plan:
    """The verified plan for `captured` under the budget. With `fuse`, the stage graphs are first
    rewritten onto the fused kernels (passes/fusion), and the plan runs those graphs.

    `host_bytes`: host RAM the masters and AdamW state take; with `host_budget_bytes`, activations
    are offloaded only as far as the rest of that budget holds them."""
    require_host_room(host_bytes, host_budget_bytes)
    if fuse:
        from .passes.fusion import fuse as fuse_stages
        captured = fuse_stages(captured)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    hardware = hardware or default_profile(backend)
    disk_per_param = host_cost.disk_bytes / max(host_cost.params, 1) if host_cost is not None else 0.0
    built: dict[ScheduleChoice, Program] = {}
    lowered: dict[tuple, Program] = {}

    def lower_once(c: CapturedModel) -> Program:
        # Keyed by the templates the stages run (the selective set); passes never edit their input.
        key = tuple(id(st.template) for st in c.stages)
        if key not in lowered:
            lowered[key] = lower(c)
        return lowered[key].copy()

    def schedule(choice: ScheduleChoice) -> Program:
        if choice not in built:
            built[choice] = build_schedule(captured, choice, kind, check=False, lowered=lower_once)
        return built[choice]

    def peak_of(choice: ScheduleChoice) -> int:
        return simulate(schedule(choice)).peak

    def seconds_of(choice: ScheduleChoice) -> float:
        return predict(schedule(choice), with_selective(captured, choice.selective), hardware, disk_per_param).step_s

    # The plan fills what the device reserve leaves (cost/reserve.py); the allocator's cap stays at
    # the whole budget.
    reserve = device_reserve(captured, budget_bytes, hardware, backend)
    plan_bytes = max(0, budget_bytes - reserve.total)
    choice, minimum = solve(blocks, plan_bytes, peak_of, seconds_of, search_space(captured, blocks, hardware,
                                                                        None if host_budget_bytes is None
                                                                        else host_budget_bytes - host_bytes))
    ledger_minimum, minimum = minimum, smallest_budget(minimum, captured, hardware, backend)
    if choice is None:
        largest = max(captured.stages, key=lambda s: s.template.weight_bytes)
        reserved = (f"; that includes a device reserve of {fmt_bytes(minimum - ledger_minimum)} for workspaces, op "
                    "scratch and fragmentation" if reserve.total else "")
        raise BudgetTooSmallError(
            f"hbm_budget of {budget_bytes / GiB:.4g} GiB is too small: the smallest budget that fits this model "
            f"at these input shapes is {minimum / GiB:.4g} GiB ({fmt_bytes(minimum)}), with every block "
            f"recomputed and no prefetch overlap (the largest stage, {largest.name}, holds "
            f"{fmt_bytes(largest.template.weight_bytes)} of weights{reserved}). Raise hbm_budget to at least "
            f"{minimum / GiB:.4g}, or lower the batch size or sequence length.", minimum)
    program = build_schedule(captured, choice, kind, check=True, dump_dir=dump_dir)
    verify(program, budget_bytes=plan_bytes, owners=owners(captured)[1] if captured.train else None)
    captured = with_selective(captured, choice.selective)
    return Plan(program, captured, budget_bytes, host_bytes, backend, minimum, hardware=hardware,
                prediction=predict(program, captured, hardware, disk_per_param), host_budget_bytes=host_budget_bytes,
                reserve=reserve, host_cost=host_cost)


def require_host_room(host_bytes: int, host_budget_bytes: int | None, detail: str = "") -> None:
    """HostMemoryError unless the masters and AdamW state fit the host budget."""
    if host_budget_bytes is not None and host_bytes > host_budget_bytes:
        raise HostMemoryError(
            f"the host RAM budget of {host_budget_bytes / GiB:.4g} GiB cannot hold the fp32 masters, AdamW "
            f"moments, gradients and compute copies, which take {host_bytes / GiB:.4g} GiB "
            f"({fmt_bytes(host_bytes)}); raise the host budget, or train a smaller model{detail}")


def place_host_state(captured: CapturedModel, compute_dtype, grad_accum: int, host_budget_bytes: int | None,
                     nvme_budget_bytes: int | None) -> HostCost:
    """Where the masters and AdamW state live: all in host RAM if they fit the host budget, else
    the moments on disk, else the masters too (cost/host_memory.py); HostMemoryError, saying what
    each placement needs, when none fits both budgets."""
    costs = host_costs(captured, compute_dtype, grad_accum)
    chosen = choose_placement(costs, host_budget_bytes, nvme_budget_bytes)
    if chosen is None:
        hint = ("" if nvme_budget_bytes is not None else
                ", or give a disk tier (compile(..., nvme_dir=PATH), --nvme-budget GiB) for the AdamW moments and masters")
        require_host_room(costs[0].ram_bytes, host_budget_bytes, f"{hint}. Placements: {why_not(costs, host_budget_bytes, nvme_budget_bytes)}")
    return chosen


def search_space(captured: CapturedModel, blocks: list[int], hardware: HardwareProfile,
                 host_room: int | None = None) -> list[Family]:
    """The candidate families the solver searches for this model; `host_room`: host bytes left for
    offloaded activations (None: no limit)."""
    if not captured.train or not blocks:
        return families()
    # The prologue (embeddings) may stay on the device for the whole step instead of coming twice.
    small = frozenset(s for s, st in enumerate(captured.stages) if st.template.kind == "prologue")
    residents = (frozenset(), small) if small else (frozenset(),)
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
    options = families(residents, offload_counts, selective,
                       lambda mode: max(_offload_lag(captured, held(s, mode), hardware) for s in distinct))
    if host_room is None:
        return options

    def stash(f: Family) -> int:    # offloaded blocks never recompute, so KEPT offloads the variant
        return sum(held(s, f.selective).saved_bytes for s in blocks[:f.offloaded])
    return [f for f in options if stash(f) <= host_room]


def _offload_lag(captured: CapturedModel, t, hardware: HardwareProfile) -> int:
    """How many block computes one saved-activation copy of template `t` spans on this hardware (1 to 8)."""
    import math

    from .cost import graph_cost
    compute = graph_cost(t.forward, hardware, captured.compute_dtype).seconds
    return max(1, min(8, math.ceil(t.saved_bytes / hardware.d2h_bw / max(compute, 1e-9))))


def default_profile(backend: str) -> HardwareProfile:
    """The measured profile for the simulated device; for a GPU, the profile its name matches."""
    if backend == "cpu":
        return get_profile("cpu")
    import torch
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else ""
    for key in ("gh200", "h200", "h100", "a100"):
        if key in name:
            return get_profile("h100-pcie" if key == "h100" and "pcie" in name else key)
    return get_profile("h100")


def make_baseline_plan(captured: CapturedModel, budget_bytes: int, style: str, *, backend: str, host_bytes: int,
                       hardware: HardwareProfile) -> Plan:
    """Another system's schedule (passes/baselines.py) for the same graphs, timed by the same cost
    model; it is not held to the budget (Plan.fits says whether it would fit)."""
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    program = build_schedule(captured, baseline_choice(style, blocks), check=True)
    program.passes.append(f"style={style}")
    minimum = simulate(program).peak
    return Plan(program, captured, budget_bytes, host_bytes, f"{style}-style schedule on {hardware.name}", minimum,
                hardware=hardware, prediction=predict(program, captured, hardware))
