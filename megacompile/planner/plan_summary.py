"""A plan in a few lines of text (Plan.summary, the head of `print(plan)` and plan.txt): the model,
the device peak beside the budget and the card, the smallest fit, the host memory and its tiers,
the transfers, the schedule's choice, each block's decision and the predicted step."""
from __future__ import annotations

import torch

from ..cost.model_flops import frozen_flop_weights
from ..ir.program import Op
from ..ir.printer import fmt_bytes, fmt_need, fmt_rate, fmt_seconds
from . import plan_blocks, plan_json
from .measured import MeasuredRun
from .step_bound import bound_line


def summary(plan, measured: MeasuredRun | None = None) -> str:
    """The plan in a few lines. `measured`: the record whose peak it shows beside the predicted
    one (default: the engine's, for the plan an engine runs)."""
    c = plan.captured
    n_params = sum(e.numel for e in c.state.values() if e.trainable)
    active = c.active_params
    routed = (f" ({active:,} active per token; 6ND counts the {c.flop_params:,} of them outside the "
              "embeddings, transfers all of them)" if active != n_params else "")
    frozen = plan_json.params_json(plan)["frozen_params"]
    routed += f", {frozen:,} frozen" if frozen else ""
    blocks = sum(1 for s in c.stages if s.template.kind == "block")
    n_templates = len(set(plan_blocks.block_template_index(plan).values()))
    shared = "share one template" if n_templates <= 1 else f"run {n_templates} templates"
    in_towers = {t: sum(1 for s in c.stages if s.template.kind == "block" and s.origin.startswith(t + "."))
                 for t in c.towers}
    towers = "".join(f" and {n} of {t}" for t, n in in_towers.items() if n)
    in_decoder = blocks - sum(1 for s in c.stages if s.template.kind == "block" and c.in_tower(s.origin))
    choice = plan.program.facts.get("choice")
    run = measured if measured is not None else plan.measured
    peak = run.peak_bytes if run is not None else None
    measured_peak = "not run yet" if peak is None else f"{fmt_bytes(peak)} measured in the last run"
    lines = [
        f"megacompile plan ({'training step' if c.train else 'forward only'}, {plan.backend} backend, "
        f"compute {str(c.compute_dtype).replace('torch.', '')}, fp32 masters{kernels_note(plan)})",
        f"  model          {n_params:,} trainable parameters{routed}, {len(c.stages)} stages "
        f"({in_decoder} blocks of {c.block_path or 'none'}{towers} {shared})",
        peak_line(plan, measured_peak),
        smallest_line(plan),
        *reserve_line(plan),
        *card_line(plan),
        f"  host memory    {fmt_bytes(plan.host_bytes + plan.stash_bytes)}: {fmt_bytes(plan.host_bytes)} of "
        + ("host state in RAM (tiers below)" if plan.host_cost is not None else
           f"fp32 masters, exp_avg, exp_avg_sq, grads{', compute copies' if c.compute_dtype != torch.float32 else ''}, "
           "buffers") + (f"; {fmt_bytes(plan.stash_bytes)} of offloaded activations" if plan.stash_bytes else "")
        + (f" (host budget {fmt_bytes(plan.host_budget_bytes)})" if plan.host_budget_bytes is not None else ""),
        *save_line(plan),
        *host_lines(plan),
        f"  moved per step {fmt_bytes(plan.h2d_bytes_per_step)} host->device, "
        f"{fmt_bytes(plan.d2h_bytes_per_step)} device->host",
    ]
    lines += [f"  note           {note}" for note in plan.notes]
    lines += [f"  own template   {note}" for note in c.template_notes.values()]
    lines += [f"  chunked        {t.chunks} sequence chunks in each block for {', '.join(t.chunked)} (the "
              "token-wise parts; attention runs whole)" for t in c.block_templates[:1] if t.chunked]
    if choice is not None:
        names = plan.recomputed
        listed = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])}, ... {names[-1]}"
        blocks = sum(1 for s in c.stages if s.template.kind == "block")
        resident = ", ".join(plan.program.stage_names[s] for s in sorted(choice.resident)) or "none"
        lines.append(f"  schedule       prefetch depth {choice.prefetch_depth}; recompute "
                     f"{f'{len(names)} of {blocks} blocks ({listed})' if names else 'none'}; offload "
                     f"{len(plan.program.facts.get('offload', []))} blocks' saved activations and "
                     f"{len(plan.program.facts.get('boundary', []))} "
                     f"blocks' inputs; {len(choice.selective)} blocks save "
                     f"only matmul and attention outputs; resident for the step: {resident}")
    lines += plan_blocks.block_decisions(plan)
    lines += plan.vision.lines() if plan.vision is not None else []
    p = plan.prediction
    if p is not None:
        lines.append(f"  predicted      {per_step(plan, p.step_s)} on {plan.hardware.name}: {p.tokens_per_s:,.0f} tok/s, "
                     f"{fmt_rate(p.tflops_6nd)} TFLOPS ({flops_rule(c)}), "
                     f"{p.hardware_flops_per_model_flop:.3f} hardware FLOPs per model FLOP, {waiting(p)}")
        lines += bound_line(plan)
        lines += updates_line(plan)
    return "\n".join(lines)


