"""The device arena: the offset solver on hand-made lifetimes, the verifier's overlap check, and the
arena of a captured small Llama's schedules against the memory simulator's curve."""
from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import megacompile
from megacompile.capture import capture
from megacompile.cost import get_profile
from megacompile.errors import PlanVerificationError
from megacompile import native
from megacompile.ir import arena as arena_module
from megacompile.ir.arena import (ALIGNMENT, ArenaTensor, DeviceArena, aligned, greedy_by_size, place, place_numpy,
                                  plan_offsets)
from megacompile.ir.printer import fmt_bytes, format_program
from megacompile.ir.program import COMPUTE_OPS, Op
from megacompile.ir.simulate import simulate
from megacompile.ir.verify import verify, verify_arena
from megacompile.passes import ScheduleChoice, StepKind, build_schedule
from megacompile.planner.request import PlanRequest
from megacompile.planner.search import make_plan
from tests import models

GiB = 2 ** 30


def _busiest(sizes, firsts, lasts, alignment=ALIGNMENT) -> int:
    """The most aligned bytes live at one step: no layout is smaller."""
    steps = max(lasts, default=-1) + 1
    return max((sum(aligned(s, alignment) for s, f, l in zip(sizes, firsts, lasts) if f <= t <= l)
                for t in range(steps)), default=0)


def _overlaps(offsets, sizes, firsts, lasts) -> list[tuple[int, int]]:
    """Every pair live at one step whose bytes meet, by brute force."""
    n = len(sizes)
    return [(i, j) for i in range(n) for j in range(i + 1, n)
            if sizes[i] and sizes[j] and firsts[i] <= lasts[j] and firsts[j] <= lasts[i]
            and offsets[i] < offsets[j] + sizes[j] and offsets[j] < offsets[i] + sizes[i]]


def test_greedy_by_size_is_optimal_on_a_simple_case():
    # A [0,1] and C [2,4] never meet: they share offset 0; B [1,3] meets both and goes above them.
    sizes, firsts, lasts = [100, 60, 100], [0, 1, 2], [1, 3, 4]
    assert greedy_by_size(sizes, firsts, lasts, alignment=1) == [0, 100, 0]
    assert plan_offsets(sizes, firsts, lasts, alignment=1) == [0, 100, 0]   # 160 B: the busiest step's bytes
    # Aligned to 512 B each tensor takes 512: the arena is two of them, every offset aligned.
    offsets = plan_offsets(sizes, firsts, lasts)
    assert offsets == [0, 512, 0] and max(o + aligned(s) for o, s in zip(offsets, sizes)) == 1024


def test_a_tensor_goes_into_the_tightest_gap_or_the_lowest():
    # Placed in this order, A and C (steps 0..1) leave two holes beside B and D (steps 0..3) once
    # they end: 150 B under B and 60 B between B and D. E (steps 2..3, 50 B) fits either.
    sizes, firsts, lasts = [150, 100, 60, 100, 50], [0, 0, 0, 0, 2], [1, 3, 1, 3, 3]
    order = range(5)
    assert place(order, sizes, firsts, lasts, tightest=True) == [0, 150, 250, 310, 250]
    assert place(order, sizes, firsts, lasts, tightest=False) == [0, 150, 250, 310, 0]


