"""What sets the pace of a planned step, and what would shorten it (the summary's `bound by` line).

The predicted line gives the seconds waited on copies and on the host's AdamW updates; a user
deciding between more RAM, a larger budget, a faster disk or more tokens a step needs them read:
a step that waits on its updates gains nothing from a larger device budget, and shares the updates
among more tokens for free (they run once per optimizer step); a step that waits on the link gains
from a budget that keeps more on the device; a compute-bound step only from a faster card.
"""
from __future__ import annotations

from ..cost.host import ADAM_BYTES_PER_PARAM
from ..ir.printer import fmt_seconds

# A wait below this share of the step is noise beside the compute: the step is compute-bound.
WAIT_SHARE = 0.10
# Updates started as their gradients land run beside the backward, and what the compute thread then
# waits on is the link or nothing; a host busy this share of the step still sets its pace.
HOST_BUSY_SHARE = 0.90


def bound_line(plan) -> list[str]:
    """One line: what sets the pace (bound()) and what would change it."""
    found = bound(plan)
    return [] if found is None else [f"  bound by       {found[0]}; {found[1]}"]


def bound(plan) -> tuple[str, str] | None:
    """Compute, the host link or the host's updates (on the disk tier's disk, where it sets the
    pace), with the share of the step it takes; and the flags that change it. None without a
    prediction of a training step."""
    p = plan.prediction
    if p is None or not plan.captured.train or p.step_s <= 0:
        return None
    hw, step = plan.hardware, p.step_s
    updates, link = p.exposed_update_s, p.exposed_transfer_s
    waited = updates >= max(link, WAIT_SHARE * step)
    if waited or p.host_s >= HOST_BUSY_SHARE * step:
        disk = plan.host_cost is not None and plan.host_cost.disk_bytes and plan.disk_sets_pace
        rate = hw.host_adam_params_per_s
        pace = ("the disk tier's reads and writes (--nvme-bandwidth, or more --host-budget to keep the state in RAM)"
                if disk else f"the host AdamW's rate ({rate / 1e9:.3g}e9 parameters/s, moving "
                f"{rate * ADAM_BYTES_PER_PARAM / 1e9:.3g} GB/s of its {ADAM_BYTES_PER_PARAM} B a parameter; --host "
                "and --host-cores, or `megacompile calibrate` on the machine measures its own)")
        more = ("" if plan.grad_accum > 1 else
                " (accumulated micro-batches: an fp32 sum and a landing buffer, 6 B/param more host RAM)")
        share = (f"{fmt_seconds(updates)} of the {fmt_seconds(step)} waits on them ({updates / step:.0%})" if waited
                 else f"busy {fmt_seconds(p.host_s)} of the {fmt_seconds(step)} ({p.host_s / step:.0%}), beside the "
                 "backward")
        return (f"the host's AdamW updates: {share}, paced by {pace}",
                "they run once per optimizer step whatever its tokens, so more sequences a step share them: --batch "
                f"while the device budget holds them, or --global-batch N{more}; a larger --hbm-budget does not "
                "shorten it")
    if link >= WAIT_SHARE * step:
        return (f"the host link: {fmt_seconds(link)} of the {fmt_seconds(step)} waits on copies ({link / step:.0%}; "
                f"{hw.h2d_bw / 1e9:.3g} GB/s each way)",
                "a larger --hbm-budget keeps more on the device, and more tokens a step (--batch, --seq) do more "
                "work for each weight sent")
    peak = hw.peak_flops(plan.captured.compute_dtype)
    return (f"compute: the card's kernels busy {p.compute_s / step:.0%} of the step, model FLOPs at "
            f"{p.tflops_6nd * 1e12 / peak:.0%} of its {peak / 1e12:.4g} TFLOPS peak",
            "the link and the host's updates hide behind it")