def flops_rule(captured) -> str:
    """How the model FLOPs were counted (cost/model_flops.py): 6ND, and frozen weights' 4ND (behind a
    trained one: forward and the input's gradient) or 2ND (before every trained one)."""
    if not captured.train:
        return "2ND"
    behind, before = frozen_flop_weights(captured)
    return "6ND" + (" trained + 4ND frozen" if behind else "") + (" + 2ND frozen before them" if before else "")


def updates_line(plan) -> list[str]:
    """When the host updates start (compile()'s `updates`), and, for a plan at commit that would run
    at least 5% faster with them started as gradients land, that figure and how to ask for it."""
    kind = plan.program.facts.get("step_kind")
    if kind is None or not plan.captured.train or not kind.update:
        return []
    if kind.updates == "as_gradients_land":
        return ["  updates        as gradients land: each owner's host AdamW starts once its gradients are on the host "
                "and finite, beside the rest of the backward; a step that fails after its first update stops the "
                "engine until a checkpoint is loaded" + forward_order_note(plan)]
    step_s, other = plan.prediction.step_s, plan.step_s_updates_as_gradients_land
    if other is None or other > 0.95 * step_s:
        return []
    return [f"  updates        at commit (a step commits whole or not at all); started as their gradients land they "
            f"would take {per_step(plan, other)} ({other / step_s - 1:+.0%}): compile(..., "
            "updates='as_gradients_land') or --updates as_gradients_land (no clipping, one micro-batch per step, "
            "one process)"]


def kernels_note(plan) -> str:
    """The header's word on the kernels: fused ones, and where a fused plan's attention is cuDNN's
    (planner/attention_choice.py: the faster plan here) rather than the attention kernel."""
    if not plan.fused:
        return ""
    return ", fused kernels" + (" with cuDNN's attention" if plan.attention == "cudnn" else "")


def forward_order_note(plan) -> str:
    """The updates the planner moved to the end of the backward (planner/update_order.py), if any."""
    moved = plan.program.facts.get("updates_in_forward_order", 0)
    if not moved:
        return ""
    steps = [n for n in plan.program.nodes if n.op is Op.OPTIMIZER_STEP][-moved:]
    names = [plan.program.stage_names[n.stage] for n in steps]
    landing_s = plan.program.facts["step_s_strictly_as_gradients_land"]
    return (f"; the last {moved} to land ({_names(names)}) wait for the whole backward and run in the order the "
            f"next forward reads them ({fmt_seconds(plan.prediction.step_s)} a step, against "
            f"{fmt_seconds(landing_s)} taken strictly as they land)")