@pytest.mark.parametrize("seed", range(40))
def test_no_two_tensors_live_at_once_overlap_on_random_lifetimes(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    steps = rng.randint(1, 30)
    firsts = [rng.randrange(steps) for _ in range(n)]
    lasts = [f + rng.randrange(steps - f) for f in firsts]
    sizes = [rng.choice([0, 1, 7, 100, 511, 512, 513, 4096, rng.randint(1, 50_000)]) for _ in range(n)]
    for alignment in (1, ALIGNMENT):
        offsets = plan_offsets(sizes, firsts, lasts, alignment)
        rounded = [aligned(s, alignment) for s in sizes]
        assert not _overlaps(offsets, rounded, firsts, lasts)
        assert all(o % alignment == 0 for o in offsets)
        size = max((o + s for o, s in zip(offsets, rounded)), default=0)
        assert _busiest(sizes, firsts, lasts, alignment) <= size <= sum(rounded)
        # The orders tried include greedy by size alone: the kept layout is never larger.
        by_size = greedy_by_size(sizes, firsts, lasts, alignment)
        assert size <= max((o + s for o, s in zip(by_size, rounded)), default=0)


def _step_like(rng: random.Random, n: int, steps: int):
    """Lifetimes shaped like a training step's: most tensors live a few steps (a block's working
    set), some for thousands (saved activations, forward to backward), a few for the whole step
    (resident weights), sizes from bytes to hundreds of MiB with many equal ones."""
    firsts, lasts, sizes = [], [], []
    for _ in range(n):
        kind = rng.random()
        f = rng.randrange(steps)
        life = (rng.randrange(1, 40) if kind < 0.8 else rng.randrange(40, 20_000) if kind < 0.97
                else steps)
        firsts.append(0 if life == steps else f)
        lasts.append(min(steps - 1, firsts[-1] + life - 1))
        sizes.append(rng.choice([ALIGNMENT, 4096, 1 << 20, 3 << 20, rng.randrange(1, 300 << 20)]))
    return sizes, firsts, lasts


def _native_or_skip():
    if arena_module._native() is None:
        pytest.skip("no C++ compiler on this machine: the arena is placed in NumPy")


@pytest.mark.parametrize("seed", range(6))
def test_the_cpp_placement_gives_numpy_s_offsets(seed):
    """Same offsets, tensor for tensor, for both gap rules and several orders, on lifetimes that
    cross the C++ placement's buckets and levels (1,024 steps and 8x that)."""
    _native_or_skip()
    rng = random.Random(seed)
    n, steps = rng.choice([(300, 60), (2000, 30_000), (3000, 200_000)])
    sizes, firsts, lasts = _step_like(rng, n, steps)
    rounded = [aligned(s) for s in sizes]
    orders = [sorted(range(n), key=lambda i: (-rounded[i], firsts[i], i)),
              sorted(range(n), key=lambda i: (firsts[i] - lasts[i], i)),
              rng.sample(range(n), n)]
    for order in orders:
        for tightest in (True, False):
            assert place(order, rounded, firsts, lasts, tightest) == place_numpy(order, rounded, firsts, lasts,
                                                                                 tightest)


def test_a_machine_without_a_compiler_places_in_numpy_alike(monkeypatch):
    """No compiler: a warning, once, and the same layout from NumPy's placement, run after run,
    as the C++ placement's runs on threads gave (enough tensors for threads)."""
    _native_or_skip()
    sizes, firsts, lasts = _step_like(random.Random(7), arena_module._THREADED_FROM + 500, 5000)
    expected = plan_offsets(sizes, firsts, lasts)
    monkeypatch.setattr(arena_module, "_library", None)
    monkeypatch.setattr(arena_module, "_library_tried", False)
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.warns(RuntimeWarning, match="C.. arena placement is unavailable.*no C.. compiler"):
        assert plan_offsets(sizes, firsts, lasts) == expected
    assert arena_module._native() is None    # tried once: no second warning
    monkeypatch.setenv("MEGACOMPILE_ARENA_PLACE", "numpy")
    monkeypatch.setattr(arena_module, "_library_tried", True)
    assert plan_offsets(sizes, firsts, lasts) == expected


def _arena(tensors: list[tuple[int, int, int, int]], size: int) -> DeviceArena:
    """(bytes, first, last, offset) each."""
    return DeviceArena(tuple(ArenaTensor(f"t{i}", 0, b, f, l, o) for i, (b, f, l, o) in enumerate(tensors)),
                       size, peak=0, node_steps=(0,), steps=1 + max(l for _, _, l, _ in tensors))


def test_the_verifier_finds_a_planted_overlap():
    fine = [(1000, 0, 5, 0), (512, 2, 3, 1024), (700, 6, 9, 0), (100, 4, 9, 1536)]
    verify_arena(_arena(fine, 2048))
    # t1 moved down onto t0 while both are live (steps 2..3)
    with pytest.raises(PlanVerificationError, match="t1 .* overlaps t0"):
        verify_arena(_arena([fine[0], (512, 2, 3, 512), *fine[2:]], 2048))
    # the same offsets one step apart in time share nothing
    verify_arena(_arena([(1000, 0, 1, 0), (1000, 2, 3, 0)], 1024))
    with pytest.raises(PlanVerificationError, match="overlaps"):
        verify_arena(_arena([(1000, 0, 2, 0), (1000, 2, 3, 0)], 1024))
    with pytest.raises(PlanVerificationError, match="does not hold"):
        verify_arena(_arena(fine, 1536))             # t3 ends at 1636
    with pytest.raises(PlanVerificationError, match="aligned"):
        verify_arena(_arena([(100, 0, 1, 100)], 1024))
    with pytest.raises(PlanVerificationError, match="exceeds the budget"):
        verify_arena(_arena(fine, 2048), budget_bytes=2047)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=64)
    ids = models.batch(96, 2, 16)
    captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    return model, ids, captured


