"""megacompile's row of the peers bench (bench/systems.py), with a stand-in engine: a refused budget's
engine is freed before the next one allocates, the host optimizer is timed over one update, and
the model handed to the engine holds no weights (they stream in from the weights folder)."""
import gc
import weakref
from dataclasses import replace

from megacompile.bench import systems
from megacompile.bench.budgets import GiB
from megacompile.bench.workload import Workload
from megacompile.errors import BudgetTooSmallError

TINY = Workload(shape="tiny", device="cpu", batch=2, seq=32, steps=2, warmup=1)


class RefusingEngine:
    """Refuses every budget below `minimum` GiB, as the planner does: the error is raised from a
    local, which ties the traceback's frames (and so the engine) into a reference cycle."""

    def __init__(self, gib: float, minimum: float):
        self.gib, self.minimum = gib, minimum
        self.host_state = bytearray(1 << 20)

    def prepare(self, **inputs):
        if self.gib < self.minimum:
            refused = BudgetTooSmallError(f"{self.gib} GiB is too small", int(self.minimum * GiB))
            raise refused
        return "plan"

    def close(self):
        pass


def test_a_refused_engine_is_freed_before_the_next_one_is_built(monkeypatch):
    engines, alive_when_built = [], []

    def compile_folder(model, path, gib, **kwargs):
        alive_when_built.append([e() is not None for e in engines])
        engine = RefusingEngine(gib, minimum=2.0)
        engines.append(weakref.ref(engine))
        return engine
    monkeypatch.setattr(systems, "compile_folder", compile_folder)
    gc.disable()        # only the bench's own collection may free it
    try:
        engine, plan, gib, raised = systems.engine_at(TINY, 1.0, "/weights", (None, None))
    finally:
        gc.enable()
    assert alive_when_built == [[], [False]]
    assert (plan, gib, raised) == ("plan", 2.0, True)


def test_the_engine_is_given_a_model_without_weights_and_streams_them_from_the_folder(monkeypatch):
    """At the Llama-2-7B shape the module's own fp32 weights were 25 GiB beside the masters."""
    given = []
    monkeypatch.setattr(systems, "compile_folder", lambda model, path, gib, **kwargs: given.append((model, path))
                        or RefusingEngine(gib, minimum=0.0))
    systems.engine_at(TINY, 1.0, "/weights/tiny-seed0", (None, None))
    [(model, path)] = given
    assert path == "/weights/tiny-seed0"
    assert all(p.is_meta for p in model.parameters())


class Timeline:
    def __init__(self):
        self.spans = []

    def clear(self):
        self.spans = []

    def on(self, stream):
        return [s for s in self.spans if s[0] == stream]


class Span(tuple):
    start = property(lambda s: s[1])
    end = property(lambda s: s[2])


class OverlappingEngine:
    """Each step returns with its host AdamW still running; the update lands (its span in the
    timeline) when the next step starts or at synchronize(), as the engine overlaps it."""

    def __init__(self, update_s: float):
        self.timeline, self.update_s, self.running = Timeline(), update_s, False

    def step(self, **inputs):
        self.synchronize()
        self.running = True

    def synchronize(self):
        if self.running:
            self.timeline.spans.append(Span(("host", 10.0, 10.0 + self.update_s)))
            self.running = False


def test_the_host_optimizer_is_timed_over_one_update():
    engine = OverlappingEngine(update_s=0.5)
    engine.step()           # the last timed step: its update still running
    assert systems.host_optimizer_s(engine, None, None) == 0.5


def test_fuse_as_asked_reaches_compile(monkeypatch):
    """`bench peers --no-fuse` (the runbook's fallback where the attention kernel fails on a GPU)
    plans and runs the row with torch's ops."""
    from megacompile.bench import peers
    given = []
    monkeypatch.setattr(systems, "compile_folder", lambda model, path, gib, **kwargs: given.append(kwargs["fuse"])
                        or RefusingEngine(gib, minimum=0.0))
    for flag, fuse in (("--no-fuse", False), ("--fuse", True), (None, None)):
        args = peers._arguments([flag] if flag else [])
        assert args.fuse is fuse
        systems.engine_at(TINY, 1.0, "/weights/tiny-seed0", (None, None), fuse=args.fuse)
    assert given == [False, True, None]


def test_the_engine_steps_at_the_workloads_rates(monkeypatch):
    """The same schedule as the peers': megacompile's AdamW takes it as a function of the 1-based step."""
    given = []
    monkeypatch.setattr(systems, "compile_folder", lambda model, path, gib, **kwargs: given.append(kwargs["optimizer"])
                        or RefusingEngine(gib, minimum=0.0))
    warm = replace(TINY, lr_warmup=4)
    systems.engine_at(warm, 1.0, "/weights", (None, None))
    systems.engine_at(TINY, 1.0, "/weights", (None, None))
    warmed, constant = given
    assert [warmed.lr_at(k) for k in (1, 2, 4, 9)] == [warm.lr / 4, warm.lr / 2, warm.lr, warm.lr]
    assert [constant.lr_at(k) for k in (1, 2)] == [TINY.lr, TINY.lr]


