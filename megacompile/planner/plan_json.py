"""A plan as JSON (Plan.to_json; the fields are described in docs/plan-format.md)."""
from __future__ import annotations

import torch

from ..cost import host_memory
from . import plan_blocks


def to_json(plan) -> dict:
    choice = plan.program.facts.get("choice")
    timing: dict[int, list] = {}     # per node, its predicted span on each stream it uses
    for i, stream, start, end in plan.predicted_spans():
        timing.setdefault(i, []).append({"stream": stream, "start_s": start, "end_s": end})
    return {
        "mode": "train" if plan.captured.train else "inference",
        "backend": plan.backend,
        "compute_dtype": str(plan.captured.compute_dtype).replace("torch.", ""),
        "budget_bytes": plan.budget_bytes,
        "fits": plan.fits,
        **plan.reserve.to_dict(),
        "device_peak_bytes": plan.predicted_peak_bytes,
        **(plan.arena.to_json() if plan.arena is not None else {}),
        "measured_device_peak_bytes": plan.measured_peak_bytes,
        "minimum_budget_bytes": plan.minimum_budget_bytes,
        "host_bytes": plan.host_bytes + plan.stash_bytes,
        "host_state_bytes": plan.host_bytes,
        "host_activation_bytes": plan.stash_bytes,
        "host_budget_bytes": plan.host_budget_bytes,
        "host_save_transient_bytes": save_transient(plan)[0],
        **params_json(plan),
        **disk_json(plan),
        "h2d_bytes_per_step": plan.h2d_bytes_per_step,
        "weight_h2d_bytes_per_step": plan.weight_h2d_bytes_per_step,
        "weight_h2d_bytes_per_optimizer_step": plan.weight_h2d_bytes_per_optimizer_step,
        "grad_accum": plan.grad_accum,
        "accumulation": "layer-major" if plan.micro_batches_per_run > 1 else "micro-batch-major",
        "d2h_bytes_per_step": plan.d2h_bytes_per_step,
        "prefetch_depth": choice.prefetch_depth if choice else None,
        "recompute": plan.recomputed,
        "recompute_why": plan_blocks.recompute_why(plan),
        "offload": [plan.program.stage_names[s] for s in plan.program.facts.get("offload", [])],
        "selective": [plan.program.stage_names[s] for s in sorted(choice.selective)] if choice else [],
        "boundary_offload": [plan.program.stage_names[s] for s in plan.program.facts.get("boundary", [])],
        "blocks": plan_blocks.blocks(plan),
        "block_templates": len(set(plan_blocks.block_template_index(plan).values())),
        "sequence_chunks": max((t.chunks for t in plan.captured.block_templates), default=1),
        "chunked_modules": sorted({m for t in plan.captured.block_templates for m in t.chunked}),
        "template_notes": dict(plan.captured.template_notes),
        **({"notes": list(plan.notes)} if plan.notes else {}),
        # Only where the plan needs more than its card has (the plans that fit keep their JSON).
        **({"card_bytes": plan.card_bytes, "card_shortfall_bytes": plan.device_bytes_needed - plan.card_bytes}
           if not plan.fits_card else {}),
        "vision": plan.vision.to_json() if plan.vision is not None else None,
        "hardware": plan.hardware.name if plan.hardware else None,
        **(plan.prediction.to_dict() if plan.prediction else {}),
        **updates_json(plan),
        "passes": plan.program.passes,
        "pass_seconds": plan.program.facts.get("pass_seconds", {}),
        "trace_seconds": plan.captured.trace_seconds,
        "stages": plan.program.stage_names,
        "values": values_table(plan),
        "schedule": [
            {"op": n.op.value, "stage": None if n.stage is None else plan.program.stage_names[n.stage],
             "reads": list(n.reads), "writes": list(n.writes), "frees": list(n.frees),
             "stream": n.stream, "origin": n.origin, "note": n.note, "transient_bytes": n.transient,
             "device_bytes_during": plan.curve.peak_during[i], "device_bytes_after": plan.curve.live_after[i],
             "predicted": timing.get(i, [])}
            for i, n in enumerate(plan.program.nodes)],
    }


def updates_json(plan) -> dict:
    """When a training step's host updates start (compile()'s `updates`), and the step predicted with
    them started as gradients land where the plan starts them at commit and could."""
    kind = plan.program.facts.get("step_kind")
    if kind is None or not plan.captured.train or not kind.update:
        return {}
    out = {"updates": kind.updates}
    moved = plan.program.facts.get("updates_in_forward_order", 0)
    if moved:       # the last updates to land, moved to the end of the backward (planner/update_order.py)
        out["updates_in_forward_order"] = moved
        out["predicted_step_s_strictly_as_gradients_land"] = plan.program.facts["step_s_strictly_as_gradients_land"]
    if plan.step_s_updates_as_gradients_land is not None:
        out["predicted_step_s_updates_as_gradients_land"] = plan.step_s_updates_as_gradients_land
    return out


def params_json(plan) -> dict:
    """Trainable and frozen parameters, and the host bytes of each tier (frozen weights apart)."""
    state = plan.captured.state.values()
    out = {"trainable_params": sum(e.numel for e in state if e.trainable),
           "frozen_params": sum(e.numel for e in state if not e.trainable and not e.is_buffer)}
    if plan.host_cost is not None:
        out["host_tiers"] = {k: {"where": w, "bytes": n} for k, (w, n) in plan.host_cost.tiers.items()}
        out["host_frozen_bytes"] = plan.host_cost.frozen_bytes
    return out


def values_table(plan) -> list[dict]:
    """Every value the schedule names: its kind, device bytes, and where it lives ("host": the fp32
    masters an update writes, no device bytes; "device" for the rest)."""
    return [{"name": v.name, "kind": v.kind, "bytes": v.nbytes, "home": "host" if v.kind == "host" else "device"}
            for v in plan.program.values.values()]


def disk_json(plan) -> dict:
    c = plan.host_cost
    if c is None:
        return {}
    return {"host_placement": c.placement.describe(), "host_bytes_per_param": c.ram_bytes_per_param,
            "host_tiers": {k: {"where": w, "bytes": n} for k, (w, n) in c.tiers.items()},
            "disk_pool_bytes": c.pool_bytes, "disk_bytes": c.disk_bytes,
            "disk_read_bytes_per_step": plan.disk_bytes_per_step, "disk_write_bytes_per_step": plan.disk_bytes_per_step,
            "disk_bandwidth_needed": plan.disk_bandwidth_needed,
            # With a disk tier only (the plans without one keep their JSON byte for byte).
            **({"disk_bandwidth_given": plan.disk_bandwidth_given, "disk_sets_pace": plan.disk_sets_pace,
                "predicted_step_s_without_disk": plan.step_s_without_disk} if c.disk_bytes else {})}


def save_transient(plan) -> tuple[int, str]:
    """(bytes, what) a checkpoint or an export holds beside the host state while it writes. One
    tensor at a time in float32; but under data parallelism with another compute dtype an export
    first gathers every whole fp32 master on every rank (distributed/shard.py gather_masters)."""
    nbytes, name = host_memory.save_transient(plan.captured)
    what = f"one tensor at a time in float32, the largest {name}"
    ranks = getattr(plan.host_cost, "ranks", 1)
    if ranks > 1 and plan.captured.compute_dtype != torch.float32 and 4 * plan.host_cost.params > nbytes:
        nbytes = 4 * plan.host_cost.params
        what = f"an export gathers every fp32 master on each of the {ranks} ranks first; a checkpoint writes shares"
    return nbytes, what