def _live_per_node(arena: DeviceArena, nodes: int) -> list[int]:
    """The most bytes the arena's tensors hold at once during each schedule node."""
    change = np.zeros(arena.steps + 1, np.int64)
    for t in arena.tensors:
        change[t.first] += t.nbytes
        change[t.last + 1] -= t.nbytes
    live = np.cumsum(change)[:arena.steps]
    bounds = list(arena.node_steps) + [arena.steps]
    return [int(live[bounds[i]:bounds[i + 1]].max()) for i in range(nodes)]


def test_the_arena_holds_the_simulated_curve_node_by_node(llama):
    """Every schedule shape: the arena's tensors live at each node add up to the simulator's bytes
    during it, op by op inside each stage graph; none overlap; the arena is the peak plus packing."""
    _, _, captured = llama
    blocks = frozenset(s for s, st in enumerate(captured.stages) if st.template.kind == "block")
    first = min(blocks)
    for choice in (ScheduleChoice(1), ScheduleChoice(0, blocks), ScheduleChoice(2, selective=blocks),
                   ScheduleChoice(1, blocks - {first}, offload=frozenset({first}), boundary=blocks - {first}),
                   ScheduleChoice(1, frozenset({first}), micro_batches=2), ScheduleChoice(1, blocks, extra_forwards=1)):
        program = build_schedule(captured, choice, arena=True)     # verified after every pass, arena included
        arena, curve = program.facts["arena"], simulate(program)
        assert _live_per_node(arena, len(program.nodes)) == curve.peak_during, choice
        assert arena.peak == curve.peak <= arena.size
        assert arena.fragmentation_share < 0.02, choice
        # Kernel outputs inside the stage graphs are in it, not only the schedule's values, and each
        # storage a compute node makes names the op of its graph that makes it.
        assert any(t.name not in {k for v in program.values.values() for k, _ in v.parts} for t in arena.tensors)
        assert all(t.op for t in arena.tensors if program.nodes[t.node].op in COMPUTE_OPS), choice


def test_each_graph_s_storages_give_its_transient_peak(llama):
    _, _, captured = llama
    for t in {id(st.template): st.template for st in captured.stages}.values():
        for graph, memory in ((t.forward, t.fwd_memory), (t.backward, t.bwd_memory)):
            change = np.zeros(len(graph.body) + 1, np.int64)
            for s in graph.storages():
                change[s.first] += s.nbytes
                change[(len(graph.body) - 1 if s.last is None else s.last) + 1] -= s.nbytes
            assert np.cumsum(change).max() == memory.transient_peak


def test_a_planted_overlap_in_a_compiled_schedule_fails_verification(llama):
    _, _, captured = llama
    program = build_schedule(captured, ScheduleChoice(1), arena=True)
    arena = program.facts["arena"]
    # Two tensors live at one step at different offsets: put the second onto the first.
    a, b = next((a, b) for a in arena.tensors for b in arena.tensors
                if a.offset != b.offset and a.first <= b.last and b.first <= a.last and a.nbytes and b.nbytes)
    moved = tuple(dataclasses.replace(t, offset=a.offset) if t is b else t for t in arena.tensors)
    with pytest.raises(PlanVerificationError, match="overlaps"):
        verify(program.copy(arena=dataclasses.replace(arena, tensors=moved)))


