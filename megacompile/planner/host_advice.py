"""What to change when the host state does not fit: the disk budget that would hold it, and what
LoRA on a frozen base would need instead, in numbers a user can pass back (HostMemoryError's text):
a 24 GB card in a 32 GB desktop asked for a full fine-tune of Qwen2.5-7B is told the --nvme-budget
that holds the moments and masters, and that LoRA holds its base in 14.2 GiB of bf16.
"""
from __future__ import annotations

import math

import torch

from ..cost.host_memory import HostCost
from ..ir.printer import fmt_bytes, fmt_need

GiB = 2**30


def _gib_up(n: int) -> int:
    return max(1, math.ceil(n / GiB))


def disk_advice(costs: list[HostCost], host_budget: int, nvme_budget: int | None, updates: str = "at_commit") -> str:
    """The disk budget that holds the state with the rest in `host_budget` (the first placement that
    spills least), or that no disk budget does. Updates started as gradients land take no disk tier:
    the advice then names updates at commit beside it."""
    advice = _disk_advice(costs, host_budget, nvme_budget)
    if advice and updates == "as_gradients_land":
        advice += (" (with updates='at_commit', --updates at_commit: the disk tier reads each owner's state ahead "
                   "in the order the updates start at commit)")
    return advice


def _disk_advice(costs: list[HostCost], host_budget: int, nvme_budget: int | None) -> str:
    fitting = next((c for c in costs if c.disk_bytes and c.ram_bytes <= host_budget), None)
    if fitting is None:
        if nvme_budget is None and any(c.disk_bytes for c in costs):
            least = costs[-1]
            return (f", or give a disk tier (compile(..., nvme_dir=PATH), --nvme-budget GiB) for the AdamW moments and "
                    f"masters, though even with both on disk {fmt_need(least.ram_bytes)} stays in RAM")
        return ""
    need = f"--nvme-budget {_gib_up(fitting.disk_bytes)}"
    if nvme_budget is None:
        return (f", or give a disk tier (compile(..., nvme_dir=PATH), --nvme-budget GiB) for the AdamW moments and "
                f"masters: {need} puts {fitting.placement.describe()}, {fmt_need(fitting.ram_bytes)} left in RAM")
    return (f", or a larger disk budget: {need} (of {fmt_bytes(nvme_budget)} given) puts "
            f"{fitting.placement.describe()}, {fmt_need(fitting.ram_bytes)} left in RAM")


def lora_base_bytes(captured, compute_dtype: torch.dtype) -> int | None:
    """For a full fine-tune: the RAM LoRA's frozen base would take, held in the compute dtype as a
    LoRA run holds it (train/methods/lora.py); None where the model has a frozen base already (LoRA,
    frozen layers): its state is what it is."""
    state = captured.state.values()
    if any(not e.trainable and not e.is_buffer for e in state):
        return None
    itemsize = torch.empty((), dtype=compute_dtype).element_size()
    return sum(e.numel * (e.dtype.itemsize if e.is_buffer else itemsize) for e in state)


def lora_advice(base: int | None, compute_dtype: torch.dtype, host_budget: int) -> str:
    """LoRA named beside the other changes, with what its base alone takes: the adapters' state
    and their offloaded activations come on top, so a base within the budget is no promise of a fit
    (`megacompile plan` plans LoRA whole in its `with LoRA` line)."""
    if base is None:
        return ""
    dtype = str(compute_dtype).replace("torch.", "")
    if base > host_budget:
        return (f"; LoRA adapters on the frozen base (--lora-rank R; a PEFT model in compile()) would not fit "
                f"either: the base alone in {dtype} takes {fmt_need(base)} of RAM")
    return (f", or train LoRA adapters on the frozen base (--lora-rank R; a PEFT model in compile()): the base "
            f"alone in {dtype} takes {fmt_need(base)} of RAM, leaving {fmt_bytes(host_budget - base)} of the host "
            "budget for the adapters' AdamW state and the offloaded activations")


def fitting_budgets(facts: dict, host_budget: float, nvme_budget: float | None) -> tuple[float, int | None] | None:
    """The host and disk budgets, in GiB as given, of the placement a refusal's advice leads to: the
    host budget given with the disk that fits beside it, else the smallest host that fits (with its
    disk); None where the refusal holds no placements."""
    placements = facts.get("host_placements")
    if not placements:
        return None
    def disk(p: dict) -> int | None:     # what the placement puts on disk, or the disk given where larger
        if not p["disk_bytes"]:
            return None
        return max(_gib_up(p["disk_bytes"]), math.ceil(nvme_budget) if nvme_budget else 0)
    fit = next((p for p in placements if p["disk_bytes"] and p["ram_bytes"] <= host_budget * GiB), None)
    if fit is not None:
        return host_budget, disk(fit)
    least = min(placements, key=lambda p: p["ram_bytes"])
    return math.ceil(least["ram_bytes"] / GiB * 100) / 100, disk(least)
