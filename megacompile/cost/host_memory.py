"""Where each owner's host state lives (RAM or the disk tier), and what that costs: one rule,
read by the planner to count and by the runtime's HostState to allocate.

Per trainable parameter, in RAM unless placed on disk:
    fp32 master 4 B | exp_avg 4 B | exp_avg_sq 4 B | compute copy (bf16: 2 B; fp32: 4 B, only when the
    master is on disk, else the master is the copy) | gradient.
The gradient needs no buffer of its own with one micro-batch per step: it lands in the owner's
compute copy, which the device does not read again until the update has overwritten it with the
new weights (the kernel reads each element's gradient before writing its new weight). A tied
owner (its gradients are summed in fp32), fp32 compute with the master in RAM, and accumulation
keep their own. With grad_accum > 1 that is the fp32 sum of the committed micro-batches (4 B) and
a landing buffer in the compute dtype (bf16: 2 B) for the running micro-batch's gradient, which
joins the sum only once its micro-batch commits (runtime/host.py).

The user's module: compile() on a model with real weights makes its fp32 parameters views of the
masters (with the masters on disk, of the fp32 compute copy), parameters in the compute dtype
views of the compute copy, and frozen weights and buffers views of the host state's copies
(runtime/host.py lend_to_module), so they cost nothing more. What cannot be shared stays the
module's own and is counted here: a trainable parameter in a dtype that neither the master nor
the compute copy has (a bf16 module trained in fp32 compute).

Tiers, in the order the planner spills them when host RAM is short: exp_avg + exp_avg_sq (8 B)
first (read and written once per step each), then the fp32 masters (4 B).
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass

from .ram_limit import cgroup_memory_limit, machine_ram

import torch

GiB = 2 ** 30
# Disk tier: pieces of 4M parameters (48 MiB with masters), 4 in flight (read ahead, being
# updated, written behind).
PIECE_NUMEL = 1 << 22
DEPTH = 4


def piece_numel() -> int:
    """Parameters per piece the disk tier streams: MEGACOMPILE_TIER_PIECE (a multiple of 1024)
    overrides the default, e.g. to stream a small model in several pieces."""
    value = os.environ.get("MEGACOMPILE_TIER_PIECE")
    return int(value) if value else PIECE_NUMEL


@dataclass(frozen=True)
class Placement:
    moments_on_disk: bool = False
    masters_on_disk: bool = False

    @property
    def kinds(self) -> tuple[str, ...]:
        """The per-owner buffers the disk tier holds, in file order."""
        return (("exp_avg", "exp_avg_sq") if self.moments_on_disk else ()) + (("master",) if self.masters_on_disk else ())

    @property
    def on_disk(self) -> bool:
        return self.moments_on_disk or self.masters_on_disk

    def describe(self) -> str:
        if self.masters_on_disk:
            return "exp_avg, exp_avg_sq and fp32 masters on disk"
        return "exp_avg and exp_avg_sq on disk" if self.moments_on_disk else "all in host RAM"


LEVELS = (Placement(), Placement(moments_on_disk=True), Placement(moments_on_disk=True, masters_on_disk=True))


@dataclass(frozen=True)
class OwnerLayout:
    """The buffers one owner has in RAM."""
    master: bool                 # fp32 master in RAM
    moments: bool                # exp_avg, exp_avg_sq in RAM
    compute_copy: bool           # a compute-dtype copy apart from the master
    grad_dtype: torch.dtype
    grad_in_copy: bool           # the gradient lands in the compute copy (no buffer of its own)
    landing: bool                # a second gradient buffer (grad_accum > 1)
    landing_dtype: torch.dtype = torch.float32


def owner_layout(compute_dtype: torch.dtype, grad_accum: int, summed: bool, placement: Placement) -> OwnerLayout:
    copy = compute_dtype != torch.float32 or placement.masters_on_disk
    own_grad = grad_accum > 1 or summed
    return OwnerLayout(master=not placement.masters_on_disk, moments=not placement.moments_on_disk,
                       compute_copy=copy, grad_dtype=torch.float32 if own_grad else compute_dtype,
                       grad_in_copy=copy and not own_grad, landing=grad_accum > 1,
                       landing_dtype=torch.float32 if summed else compute_dtype)


def owner_ram_bytes(numel: int, layout: OwnerLayout, compute_dtype: torch.dtype) -> int:
    per = 4 * layout.master + 8 * layout.moments + compute_dtype.itemsize * layout.compute_copy
    per += 0 if layout.grad_in_copy else layout.grad_dtype.itemsize
    per += layout.landing_dtype.itemsize * layout.landing
    return numel * per


def pool_bytes(largest_owner: int, placement: Placement) -> int:
    """RAM of the disk tier's buffer pool: DEPTH pieces of every kind it holds."""
    if not placement.on_disk:
        return 0
    piece = -(-min(largest_owner, piece_numel()) * 4 // 4096) * 4096
    return DEPTH * piece * len(placement.kinds)


@dataclass(frozen=True)
class HostCost:
    """What one placement costs: RAM and disk bytes per tier, and disk traffic per optimizer step."""
    placement: Placement
    params: int                  # trainable parameters
    ram_bytes: int               # masters/moments/grads/copies in RAM, the tier's pool, frozen weights and buffers
    pool_bytes: int
    disk_bytes: int
    tiers: dict[str, tuple[str, int]]   # buffer -> ("ram" | "disk", bytes)
    frozen_bytes: int = 0        # frozen weights and buffers, in their own dtype
    module_bytes: int = 0        # the user's module's own weights the host state cannot share

    @property
    def disk_bytes_per_step(self) -> int:
        """Read once and written once per optimizer step: each of these counts both ways."""
        return self.disk_bytes

    @property
    def ram_bytes_per_param(self) -> float:
        return (self.ram_bytes - self.frozen_bytes) / max(self.params, 1)


def held_owners(captured, every_trainable: bool = True) -> dict[str, int]:
    """The owner of each trainable parameter the host state holds: the first stage that uses it;
    with `every_trainable`, a trainable parameter `captured` does not reach (a vision tower, when
    the first step has no image) goes to the prologue's owner, where a later program may reach it
    (runtime/host.py; with data parallelism the host holds what the program reaches)."""
    from ..capture.model_graph import owners
    owner_of, _ = owners(captured)
    if every_trainable:
        for name, entry in captured.state.items():
            if entry.trainable and not entry.is_buffer and name not in owner_of:
                owner_of[name] = 0
    return owner_of


def owner_sizes(captured, every_trainable: bool = True,
                borrowed: frozenset[str] = frozenset()) -> tuple[dict[int, int], set[int], int]:
    """Per owning stage its trainable parameters (held_owners); the owners whose gradients are
    summed in fp32 (a parameter used by several stages); bytes of frozen weights and buffers, less
    those `borrowed` from another engine (runtime/host.py)."""
    owner_of = held_owners(captured, every_trainable)
    sizes: dict[int, int] = {}
    for name, s in owner_of.items():
        sizes[s] = sizes.get(s, 0) + captured.state[name].numel
    uses: dict[str, int] = {}
    for stage in captured.stages:
        for name in stage.params:
            if name in owner_of:
                uses[name] = uses.get(name, 0) + 1
    summed = {owner_of[n] for n, k in uses.items() if k > 1}
    frozen = sum(e.numel * e.dtype.itemsize for n, e in captured.state.items() if n not in owner_of and n not in borrowed)
    return sizes, summed, frozen


def module_resident(model) -> frozenset[str]:
    """The names of the module's parameters and buffers that hold real host memory."""
    return frozenset(name for name, t in list(model.named_parameters()) + list(model.named_buffers())
                     if not t.is_meta and t.device.type == "cpu")


def module_bytes(captured, resident: frozenset[str], placement: Placement, compute_dtype: torch.dtype) -> int:
    """Host bytes the user's module keeps beside the host state under `placement`: of its tensors
    that hold real host memory (`resident`, by name), the trainable ones that neither the fp32
    master nor the compute copy can stand for (see the module docstring)."""
    copy = owner_layout(compute_dtype, 1, False, placement).compute_copy

    def shared(dtype: torch.dtype) -> bool:
        return (dtype == torch.float32 and not placement.masters_on_disk) or (copy and dtype == compute_dtype)
    return sum(e.numel * e.dtype.itemsize for name, e in captured.state.items()
               if name in resident and e.trainable and not e.is_buffer and not shared(e.dtype))


def host_costs(captured, compute_dtype: torch.dtype, grad_accum: int = 1,
               module_resident: frozenset[str] = frozenset(), borrowed: frozenset[str] = frozenset()) -> list[HostCost]:
    """The cost of each placement level, in spill order; `module_resident`: the names of the
    module's tensors that hold real host memory (none for a model on the meta device)."""
    sizes, summed, frozen = owner_sizes(captured, borrowed=borrowed)
    return [host_cost(sizes, summed, frozen, compute_dtype, grad_accum, p, module_bytes(captured, module_resident, p, compute_dtype))
            for p in LEVELS]


def host_cost(owner_numels: dict[int, int], summed: set[int], frozen_bytes: int, compute_dtype: torch.dtype,
              grad_accum: int, placement: Placement, module: int = 0) -> HostCost:
    """The bytes of one placement, owner by owner, as HostState would allocate them, and `module`
    bytes the user's module keeps."""
    ram = frozen_bytes + module
    tiers: dict[str, list] = {}

    def add(name: str, where: str, n: int) -> None:
        tiers.setdefault(name, [where, 0])[1] += n
    for owner, numel in owner_numels.items():
        layout = owner_layout(compute_dtype, grad_accum, owner in summed, placement)
        ram += owner_ram_bytes(numel, layout, compute_dtype)
        add("fp32 masters", "ram" if layout.master else "disk", 4 * numel)
        add("exp_avg+exp_avg_sq", "ram" if layout.moments else "disk", 8 * numel)
        if layout.compute_copy:
            add("compute copies", "ram", compute_dtype.itemsize * numel)
        if not layout.grad_in_copy:
            add("grads", "ram", (layout.grad_dtype.itemsize + layout.landing_dtype.itemsize * layout.landing) * numel)
    if module:
        add("the model's own weights", "ram", module)
    pool = pool_bytes(max(owner_numels.values(), default=0), placement)
    disk = sum(n for where, n in tiers.values() if where == "disk")
    return HostCost(placement, sum(owner_numels.values()), ram + pool, pool, disk,
                    {k: (w, n) for k, (w, n) in tiers.items()}, frozen_bytes, module)


def choose_placement(costs: list[HostCost], host_budget: int | None, nvme_budget: int | None) -> HostCost | None:
    """The first level (all RAM; moments on disk; masters too) whose RAM fits the host budget and
    whose disk bytes fit the disk budget; None when none does. Without a disk budget nothing goes
    to disk."""
    for cost in costs:
        if cost.disk_bytes and nvme_budget is None:
            continue
        if (host_budget is None or cost.ram_bytes <= host_budget) and cost.disk_bytes <= (nvme_budget or 0):
            return cost
    return None


def why_not(costs: list[HostCost], host_budget: int, nvme_budget: int | None) -> str:
    """Why no placement fits, in words: what each level needs against the budgets."""
    from ..ir.printer import fmt_need
    parts = []
    for c in costs:
        if c.disk_bytes and nvme_budget is None:
            parts.append(f"{c.placement.describe()}: {fmt_need(c.ram_bytes)} of RAM and {fmt_need(c.disk_bytes)} "
                         "of disk (no disk tier given: pass nvme_dir / --nvme-budget)")
        else:
            parts.append(f"{c.placement.describe()}: {fmt_need(c.ram_bytes)} of RAM "
                         f"({c.ram_bytes_per_param:.3g} B/param), {fmt_need(c.disk_bytes)} of disk")
    budgets = f"host budget {host_budget / GiB:.4g} GiB" + (
        f", disk budget {nvme_budget / GiB:.4g} GiB" if nvme_budget is not None else ", no disk tier")
    return f"{budgets}; " + "; ".join(parts)


def free_disk_bytes(folder: str) -> int:
    return shutil.disk_usage(folder).free


# Share of the RAM a run may fill when no host budget is given: the rest is the operating
# system's, the page cache's and the Python process's own.
HOST_SHARE = 0.9


def physical_ram() -> int:
    """Bytes of RAM this machine has."""
    return machine_ram()


def process_ram() -> tuple[int, int | None]:
    """(bytes of RAM this process may fill, the memory cgroup limit that sets it, or None where the
    machine's RAM does: ram_limit.py)."""
    ram, limit = physical_ram(), cgroup_memory_limit()
    return (limit, limit) if limit is not None and limit < ram else (ram, None)


def default_host_budget_bytes() -> int:
    """The host budget compile() and `megacompile plan` take when none is given: a share of the RAM
    this process may fill (a container's or a SLURM job's memory limit, where lower than the
    machine's RAM)."""
    return int(HOST_SHARE * process_ram()[0])


def save_transient(captured) -> tuple[int, str]:
    """(bytes, name) a checkpoint or an export holds beside the host state while it writes: io/
    writes tensor by tensor, each converted (a float32 master, a bf16 export copy) on its own, so
    at most the largest tensor in float32 (tests/e2e/test_io_memory.py measures it)."""
    name, entry = max(captured.state.items(), key=lambda kv: (kv[1].numel, kv[0]), default=("", None))
    return (entry.numel * 4, name) if entry is not None else (0, "")