def test_a_plan_fits_when_its_arena_fits(llama):
    """On the simulated device (no reserve) the smallest budget is the smallest arena: planning there
    fits, one aligned block less is refused, naming it (blocks whole: no sequence chunks to try)."""
    _, _, captured = llama
    captured = dataclasses.replace(captured, rechunk=None)

    def plan_at(budget: int):
        return make_plan(captured, PlanRequest(budget, StepKind(), "cpu", get_profile("h100"), host_bytes=0))

    with pytest.raises(megacompile.BudgetTooSmallError, match="device arena") as refused:
        plan_at(0)
    smallest = refused.value.minimum_bytes
    plan = plan_at(smallest)
    arena = plan.arena
    assert plan.predicted_peak_bytes < arena.size == plan.budget_bytes == plan.minimum_budget_bytes and plan.fits
    assert arena.fragmentation_share < 0.02
    assert f"laid out in a {fmt_bytes(arena.size)} arena" in plan.summary()
    data = plan.to_json()
    assert data["device_arena_bytes"] == arena.size and data["arena_tensor_count"] == len(data["arena_tensors"])
    with pytest.raises(megacompile.BudgetTooSmallError) as refused:
        plan_at(smallest - ALIGNMENT)
    assert refused.value.minimum_bytes == smallest


def test_the_schedule_text_prints_the_arena_beside_the_peak(llama):
    _, _, captured = llama
    program = build_schedule(captured, ScheduleChoice(1), arena=True)
    line = next(x for x in format_program(program).splitlines() if x.startswith("# predicted device peak"))
    assert "device arena" in line and f"{len(program.facts['arena'].tensors)} tensors" in line
    assert not any(n.op is Op.FREE and not n.frees for n in program.nodes)


def test_an_op_writes_into_its_arena_tensor_through_the_out_form_its_schema_matches():
    from megacompile.ir.stage_ops import out_form
    aten = torch.ops.aten
    assert out_form(aten.mm.default) == (aten.mm.out, ("out",))
    assert out_form(aten.mul.Scalar) == (aten.mul.Scalar_out, ("out",))
    assert out_form(aten.silu_backward.default) == (aten.silu_backward.grad_input, ("grad_input",))
    assert out_form(aten.native_layer_norm.default) == (aten.native_layer_norm.out, ("out0", "out1", "out2"))
    # No overload with the same arguments (arange's out form takes no dtype: in_place_form makes it
    # instead), or one whose out is a list: these results are copied into their arena tensors.
    assert out_form(aten.arange.default) is None
    assert out_form(aten.split_with_sizes_copy.default) is None
    assert out_form(aten._scaled_dot_product_flash_attention_for_cpu.default) is None


def _run_each(graph, x) -> list:
    """Each call's value, running the graph's ops one by one on x."""
    env, out = {}, []
    for n in graph.nodes:
        if n.op == "placeholder":
            env[n.name] = x
        elif n.op == "call_function":
            args = torch.fx.node.map_arg(n.args, lambda a: env[a.name])
            env[n.name] = n.target(*args, **n.kwargs)
            out.append(env[n.name])
    return out


