"""A compiled plan: the schedule, its memory curve, and what it costs in host memory and transfers.

`print(plan)` gives the summary and the schedule line by line; `plan.dump(dir)` writes the same
text and a JSON form. The measured device peak of the last run sits beside the predicted one.

A plan is frozen once solved: what planning adds afterwards makes a revised copy (Plan.revised),
and what running it measures lives beside it, in the engine's MeasuredRun (planner/measured.py).
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, Callable

import torch

from ..capture import CapturedModel
from ..cost import HardwareProfile, StepPrediction
from ..cost.host_memory import HostCost, save_transient
from ..cost.reserve import DeviceReserve
from ..ir.arena import DeviceArena
from ..ir.printer import describe_value, fmt_bytes, fmt_rate, fmt_seconds, format_program
from ..ir.program import Op, Program, base_name
from ..ir.simulate import MemoryCurve, simulate
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
        without, runs = self.step_s_without_disk, self._runs_per_optimizer_step

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
    def _disk_floor(self) -> float:
        """One optimizer step's disk bytes over its micro-batches' time without the disk."""
        return 2 * self.disk_bytes_per_step / (self.step_s_without_disk * self._runs_per_optimizer_step)

    @property
    def _runs_per_optimizer_step(self) -> float:
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
        """Per block, what the solver decided and why: how its saved values are held between the
        passes ("keep", "offload" or "recompute"), whether it saves only the costly ones, the
        device bytes at stake and the seconds paid (with a hardware profile)."""
        if not self.captured.train:
            return []
        from ..cost import graph_cost
        from ..cost.predict import compute_seconds
        recomputed = {n.stage for n in self.program.nodes if n.op is Op.RECOMPUTE}
        offloaded = set(self.program.facts.get("offload", []))
        sent = set(self.program.facts.get("boundary_values", []))
        forwards = {n.stage: n for n in self.program.nodes if n.op is Op.FORWARD}
        template_of = self._block_template_index()
        records = []
        for s, stage in enumerate(self.captured.stages):
            t = stage.template
            if t.kind != "block":
                continue
            hold = "recompute" if s in recomputed else "offload" if s in offloaded else "keep"
            # Per micro-batch: a layer-major program names micro-batch m's values `<name>@m`.
            saved_bytes = self.program.values[next(w for w in forwards[s].writes if base_name(w) == f"saved{s}")].nbytes
            forward = forwards[s]
            input_bytes = sum(self.program.values[v].nbytes for v in forward.reads if base_name(v) in sent)
            r = {"stage": self.program.stage_names[s], "template": template_of[s], "hold": hold,
                 "saved_bytes": saved_bytes, "selective": t.full is not None, "input_to_host_bytes": input_bytes}
            if t.full is not None:
                r["selective_bytes_not_saved"] = t.full.saved_bytes - t.saved_bytes
            if self.hardware is not None:
                hw, dtype = self.hardware, self.captured.compute_dtype
                r["forward_s"] = compute_seconds(self.captured, forwards[s], hw)[0]   # what recompute pays
                if hold == "offload":
                    r["link_s_each_way"] = saved_bytes / hw.d2h_bw
                if t.full is not None:
                    r["selective_backward_s"] = (graph_cost(t.backward, hw, dtype).seconds
                                                 - graph_cost(t.full.backward, hw, dtype).seconds)
            records.append(r)
        return records

    def _block_template_index(self) -> dict[int, int]:
        """Per block stage, which of the distinct block templates it runs (0, 1, ..., in the order
        of their first block); a selective variant counts as the template it replaces."""
        index: dict[int, int] = {}
        order: dict[int, int] = {}
        for s, stage in enumerate(self.captured.stages):
            if stage.template.kind == "block":
                full = stage.template.full or stage.template
                index[s] = order.setdefault(id(full), len(order))
        return index

    def block_decisions(self) -> list[str]:
        """blocks() as text, grouped over runs of blocks with the same decision."""
        groups: list[list[dict]] = []
        for r in self.blocks():
            key = ("hold", "selective", "template", "saved_bytes", "input_to_host_bytes")
            if groups and all(groups[-1][-1][k] == r[k] for k in key):
                groups[-1].append(r)
            else:
                groups.append([r])
        lines = []
        several = len({r["template"] for g in groups for r in g}) > 1
        for g in groups:
            r = g[0]
            span = r["stage"] if len(g) == 1 else f"{r['stage']}..{g[-1]['stage']}"
            held = fmt_bytes(r["saved_bytes"])
            cost = f", costs {fmt_seconds(r['forward_s'])} of forward each" if "forward_s" in r else ""
            if r["hold"] == "recompute":
                line = f"recompute: frees {held} each between forward and backward{cost}"
            elif r["hold"] == "offload":
                link = (f", {fmt_seconds(r['link_s_each_way'])} over the link each way, beside compute"
                        if "link_s_each_way" in r else "")
                line = f"offload: {held} each waits in host memory between forward and backward{link}"
            else:
                line = f"keep: holds {held} each from forward to backward (recompute would save that{cost})"
            if r["selective"]:
                line += (f"; saves only matmul and attention outputs, {fmt_bytes(r['selective_bytes_not_saved'])} "
                         "less")
                if "selective_backward_s" in r:
                    line += f", for {fmt_seconds(r['selective_backward_s'])} of cheap ops redone in its backward"
            if r["input_to_host_bytes"]:
                line += f"; its input ({fmt_bytes(r['input_to_host_bytes'])}) waits in host memory too"
            if several:
                line = f"[template {r['template']}] {line}"
            lines.append(f"  {span:<14} {line}")
        return lines

    def recompute_why(self) -> list[dict]:
        """For each recomputed block: the device bytes it frees between its passes, the seconds it costs."""
        out = []
        for n in self.program.nodes:
            if n.op is Op.RECOMPUTE:
                seconds = None
                if self.hardware is not None:
                    from ..cost.predict import compute_seconds
                    seconds = compute_seconds(self.captured, n, self.hardware)[0]
                out.append({"stage": self.program.stage_names[n.stage],
                            "saved_bytes": self.program.values[n.writes[0]].nbytes, "seconds": seconds})
        return out

    def to_json(self) -> dict:
        choice = self.program.facts.get("choice")
        timing: dict[int, list] = {}     # per node, its predicted span on each stream it uses
        for i, stream, start, end in self.predicted_spans():
            timing.setdefault(i, []).append({"stream": stream, "start_s": start, "end_s": end})
        return {
            "mode": "train" if self.captured.train else "inference",
            "backend": self.backend,
            "compute_dtype": str(self.captured.compute_dtype).replace("torch.", ""),
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            **self.reserve.to_dict(),
            "device_peak_bytes": self.predicted_peak_bytes,
            **(self.arena.to_json() if self.arena is not None else {}),
            "measured_device_peak_bytes": self.measured_peak_bytes,
            "minimum_budget_bytes": self.minimum_budget_bytes,
            "host_bytes": self.host_bytes + self.stash_bytes,
            "host_state_bytes": self.host_bytes,
            "host_activation_bytes": self.stash_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "host_save_transient_bytes": self._save_transient()[0],
            **self._params_json(),
            **self._disk_json(),
            "h2d_bytes_per_step": self.h2d_bytes_per_step,
            "weight_h2d_bytes_per_step": self.weight_h2d_bytes_per_step,
            "weight_h2d_bytes_per_optimizer_step": self.weight_h2d_bytes_per_optimizer_step,
            "grad_accum": self.grad_accum,
            "accumulation": "layer-major" if self.micro_batches_per_run > 1 else "micro-batch-major",
            "d2h_bytes_per_step": self.d2h_bytes_per_step,
            "prefetch_depth": choice.prefetch_depth if choice else None,
            "recompute": self.recomputed,
            "recompute_why": self.recompute_why(),
            "offload": [self.program.stage_names[s] for s in self.program.facts.get("offload", [])],
            "selective": [self.program.stage_names[s] for s in sorted(choice.selective)] if choice else [],
            "boundary_offload": [self.program.stage_names[s] for s in self.program.facts.get("boundary", [])],
            "blocks": self.blocks(),
            "block_templates": len(set(self._block_template_index().values())),
            "sequence_chunks": max((t.chunks for t in self.captured.block_templates), default=1),
            "chunked_modules": sorted({m for t in self.captured.block_templates for m in t.chunked}),
            "template_notes": dict(self.captured.template_notes),
            **({"notes": list(self.notes)} if self.notes else {}),
            # Only where the plan needs more than its card has (the plans that fit keep their JSON).
            **({"card_bytes": self.card_bytes, "card_shortfall_bytes": self.device_bytes_needed - self.card_bytes}
               if not self.fits_card else {}),
            "vision": self.vision.to_json() if self.vision is not None else None,
            "hardware": self.hardware.name if self.hardware else None,
            **(self.prediction.to_dict() if self.prediction else {}),
            "passes": self.program.passes,
            "pass_seconds": self.program.facts.get("pass_seconds", {}),
            "trace_seconds": self.captured.trace_seconds,
            "stages": self.program.stage_names,
            "values": self.values_table(),
            "schedule": [
                {"op": n.op.value, "stage": None if n.stage is None else self.program.stage_names[n.stage],
                 "reads": list(n.reads), "writes": list(n.writes), "frees": list(n.frees),
                 "stream": n.stream, "origin": n.origin, "note": n.note, "transient_bytes": n.transient,
                 "device_bytes_during": self.curve.peak_during[i], "device_bytes_after": self.curve.live_after[i],
                 "predicted": timing.get(i, [])}
                for i, n in enumerate(self.program.nodes)],
        }

    def _params_json(self) -> dict:
        """Trainable and frozen parameters, and the host bytes of each tier (frozen weights apart)."""
        state = self.captured.state.values()
        out = {"trainable_params": sum(e.numel for e in state if e.trainable),
               "frozen_params": sum(e.numel for e in state if not e.trainable and not e.is_buffer)}
        if self.host_cost is not None:
            out["host_tiers"] = {k: {"where": w, "bytes": n} for k, (w, n) in self.host_cost.tiers.items()}
            out["host_frozen_bytes"] = self.host_cost.frozen_bytes
        return out

    def values_table(self) -> list[dict]:
        """Every value the schedule names: its kind, device bytes, and where it lives ("host": the fp32
        masters an update writes, no device bytes; "device" for the rest)."""
        return [{"name": v.name, "kind": v.kind, "bytes": v.nbytes, "home": "host" if v.kind == "host" else "device"}
                for v in self.program.values.values()]

    # -- text ----------------------------------------------------------------------------
    def summary(self, measured: MeasuredRun | None = None) -> str:
        """The plan in a few lines. `measured`: the record whose peak it shows beside the predicted
        one (default: the engine's, for the plan an engine runs)."""
        c = self.captured
        n_params = sum(e.numel for e in c.state.values() if e.trainable)
        active = c.active_params
        routed = (f" ({active:,} active per token; 6ND counts the {c.flop_params:,} of them outside the "
                  "embeddings, transfers all of them)" if active != n_params else "")
        frozen = self._params_json()["frozen_params"]
        routed += f", {frozen:,} frozen" if frozen else ""
        blocks = sum(1 for s in c.stages if s.template.kind == "block")
        n_templates = len(set(self._block_template_index().values()))
        shared = "share one template" if n_templates <= 1 else f"run {n_templates} templates"
        in_towers = {t: sum(1 for s in c.stages if s.template.kind == "block" and s.origin.startswith(t + "."))
                     for t in c.towers}
        towers = "".join(f" and {n} of {t}" for t, n in in_towers.items() if n)
        in_decoder = blocks - sum(1 for s in c.stages if s.template.kind == "block" and c.in_tower(s.origin))
        choice = self.program.facts.get("choice")
        run = self._measured(measured)
        peak = run.peak_bytes if run is not None else None
        measured_peak = "not run yet" if peak is None else f"{fmt_bytes(peak)} measured in the last run"
        lines = [
            f"megacompile plan ({'training step' if c.train else 'forward only'}, {self.backend} backend, "
            f"compute {str(c.compute_dtype).replace('torch.', '')}, fp32 masters)",
            f"  model          {n_params:,} trainable parameters{routed}, {len(c.stages)} stages "
            f"({in_decoder} blocks of {c.block_path or 'none'}{towers} {shared})",
            self._peak_line(measured_peak),
            self._smallest_line(),
            *self._reserve_line(),
            *self._card_line(),
            f"  host memory    {fmt_bytes(self.host_bytes + self.stash_bytes)}: {fmt_bytes(self.host_bytes)} of "
            + ("host state in RAM (tiers below)" if self.host_cost is not None else
               f"fp32 masters, exp_avg, exp_avg_sq, grads{', compute copies' if c.compute_dtype != torch.float32 else ''}, "
               "buffers") + (f"; {fmt_bytes(self.stash_bytes)} of offloaded activations" if self.stash_bytes else "")
            + (f" (host budget {fmt_bytes(self.host_budget_bytes)})" if self.host_budget_bytes is not None else ""),
            *self._save_line(),
            *self._host_lines(),
            f"  moved per step {fmt_bytes(self.h2d_bytes_per_step)} host->device, "
            f"{fmt_bytes(self.d2h_bytes_per_step)} device->host",
        ]
        lines += [f"  note           {note}" for note in self.notes]
        lines += [f"  own template   {note}" for note in c.template_notes.values()]
        lines += [f"  chunked        {t.chunks} sequence chunks in each block for {', '.join(t.chunked)} (the "
                  "token-wise parts; attention runs whole)" for t in c.block_templates[:1] if t.chunked]
        if choice is not None:
            names = self.recomputed
            listed = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])}, ... {names[-1]}"
            blocks = sum(1 for s in c.stages if s.template.kind == "block")
            resident = ", ".join(self.program.stage_names[s] for s in sorted(choice.resident)) or "none"
            lines.append(f"  schedule       prefetch depth {choice.prefetch_depth}; recompute "
                         f"{f'{len(names)} of {blocks} blocks ({listed})' if names else 'none'}; offload "
                         f"{len(self.program.facts.get('offload', []))} blocks' saved activations and "
                         f"{len(self.program.facts.get('boundary', []))} "
                         f"blocks' inputs; {len(choice.selective)} blocks save "
                         f"only matmul and attention outputs; resident for the step: {resident}")
        lines += self.block_decisions()
        lines += self.vision.lines() if self.vision is not None else []
        p = self.prediction
        if p is not None:
            lines.append(f"  predicted      {self._per_step(p.step_s)} on {self.hardware.name}: {p.tokens_per_s:,.0f} tok/s, "
                         f"{fmt_rate(p.tflops_6nd)} TFLOPS (6ND), {p.hardware_flops_per_model_flop:.3f} hardware FLOPs "
                         f"per model FLOP, {fmt_seconds(p.exposed_s)} waiting on transfers")
        return "\n".join(lines)

    def _per_step(self, step_s: float) -> str:
        """A run of the program's time, named for what it is: one micro-batch of grad_accum, or
        (layer-major) all of an optimizer step's."""
        runs = max(1, self.grad_accum // self.micro_batches_per_run)
        if self.grad_accum == 1:
            return f"{fmt_seconds(step_s)} per step"
        if runs == 1:
            return f"{fmt_seconds(step_s)} per optimizer step ({self.grad_accum} micro-batches)"
        return (f"{fmt_seconds(step_s * runs)} per optimizer step ({self.grad_accum} micro-batches of "
                f"{fmt_seconds(step_s)})")

    def _disk_json(self) -> dict:
        c = self.host_cost
        if c is None:
            return {}
        return {"host_placement": c.placement.describe(), "host_bytes_per_param": c.ram_bytes_per_param,
                "host_tiers": {k: {"where": w, "bytes": n} for k, (w, n) in c.tiers.items()},
                "disk_pool_bytes": c.pool_bytes, "disk_bytes": c.disk_bytes,
                "disk_read_bytes_per_step": self.disk_bytes_per_step, "disk_write_bytes_per_step": self.disk_bytes_per_step,
                "disk_bandwidth_needed": self.disk_bandwidth_needed,
                # With a disk tier only (the plans without one keep their JSON byte for byte).
                **({"disk_bandwidth_given": self.disk_bandwidth_given, "disk_sets_pace": self.disk_sets_pace,
                    "predicted_step_s_without_disk": self.step_s_without_disk} if c.disk_bytes else {})}

    def _save_transient(self) -> tuple[int, str]:
        """(bytes, what) a checkpoint or an export holds beside the host state while it writes. One
        tensor at a time in float32; but under data parallelism with another compute dtype an export
        first gathers every whole fp32 master on every rank (distributed/shard.py gather_masters)."""
        nbytes, name = save_transient(self.captured)
        what = f"one tensor at a time in float32, the largest {name}"
        ranks = getattr(self.host_cost, "ranks", 1)
        if ranks > 1 and self.captured.compute_dtype != torch.float32 and 4 * self.host_cost.params > nbytes:
            nbytes = 4 * self.host_cost.params
            what = f"an export gathers every fp32 master on each of the {ranks} ranks first; a checkpoint writes shares"
        return nbytes, what

    def _save_line(self) -> list[str]:
        """What a checkpoint or an export adds to the host state while it writes, between steps."""
        if not self.captured.train:
            return []
        nbytes, what = self._save_transient()
        line = f"  saving         a checkpoint or export holds at most {fmt_bytes(nbytes)} more while it writes ({what})"
        if self.host_budget_bytes is not None and self.host_bytes + nbytes > self.host_budget_bytes:
            line += (f": {fmt_bytes(self.host_bytes + nbytes - self.host_budget_bytes)} over the host budget beside "
                     "the host state; give more host RAM or put state on disk (--nvme-budget)")
        return [line]

    def _host_lines(self) -> list[str]:
        """Where the host state lives, per tier, and what the disk tier asks of the disk."""
        c = self.host_cost
        if c is None:
            return []
        def tier(where: str) -> str:
            return ", ".join(f"{k} {fmt_bytes(n)}" for k, (w, n) in c.tiers.items() if w == where)
        pool = f", disk tier pool {fmt_bytes(c.pool_bytes)}" if c.pool_bytes else ""
        lines = [f"  host tiers     {c.placement.describe()}: {c.ram_bytes_per_param:.3g} B/param in RAM; "
                 f"RAM: {tier('ram')}{pool}" + (f", frozen weights and buffers {fmt_bytes(c.frozen_bytes)}"
                                                if c.frozen_bytes else "")
                 + (f"; disk: {tier('disk')}" if c.disk_bytes else "")]
        if c.disk_bytes:
            need = self.disk_bandwidth_needed
            line = (f"  disk tier      {fmt_bytes(c.disk_bytes)} on disk; reads {fmt_bytes(self.disk_bytes_per_step)} and "
                    f"writes {fmt_bytes(self.disk_bytes_per_step)} per optimizer step")
            if need is not None:
                have, runs = self.disk_bandwidth_given, self._runs_per_optimizer_step
                spread = fmt_seconds(self.step_s_without_disk * runs)
                why = (f"over the {spread} the steps take with a disk that never stalls them"
                       if need <= 1.001 * self._disk_floor else
                       f"not the {self._disk_floor / 1e9:.3g} GB/s that would spread a step's bytes over the {spread} "
                       "its micro-batches take: an update reaches the disk only between its stage's backward and "
                       "the next step's forward of it")
                line += (f"; hidden at >= {need / 1e9:.3g} GB/s of disk traffic (reads + writes, {why}); the "
                         f"profile's disk gives {have / 1e9:.3g} GB/s")
                if self.disk_sets_pace:
                    line += (f": the disk tier sets the pace, stretching that to "
                             f"{fmt_seconds(self.prediction.step_s * runs)} (a faster disk, --nvme-bandwidth, or "
                             "more host RAM, --host-budget, shortens it)")
                else:
                    line += " (hidden)"
            lines.append(line)
        return lines

    def _card_line(self) -> list[str]:
        """The card's memory, where the plan needs more of it or was given a budget above it."""
        card, need = self.card_bytes, self.device_bytes_needed
        budget = self.given_budget_bytes if self.given_budget_bytes is not None else self.budget_bytes
        if card is None or (need <= card and budget <= card):
            return []
        line = f"  card           {fmt_bytes(card)} of memory on the {self.hardware.name}: "
        if need > card:
            return [line + f"the plan needs {fmt_bytes(need)} (its peak and reserve), {fmt_bytes(need - card)} more: "
                           "it does NOT fit the card; plan at a budget within the card"]
        return [line + f"the {fmt_bytes(budget)} budget is more than that; the plan needs {fmt_bytes(need)}, within "
                       "the card"]

    def _reserve_line(self) -> list[str]:
        r = self.reserve
        if not r.total:
            return []
        scratch = f"{fmt_bytes(r.scratch_bytes)} op scratch ({r.scratch_op}), " if r.scratch_bytes else ""
        return [f"  reserve        {fmt_bytes(r.total)} kept free of the budget for what the ledger cannot see: "
                f"{fmt_bytes(r.workspace_bytes)} workspaces, {scratch}{fmt_bytes(r.fragmentation_bytes)} "
                f"fragmentation ({self.hardware.fragmentation:.0%} of what the caching allocator still serves beside the "
                "arena: the workspaces and op scratch; HardwareProfile fields)"]

    def _smallest_line(self) -> str:
        how = "all blocks recomputed, their inputs in host memory where the host budget allows, no prefetch overlap"
        line = f"  smallest fit   {fmt_bytes(self.minimum_budget_bytes)}"
        if self.minimum_over_chunks:
            return f"{line}: the smallest budget any plan fits ({how}; the blocks whole or over sequence chunks)"
        if self.lowest_budget is None:
            return f"{line} ({how})"
        chunks = max((t.chunks for t in self.captured.block_templates), default=1)
        blocks = "the blocks whole" if chunks == 1 else f"the blocks over {chunks} sequence chunks"
        return (f"{line} with {blocks} ({how}); over more sequence chunks they may fit less: --smallest "
                "(plan(..., smallest=True)) finds the smallest budget any plan fits")

    def _peak_line(self, measured: str) -> str:
        peak = fmt_bytes(self.predicted_peak_bytes)
        arena = self.arena
        laid_out = ("" if arena is None else f", laid out in a {fmt_bytes(arena.size)} arena ("
                    f"{fmt_bytes(arena.fragmentation)} of packing, {arena.fragmentation_share:.2%})")
        given = self.given_budget_bytes
        if given is None:
            return (f"  device peak    {peak} predicted of {fmt_bytes(self.budget_bytes)} budget "
                    f"({100 * self.predicted_peak_bytes / self.budget_bytes:.1f}%){laid_out}; {measured}")
        need = self.minimum_budget_bytes
        return (f"  device peak    {peak} predicted{laid_out} + {fmt_bytes(self.reserve.total)} reserve: needs "
                f"{fmt_bytes(need)}, "
                f"{fmt_bytes(need - given)} more than the {fmt_bytes(given)} budget given (the plan shown is the one "
                f"at {fmt_bytes(need)}); {measured}")

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
