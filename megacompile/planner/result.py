"""A compiled plan: the schedule, its memory curve, and what it costs in host memory and transfers.

`print(plan)` gives the summary (plan_summary.py) and the schedule line by line; `plan.dump(dir)`
writes the same text and a JSON form (plan_json.py); plan_blocks.py says what was decided for each
block and why. The measured device peak of the last run sits beside the predicted one.

A plan is frozen once solved: what planning adds afterwards makes a revised copy (Plan.revised),
and what running it measures lives beside it, in the engine's MeasuredRun (planner/measured.py).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from ..capture import CapturedModel
from ..cost import HardwareProfile, StepPrediction
from ..cost.host_memory import HostCost
from ..cost.reserve import DeviceReserve
from ..ir.arena import DeviceArena
from ..ir.printer import describe_value, format_program
from ..ir.program import Op, Program
from ..ir.simulate import MemoryCurve, simulate
from . import plan_blocks, plan_json, plan_summary
from .measured import MeasuredRun


@dataclass(frozen=True)
class Plan:
    program: Program
    captured: CapturedModel
    budget_bytes: int
    host_bytes: int
    backend: str
    minimum_budget_bytes: int
    hardware: HardwareProfile | None = None
    prediction: StepPrediction | None = None
    host_budget_bytes: int | None = None     # host RAM the plan may use; None: not limited
    reserve: DeviceReserve = field(default_factory=DeviceReserve)   # kept free for what the ledger cannot see
    host_cost: HostCost | None = None        # where the host state lives: RAM and disk bytes per tier
    grad_accum: int = 1                      # micro-batches per optimizer step (the disk tier's pace)
    # Planning without weights (from_config.plan): the smallest budget any plan of this model and
    # these shapes fits, searched on demand (search.lowest_budget).
    lowest_budget: Callable[[], int] | None = field(default=None, repr=False, compare=False)
    minimum_over_chunks: bool = False      # minimum_budget_bytes is the lowest over every chunk count too
    # Set where this plan is shown in place of one that did not fit: the budget the user gave.
    given_budget_bytes: int | None = None
    # Planned with images (from_config.plan, images_per_row): the vision tower's share (vision_share.py).
    vision: Any = None
    # Warnings about what was asked, not refusals (from_config.plan: a seq past the model's context).
    notes: tuple[str, ...] = ()
    # Planned for a named card (from_config.plan, or a measured profile's): its memory, which the
    # plan's device need must stay within too; None: not checked (an engine's plan, which its own
    # device holds to the budget; the simulated cpu device).
    card_bytes: int | None = None
    # What the engine running this copy of the plan measured (planner/measured.py; Plan.with_measured);
    # None for a plan no engine runs.
    measured: MeasuredRun | None = field(default=None, repr=False, compare=False)
    curve: MemoryCurve = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "curve", simulate(self.program))
        object.__setattr__(self, "_spans", None)     # predicted_spans(), computed once on demand
        object.__setattr__(self, "_diskless_s", None)     # step_s_without_disk, computed once on demand
        object.__setattr__(self, "_disk_need", None)      # disk_bandwidth_needed, likewise
        object.__setattr__(self, "_landing_s", None)      # step_s_updates_as_gradients_land, likewise

    def revised(self, **changes: Any) -> Plan:
        """This plan with `changes` to the fields planning settles after the solve (the budget given,
        the smallest budget, the vision share, the host placement, the measured record): the
        schedule is the same, so its curve is not simulated again, and predicted spans already
        computed are kept."""
        names = {f.name for f in fields(self) if f.init}
        unknown = sorted(set(changes) - names) + sorted({"program", "captured"} & set(changes))
        if unknown:
            raise TypeError(f"Plan.revised() cannot change {', '.join(unknown)}: make a new plan")
        twin = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(twin, name, value)
        return twin

    def with_measured(self, measured: MeasuredRun) -> Plan:
        """The copy of this plan an engine runs: its measured peak, measured_memory() and the
        measured curve of its picture read `measured`, which the engine writes after each run."""
        return self.revised(measured=measured)

    def predicted_spans(self) -> list[tuple[int, str, float, float]]:
        """The cost model's timeline of the step: (node, stream, start s, end s), cost/predict.py."""
        if self._spans is None:
            from ..cost.predict import predict
            spans: list = []
            disk = self.host_cost.disk_bytes / max(self.host_cost.params, 1) if self.host_cost is not None else 0.0
            predict(self.program, self.captured, self.hardware, disk, spans=spans)
            object.__setattr__(self, "_spans", spans)
        return self._spans

    # -- what a run measured (kept beside the plan: planner/measured.py) ----------------------
    def _measured(self, given: MeasuredRun | None) -> MeasuredRun | None:
        return given if given is not None else self.measured

    @property
    def measured_peak_bytes(self) -> int | None:
        """The device peak measured in the last run of this plan by the engine that runs it; None
        before a run (or for a plan no engine runs)."""
        return self.measured.peak_bytes if self.measured is not None else None

    @property
    def timeline(self):
        """The runtime's record of the last step of the engine that runs this plan
        (runtime/timeline.py); None for a plan no engine runs."""
        return self.measured.timeline if self.measured is not None else None

    def measured_memory(self, measured: MeasuredRun | None = None) -> list | None:
        """The last step's device bytes per node (runtime MemorySample: live after, peak during), or
        None when this plan has not run. `measured`: the record to read (default: the engine's, for
        the plan an engine runs)."""
        run = self._measured(measured)
        return run.memory(self.program) if run is not None else None

    def plot_memory(self, path: str, measured: MeasuredRun | None = None) -> None:
        """The memory picture as a PNG: device bytes over the schedule stacked by kind, the budget,
        the predicted curve and the measured one after a step; host RAM (and disk) below. Needs
        matplotlib (`pip install megacompile[plot]`). `measured` as measured_memory's."""
        from ..report.plot import plot_memory
        plot_memory(self, path, self.measured_memory(measured))

    # -- numbers -------------------------------------------------------------------------
    @property
    def predicted_peak_bytes(self) -> int:
        return self.curve.peak

    @property
    def h2d_bytes_per_step(self) -> int:
        inputs = sum(m.nbytes for m in self.captured.inputs)
        return inputs + sum(self.program.values[n.writes[0]].nbytes for n in self.program.nodes
                            if n.op is Op.PREFETCH)

    @property
    def weight_h2d_bytes_per_step(self) -> int:
        """Weights over the link in one step (one micro-batch): each stage's prefetches."""
        return sum(self.program.values[n.writes[0]].nbytes for n in self.program.nodes
                   if n.op is Op.PREFETCH and self.program.values[n.writes[0]].kind == "weights")

    @property
    def micro_batches_per_run(self) -> int:
        """Micro-batches one run of the program takes: 1, or grad_accum for layer-major accumulation."""
        return self.program.facts.get("micro_batches", 1)

    @property
    def weight_h2d_bytes_per_optimizer_step(self) -> int:
        """Weights over the link per optimizer step: one run's for layer-major accumulation,
        grad_accum runs' for micro-batch-major."""
        return self.weight_h2d_bytes_per_step * max(1, self.grad_accum // self.micro_batches_per_run)

    @property
    def d2h_bytes_per_step(self) -> int:
        return sum(self.program.values[n.reads[0]].nbytes for n in self.program.nodes
                   if n.op in (Op.OFFLOAD, Op.OUTPUT))

    @property
    def stash_bytes(self) -> int:
        """Host memory for offloaded saved activations and block inputs: all of them are there at the
        end of the forward."""
        return sum(self.program.values[n.reads[0]].nbytes for n in self.program.nodes
                   if n.op is Op.OFFLOAD and self.program.values[n.reads[0]].kind in ("saved", "activation"))

    @property
    def weight_bytes(self) -> int:
        """Device bytes of every parameter and buffer once, in the compute dtype."""
        return sum(e.numel * (self.captured.compute_dtype.itemsize if e.dtype.is_floating_point
                              else e.dtype.itemsize) for e in self.captured.state.values())

    @property
    def disk_bytes_per_step(self) -> int:
        """Bytes the disk tier reads per optimizer step; it writes as many."""
        return self.host_cost.disk_bytes_per_step if self.host_cost is not None else 0

    @property
    def step_s_updates_as_gradients_land(self) -> float | None:
        """The predicted step of this schedule with its host updates started as their gradients land
        (compile(..., updates="as_gradients_land")), for a plan made with updates at commit; None
        where that setting cannot run it (no updates, clipping, accumulation, a disk tier) or it
        already does."""
        kind = self.program.facts.get("step_kind")
        ops = {n.op for n in self.program.nodes}
        if (self.prediction is None or kind is None or kind.updates != "at_commit" or Op.OPTIMIZER_STEP not in ops
                or Op.CLIP_GRADS in ops or self.grad_accum != 1 or self.disk_bytes_per_step):
            return None
        if self._landing_s is None:
            from ..capture.model_graph import owners
            from ..cost.predict import predict
            from ..passes.optimizer import updates_moved_to_landing
            from .update_order import fastest_update_order
            moved = fastest_update_order(updates_moved_to_landing(self.program, owners(self.captured)[1]),
                                         self.captured, self.hardware)
            object.__setattr__(self, "_landing_s", predict(moved, self.captured, self.hardware).step_s)
        return self._landing_s

    @property
    def step_s_without_disk(self) -> float | None:
        """The predicted step (one run of the program) with an infinitely fast disk: what the step
        takes when the disk tier does not stall the updates. None without a prediction."""
        if self.prediction is None:
            return None
        if not self.disk_bytes_per_step:
            return self.prediction.step_s
        if self._diskless_s is None:
            from ..cost.predict import predict
            object.__setattr__(self, "_diskless_s", predict(self.program, self.captured, self.hardware).step_s)
        return self._diskless_s

    @property
    def disk_bandwidth_needed(self) -> float | None:
        """B/s of disk traffic (reads plus writes, counted as disk_bandwidth_given counts them) at
        which the disk tier stalls the optimizer step by at most 1% of its micro-batches' time
        without the disk (step_s_without_disk): the profile's disk scaled until the cost model says
        so, by bisection. One step's bytes over that whole time is only a floor: an update moves
        its stage's bytes between the stage's backward and the next step's need of its weights.
        None without a prediction."""
        if self.prediction is None:
            return None
        if not self.disk_bytes_per_step:
            return 0.0
        if self._disk_need is None:
            object.__setattr__(self, "_disk_need", self._bisect_disk_need())
        return self._disk_need

    def _bisect_disk_need(self) -> float:
        import dataclasses

        from ..cost.predict import predict
        hw, given = self.hardware, self.disk_bandwidth_given
        disk = self.host_cost.disk_bytes / max(self.host_cost.params, 1)
        without, runs = self.step_s_without_disk, self.runs_per_optimizer_step

        def hidden(scale: float) -> bool:
            faster = dataclasses.replace(hw, disk_read_bw=hw.disk_read_bw * scale,
                                         disk_write_bw=hw.disk_write_bw * scale)
            return predict(self.program, self.captured, faster, disk).step_s - without <= 0.01 * without * runs
        low = 2 * self.disk_bytes_per_step / (without * runs) / given      # the floor, as a scale of the disk
        if hidden(low):
            return low * given
        high = 2 * low
        for _ in range(64):     # a disk fast enough stalls nothing: AdamW alone paces the update then
            if hidden(high):
                break
            low, high = high, 2 * high
        while high - low > 1e-3 * high:
            mid = (low + high) / 2
            low, high = (low, mid) if hidden(mid) else (mid, high)
        return high * given

    @property
    def disk_floor(self) -> float:
        """One optimizer step's disk bytes over its micro-batches' time without the disk."""
        return 2 * self.disk_bytes_per_step / (self.step_s_without_disk * self.runs_per_optimizer_step)

    @property
    def runs_per_optimizer_step(self) -> float:
        return self.grad_accum / self.micro_batches_per_run

    @property
    def disk_sets_pace(self) -> bool | None:
        """The disk tier is slower than the step needs (disk_bandwidth_needed): the predicted step
        waits on it. None without a disk tier or a prediction."""
        need = self.disk_bandwidth_needed
        if need is None or not self.disk_bytes_per_step:
            return None
        return self.disk_bandwidth_given < need

    @property
    def disk_bandwidth_given(self) -> float | None:
        """B/s of disk traffic (reads plus writes) the hardware profile's disk gives, its reads and
        writes taking turns."""
        hw = self.hardware
        return None if hw is None else 2 / (1 / hw.disk_read_bw + 1 / hw.disk_write_bw)

    @property
    def host_bytes_per_param(self) -> float | None:
        """Host RAM of the state per trainable parameter (frozen weights and buffers aside)."""
        return self.host_cost.ram_bytes_per_param if self.host_cost is not None else None

    @property
    def arena(self) -> DeviceArena | None:
        """The step's device tensors at their planned offsets (passes/arena.py); None for a schedule
        built without the arena pass."""
        return self.program.facts.get("arena")

    @property
    def device_bytes_needed(self) -> int:
        """Device bytes the plan needs: the peak with the reserve kept free, or the arena beside the
        workspaces and op scratch, whichever is more (cost/reserve.py)."""
        r, arena = self.reserve, self.arena
        return max(self.predicted_peak_bytes + r.total,
                   0 if arena is None else arena.size + r.workspace_bytes + r.scratch_bytes)

    @property
    def fits_card(self) -> bool:
        """The device need is within the card's memory (card_bytes); True where no card is known."""
        return self.card_bytes is None or self.device_bytes_needed <= self.card_bytes

    @property
    def fits(self) -> bool:
        """The device need is within the budget, and within the card's memory where the plan knows
        its card: a budget above the card does not make a plan fit it."""
        return self.device_bytes_needed <= self.budget_bytes and self.fits_card

    @property
    def recomputed(self) -> list[str]:
        return [self.program.stage_names[n.stage] for n in self.program.nodes if n.op is Op.RECOMPUTE]

    def peak_breakdown(self, top: int = 6, described: bool = False) -> list[tuple[str, int]]:
        """What the device holds at the peak: the largest live values, and the running node's
        transient working set. `described`: each named for a reader, by the module it belongs to
        ("saved activations of model.layers.3 (saved4)") rather than by its name alone."""
        if described:
            places = [st.origin if st.template.kind == "block" else f"the {st.name}" for st in self.captured.stages]
            named = self.peak_breakdown(top)
            node = self.program.nodes[self.curve.peak_index]
            work = (f"working set of the {node.op.value} of {places[node.stage]}" if node.stage is not None
                    else f"working set of {node.op.value}")
            return [(f"{describe_value(v, places)} ({v})", b) for v, b in named[:-1]] + [(work, named[-1][1])]
        i = self.curve.peak_index
        live: dict[str, int] = {}
        for n in self.program.nodes[:i]:
            if n.op is Op.FREE:
                for v in n.frees:
                    live.pop(v, None)
            else:
                for v in n.writes:
                    live[v] = self.program.values[v].nbytes
        node = self.program.nodes[i]
        stage = self.program.stage_names[node.stage] if node.stage is not None else ""
        items = sorted(live.items(), key=lambda kv: -kv[1])[:top]
        return items + [(f"{node.op.value} {stage} working set", node.transient)]

    def blocks(self) -> list[dict]:
        """Per block, what the solver decided and why (planner/plan_blocks.py)."""
        return plan_blocks.blocks(self)


    def block_decisions(self) -> list[str]:
        """blocks() as text, grouped over runs of blocks with the same decision."""
        return plan_blocks.block_decisions(self)


    def recompute_why(self) -> list[dict]:
        """For each recomputed block: the device bytes it frees between its passes, the seconds it costs."""
        return plan_blocks.recompute_why(self)


    def to_json(self) -> dict:
        """The plan as JSON (planner/plan_json.py; docs/plan-format.md)."""
        return plan_json.to_json(self)


    def values_table(self) -> list[dict]:
        """Every value the schedule names: its kind, device bytes, and where it lives."""
        return plan_json.values_table(self)


    # -- text ----------------------------------------------------------------------------
    def summary(self, measured: MeasuredRun | None = None) -> str:
        """The plan in a few lines (planner/plan_summary.py). `measured`: the record whose peak it
        shows beside the predicted one (default: the engine's, for the plan an engine runs)."""
        return plan_summary.summary(self, measured)


    def format(self, full: bool = False) -> str:
        """The summary and the schedule; runs of blocks that do the same thing are folded unless `full`."""
        return format_program(self.program, header=[f"# {line}" for line in self.summary().splitlines()],
                              fold=not full)

    def __str__(self) -> str:
        return self.format()

    @property
    def fused(self) -> bool:
        return any("kernel" in n.meta for t in self.captured.templates
                   for prog in (t.forward, t.backward, t.inference) if prog is not None for n in prog.body)

    @property
    def attention(self) -> str | None:
        """The attention the plan's stages run: "kernel" (megacompile's fused kernel), "cudnn"
        (torch's cuDNN op, planner/attention_choice.py), "torch" (another ATen op), None if none."""
        targets = {n.meta.get("kernel") or str(n.target) for t in self.captured.templates
                   for prog in (t.forward, t.inference) if prog is not None for n in prog.gm.graph.nodes
                   if n.op == "call_function" and "attention" in (n.meta.get("kernel") or str(n.target))}
        if not targets:
            return None
        return "kernel" if "attention" in targets else "cudnn" if any("cudnn" in t for t in targets) else "torch"

    def dump(self, path: str) -> None:
        """Write `path`/plan.txt (the printed plan) and `path`/plan.json, and with fusion
        `path`/fusion.txt (which kernel covers which original nodes), atomically."""
        os.makedirs(path, exist_ok=True)
        files = [("plan.txt", str(self) + "\n"), ("plan.json", json.dumps(self.to_json(), indent=1))]
        if self.fused:
            from ..fusion import fusion_report
            files.append(("fusion.txt", fusion_report(self.captured) + "\n"))
        for name, text in files:
            tmp = os.path.join(path, f".{name}.tmp")
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, os.path.join(path, name))