def test_a_factory_of_a_constant_or_a_cast_makes_its_result_in_its_arena_tensor_instead_of_running():
    """zeros, ones, full, their _like and new_ forms, scalar_tensor and arange fill the tensor the plan
    placed as the op makes its result (dtype, layout and values), a cast copies into it with the same rounding;
    the empties leave it; no copy in, no scratch."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from megacompile.ir.stage_ops import copied_result_bytes, in_place_form
    x = torch.randn(3, 5).t()                    # not contiguous: the _like forms keep its strides

    def factories(x):
        return (torch.zeros(4, 2, dtype=torch.int64), x.new_zeros(6), torch.zeros_like(x), torch.ones(2, 3),
                x.new_ones(2), torch.ones_like(x, dtype=torch.bfloat16), torch.full((2, 2), 7.5),
                x.new_full((3,), -2.0), torch.full_like(x, 3, dtype=torch.int32), torch.empty(5),
                torch.empty_like(x), x.new_empty(4), torch.scalar_tensor(4.25), torch.full((2,), True),
                (x * 1e3 + 0.3).to(torch.bfloat16), x.to(torch.int32), torch.arange(6),
                torch.arange(2, 9, dtype=torch.float32), torch.arange(0.5, 3.9, 0.5))
    graph = make_fx(factories, tracing_mode="fake")(x).graph
    made = factories(x)
    nodes = [n for n in graph.nodes if n.op == "call_function" and "mul" not in str(n.target)
             and "add" not in str(n.target)]
    assert len(nodes) == len(made)
    values = {n.name: v for n, v in zip([n for n in graph.nodes if n.op == "call_function"],
                                         _run_each(graph, x))}
    for node, expected in zip(nodes, made):
        fill = in_place_form(node)
        assert fill is not None and copied_result_bytes(node) == 0, node.target
        meta = node.meta["val"]
        slot = torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype).fill_(9)
        before = slot.clone()
        args = tuple((x if a.op == "placeholder" else values[a.name]) if isinstance(a, torch.fx.Node) else a
                     for a in node.args)
        fill(slot, args, dict(node.kwargs))
        assert slot.dtype == expected.dtype and slot.shape == expected.shape and slot.stride() == expected.stride()
        if "empty" not in str(node.target):
            assert torch.equal(slot, expected), node.target
        else:
            assert torch.equal(slot, before)     # an empty is not written
    add = next(n for n in make_fx(lambda x: x + 1, tracing_mode="fake")(x).graph.nodes if n.op == "call_function")
    assert in_place_form(add) is None


def _moe():
    from tests import families
    torch.manual_seed(0)
    ids = families.batch(seed=0)
    return None, ids, capture(families.FAMILIES["qwen2_moe"](), (), {"input_ids": ids, "labels": ids},
                              device=torch.device("cpu"), compute_dtype=torch.float32)


@pytest.mark.parametrize("model", ["llama", "qwen2_moe"])
def test_the_runtime_places_each_result_at_its_planned_offset(llama, model):
    """A placed stage graph's results are the arena's bytes at the plan's offsets, whether the op
    wrote them in (out=), was a factory that filled them, or they were copied in; the copies are
    counted, one per op the plan holds scratch for (the MoE block's routing makes zeros)."""
    from megacompile.ir.stage_ops import copied_result_bytes, in_place_form
    from megacompile.runtime.arena import Arena
    from megacompile.runtime.cpu import CpuBackend
    from megacompile.runtime.placement import Copied, place_node
    _, _, captured = llama if model == "llama" else _moe()
    program = build_schedule(captured, ScheduleChoice(1), arena=True)
    arena_plan = program.facts["arena"]
    backend = CpuBackend(2 ** 30)
    arena = Arena(backend)
    arena.serve(arena_plan)
    stage = 1 if model == "llama" else 2            # the MoE's first block is dense
    node = next(i for i, n in enumerate(program.nodes) if n.op is Op.FORWARD and n.stage == stage)
    graph = captured.stages[stage].template.forward
    tensors = [t for t in arena_plan.tensors if t.node == node]
    copied = Copied()
    placement = place_node(arena, tensors, graph, copied)
    held = {}
    def like(meta):
        return (torch.randn(meta.shape, dtype=meta.dtype) if meta.dtype.is_floating_point
                else torch.zeros(meta.shape, dtype=meta.dtype))
    inputs = [like(p.meta["val"]) for p in graph.placeholders]
    graph.run(inputs, lambda n, v: held.setdefault(n.name, v), lambda n, v: None, placement.places)
    base = arena.buffer.data_ptr()
    placed = 0
    for t in tensors:
        value = held.get(t.op)
        if isinstance(value, torch.Tensor) and t.part == 0:
            assert value.untyped_storage().data_ptr() == base + t.offset, t
            placed += 1
    assert placed > 10 and copied.count > 0
    by_name = {n.name: n for n in graph.body}
    ops = {t.op for t in tensors if t.op}
    # The grouped matmuls write in on the host (kernels/outputs.py); the plan still holds scratch for
    # their results, which the GPU's CUTLASS op makes and the runtime copies in.
    assert copied.count == sum(copied_result_bytes(by_name[op]) > 0 and "grouped_mm" not in str(by_name[op].target)
                               for op in ops)
    if model == "qwen2_moe":
        assert any(in_place_form(by_name[op]) for op in ops)
    # The same graph without places allocates every result outside the arena.
    held.clear()
    graph.run(inputs, lambda n, v: held.setdefault(n.name, v), lambda n, v: None)
    assert not any(arena.holds(v) for v in held.values() if isinstance(v, torch.Tensor))
    backend.close()