def _names(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{names[0]}, {names[1]}, ... {names[-1]}"


def waiting(p) -> str:
    """What the compute stream waits on: the copies, and the host's AdamW updates a prefetch of the
    next step needs (a step bound by those gains nothing from a larger budget, and takes more tokens
    a step at almost no cost)."""
    if p.exposed_update_s <= 0:
        return f"{fmt_seconds(p.exposed_s)} waiting on transfers"
    return (f"{fmt_seconds(p.exposed_s)} waiting: {fmt_seconds(p.exposed_transfer_s)} on transfers, "
            f"{fmt_seconds(p.exposed_update_s)} on the host's AdamW updates")


def per_step(plan, step_s: float) -> str:
    """A run of the program's time, named for what it is: one micro-batch of grad_accum, or
    (layer-major) all of an optimizer step's."""
    runs = max(1, plan.grad_accum // plan.micro_batches_per_run)
    if plan.grad_accum == 1:
        return f"{fmt_seconds(step_s)} per step"
    if runs == 1:
        return f"{fmt_seconds(step_s)} per optimizer step ({plan.grad_accum} micro-batches)"
    return (f"{fmt_seconds(step_s * runs)} per optimizer step ({plan.grad_accum} micro-batches of "
            f"{fmt_seconds(step_s)})")



def save_line(plan) -> list[str]:
    """What a checkpoint or an export adds to the host state while it writes, between steps."""
    if not plan.captured.train:
        return []
    nbytes, what = plan_json.save_transient(plan)
    line = f"  saving         a checkpoint or export holds at most {fmt_bytes(nbytes)} more while it writes ({what})"
    if plan.host_budget_bytes is not None and plan.host_bytes + nbytes > plan.host_budget_bytes:
        line += (f": {fmt_need(plan.host_bytes + nbytes - plan.host_budget_bytes)} over the host budget beside "
                 "the host state; give more host RAM or put state on disk (--nvme-budget)")
    return [line]


def host_lines(plan) -> list[str]:
    """Where the host state lives, per tier, and what the disk tier asks of the disk."""
    c = plan.host_cost
    if c is None:
        return []
    def tier(where: str) -> str:
        return ", ".join(f"{k} {fmt_bytes(n)}" for k, (w, n) in c.tiers.items() if w == where)
    pool = f", disk tier pool {fmt_bytes(c.pool_bytes)}" if c.pool_bytes else ""
    lines = [f"  host tiers     {c.placement.describe()}: {c.ram_bytes_per_param:.3g} B/param in RAM; "
             f"RAM: {tier('ram')}{pool}" + (f", frozen weights and buffers {fmt_bytes(c.frozen_bytes)}"
                                            f"{frozen_dtype(plan.captured)}" if c.frozen_bytes else "")
             + (f"; disk: {tier('disk')}" if c.disk_bytes else "")]
    if c.disk_bytes:
        need = plan.disk_bandwidth_needed
        line = (f"  disk tier      {fmt_bytes(c.disk_bytes)} on disk; reads {fmt_bytes(plan.disk_bytes_per_step)} and "
                f"writes {fmt_bytes(plan.disk_bytes_per_step)} per optimizer step")
        if need is not None:
            have, runs = plan.disk_bandwidth_given, plan.runs_per_optimizer_step
            spread = fmt_seconds(plan.step_s_without_disk * runs)
            why = (f"over the {spread} the steps take with a disk that never stalls them"
                   if need <= 1.001 * plan.disk_floor else
                   f"not the {plan.disk_floor / 1e9:.3g} GB/s that would spread a step's bytes over the {spread} "
                   "its micro-batches take: an update reaches the disk only between its stage's backward and "
                   "the next step's forward of it")
            line += (f"; hidden at >= {need / 1e9:.3g} GB/s of disk traffic (reads + writes, {why}); the "
                     f"profile's disk gives {have / 1e9:.3g} GB/s")
            if plan.disk_sets_pace:
                line += (f": the disk tier sets the pace, stretching that to "
                         f"{fmt_seconds(plan.prediction.step_s * runs)} (a faster disk, --nvme-bandwidth, or "
                         "more host RAM, --host-budget, shortens it)")
            else:
                line += " (hidden)"
        lines.append(line)
    return lines


def frozen_dtype(captured) -> str:
    """The dtype the frozen weights are held in on the host, which is theirs as the model holds them
    (a PEFT model loaded in float32 keeps a float32 base), and what those wider than the compute
    dtype would take loaded in it: the device reads them in the compute dtype either way."""
    frozen = [e for e in captured.state.values() if not e.trainable and not e.is_buffer]
    if not frozen:
        return ""
    compute = captured.compute_dtype
    names = ", ".join(sorted({str(e.dtype).replace("torch.", "") for e in frozen}))
    wide = [e for e in frozen if e.dtype.is_floating_point and e.dtype.itemsize > compute.itemsize]
    if not wide:
        return f" (the frozen weights in {names})"
    held = sum(e.numel * e.dtype.itemsize for e in wide)
    name = str(compute).replace("torch.", "")
    narrow = sum(e.numel for e in wide) * compute.itemsize
    return (f" (the frozen weights in {names}: {fmt_bytes(held)} of them wider than the {name} compute reads; loaded "
            f"in {name}, torch_dtype=torch.{name}, they take {fmt_bytes(narrow)})")


def card_line(plan) -> list[str]:
    """The card's memory, where the plan needs more of it or was given a budget above it."""
    card, need = plan.card_bytes, plan.device_bytes_needed
    budget = plan.given_budget_bytes if plan.given_budget_bytes is not None else plan.budget_bytes
    if card is None or (need <= card and budget <= card):
        return []
    line = f"  card           {fmt_bytes(card)} of memory on the {plan.hardware.name}: "
    if need > card:
        return [line + f"the plan needs {fmt_need(need)} (its peak and reserve), {fmt_need(need - card)} more: "
                       "it does NOT fit the card; plan at a budget within the card"]
    return [line + f"the {fmt_bytes(budget)} budget is more than that; the plan needs {fmt_need(need)}, within "
                   "the card"]


def reserve_line(plan) -> list[str]:
    r = plan.reserve
    if not r.total:
        return []
    scratch = f"{fmt_bytes(r.scratch_bytes)} op scratch ({r.scratch_op}), " if r.scratch_bytes else ""
    return [f"  reserve        {fmt_bytes(r.total)} kept free of the budget for what the ledger cannot see: "
            f"{fmt_bytes(r.workspace_bytes)} workspaces, {scratch}{fmt_bytes(r.fragmentation_bytes)} "
            f"fragmentation ({plan.hardware.fragmentation:.0%} of what the caching allocator still serves beside the "
            "arena: the workspaces and op scratch; HardwareProfile fields)"]


def smallest_line(plan) -> str:
    """The smallest budget that fits, rounded up so that the figure given back fits (fmt_need)."""
    how = "all blocks recomputed, their inputs in host memory where the host budget allows, no prefetch overlap"
    line = f"  smallest fit   {fmt_need(plan.minimum_budget_bytes)}"
    if plan.minimum_over_chunks:
        return f"{line}: the smallest budget any plan fits ({how}; the blocks whole or over sequence chunks)"
    if plan.lowest_budget is None:
        return f"{line} ({how})"
    chunks = max((t.chunks for t in plan.captured.block_templates), default=1)
    blocks = "the blocks whole" if chunks == 1 else f"the blocks over {chunks} sequence chunks"
    return (f"{line} with {blocks} ({how}); over more sequence chunks they may fit less: --smallest "
            "(plan(..., smallest=True)) finds the smallest budget any plan fits")


def peak_line(plan, measured: str) -> str:
    peak = fmt_bytes(plan.predicted_peak_bytes)
    arena = plan.arena
    laid_out = ("" if arena is None else f", laid out in a {fmt_bytes(arena.size)} arena ("
                f"{fmt_bytes(arena.fragmentation)} of packing, {arena.fragmentation_share:.2%})")
    given = plan.given_budget_bytes
    if given is None:
        return (f"  device peak    {peak} predicted of {fmt_bytes(plan.budget_bytes)} budget "
                f"({100 * plan.predicted_peak_bytes / plan.budget_bytes:.1f}%){laid_out}; {measured}")
    need = plan.minimum_budget_bytes
    return (f"  device peak    {peak} predicted{laid_out} + {fmt_bytes(plan.reserve.total)} reserve: needs "
            f"{fmt_need(need)}, "
            f"{fmt_need(need - given)} more than the {fmt_bytes(given)} budget given (the plan shown is the one "
            f"at {fmt_need(need)}); {measured}")