def test_the_row_measures_the_wait_on_the_host_updates_beside_its_prediction(tmp_path, monkeypatch):
    """A real run on the cpu: the last timed step's forward waits for the updates of the step before,
    and with every update slowed (MEGACOMPILE_INJECT_DELAYS: 0-50 ms each) it waits longer."""
    from megacompile.bench import weights
    folder = str(weights.write(TINY, tmp_path))
    plain = systems.run_megacompile(TINY, "resident", folder, host_threads=[2, 1])
    monkeypatch.setenv("MEGACOMPILE_INJECT_DELAYS", "1")
    slowed = systems.run_megacompile(TINY, "resident", folder)
    assert "predicted_exposed_update_s_datasheet" in plain
    assert plain["attention"] == "torch" and plain["updates_in_forward_order"] == 0     # unfused, at commit
    assert plain["step_s_host_threads_2"] > 0 and plain["step_s_host_threads_1"] > 0
    assert slowed["measured_wait_update_s"] > 0.03
    assert slowed["measured_wait_update_s"] > 3 * plain["measured_wait_update_s"]


def test_only_the_waits_on_masters_count_as_waits_on_updates():
    from types import SimpleNamespace as NS

    from megacompile.runtime.timeline import Span
    nodes = [NS(op=NS(value="wait"), reads=("masters0",)), NS(op=NS(value="wait"), reads=("w1",)),
             NS(op=NS(value="forward"), reads=("w1",))]
    values = {"masters0": NS(kind="host"), "w1": NS(kind="weights")}
    spans = [Span("compute", "wait prologue", 0.0, 0.25, node=0), Span("compute", "wait block.0", 0.3, 0.4, node=1),
             Span("compute", "forward block.0", 0.4, 0.9, node=2), Span("host", "adamw", 0.0, 0.2, node=None)]
    engine = NS(timeline=NS(on=lambda stream: [s for s in spans if s.stream == stream]))
    assert systems.update_wait_s(engine, NS(nodes=nodes, values=values)) == 0.25


class CountingEngine:
    """Records the host AdamW's thread count (optim/fused_adamw.py) each step runs its updates on."""

    def __init__(self, fail_at: int | None = None):
        from megacompile.optim import fused_adamw
        self.fused_adamw, self.fail_at, self.seen = fused_adamw, fail_at, []
        self.timeline = Timeline()

    def step(self, **inputs):
        self.seen.append(self.fused_adamw.get_num_threads())
        if len(self.seen) == self.fail_at:
            raise RuntimeError("a step failed")

    def synchronize(self):
        pass


def test_the_thread_sweep_steps_on_each_count_then_gives_the_kernel_its_default_back():
    """`bench peers --host-threads 14,8`: a few steps on each count after the timed steps, each
    count's time in the row, and the kernel back on the rank's cores after it, also when a step fails."""
    import pytest
    from megacompile.optim import fused_adamw
    default = fused_adamw.get_num_threads()
    engine = CountingEngine()
    from types import SimpleNamespace
    program = SimpleNamespace(nodes=[], values={})
    out = systems.host_thread_sweep(engine, program, TINY, [3, 1])
    steps = min(3, TINY.steps)
    assert engine.seen == [3] * steps + [1] * steps
    assert out["step_s_host_threads_3"] >= 0 and out["step_s_host_threads_1"] >= 0
    assert out["measured_wait_update_s_host_threads_1"] == 0
    assert fused_adamw.get_num_threads() == default
    with pytest.raises(RuntimeError, match="a step failed"):
        systems.host_thread_sweep(CountingEngine(fail_at=1), program, TINY, [5])
    assert fused_adamw.get_num_threads() == default


def test_the_sweep_is_asked_for_by_thread_counts_and_shown_under_the_table():
    import argparse

    import pytest
    from megacompile.bench import peers, table
    assert peers._arguments(["--host-threads", "14, 8"]).host_threads == [14, 8]
    assert peers._arguments([]).host_threads is None
    for wrong in ("0", "eight", ","):
        with pytest.raises(argparse.ArgumentTypeError, match="whole numbers >= 1"):
            peers._thread_counts(wrong)
    row = {"system": "megacompile", "setting": "budget 0.34", "ok": True, "losses": [1.0], "step_s": 1.43,
           "tokens_per_s": 1.0, "tflops_6nd": 1.0, "host_threads": 16, "measured_wait_update_s": 0.5,
           "step_s_host_threads_8": 1.25, "measured_wait_update_s_host_threads_8": 0.25,
           "step_s_host_threads_14": 1.0, "measured_wait_update_s_host_threads_14": 0.125}
    lines = table.thread_sweep(row)
    assert lines == ["16 host threads (the timed steps): 1.430 s/step, 0.500 s of it waiting on the updates",
                     "14 host threads: 1.000 s/step, 0.125 s of it waiting on the updates",
                     "8 host threads: 1.250 s/step, 0.250 s of it waiting on the updates"]
    described = {"shape": "llama-3b", "parameters": 3e9, "batch": 4, "seq": 2048, "steps": 1, "warmup": 1,
                 "compute_dtype": "torch.bfloat16", "lr": 1e-4}
    md = table.markdown([row], {}, described, "megacompile budget 0.34", 0.01)
    assert "- megacompile budget 0.34: 14 host threads: 1.000 s/step" in md
    assert table.thread_sweep({"step_s": 1.0}) == []
