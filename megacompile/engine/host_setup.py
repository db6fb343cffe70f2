"""The engine's host state, built once at its first capture: placed within the host budget (RAM,
then the disk tier), allocated, and filled with the weights.

Every plan of the engine shares it; the placement is chosen before anything is allocated, so too
little host RAM (and disk) fails here with the figures of each placement, not in the allocator.
"""
from __future__ import annotations

import torch

from ..capture import CapturedModel
from ..cost.host_memory import module_resident
from ..errors import HostMemoryError
from ..io import model_params
from ..planner.request import disk_room, host_accumulation
from ..planner.search import place_host_state
from ..runtime import HostState


def build_host_state(engine, captured: CapturedModel) -> None:
    """Place, allocate and fill the host state of `engine` (an Engine) for `captured`; sets its host_cost."""
    # Layer-major lands one gradient sum per step: no fp32 accumulator ('auto' keeps one).
    host_accum = host_accumulation(engine.grad_accum, engine.accumulation)
    room, shared = engine.device_share.host_room(engine, engine.host_budget_bytes)
    lent = frozen_lent(engine, captured)
    data_parallel = engine.data_parallel
    try:
        engine.host_cost = place_host_state(captured, engine.compute_dtype, host_accum, room,
                                            disk_room(engine.nvme_dir, engine.nvme_budget_bytes),
                                            ranks=None if data_parallel is None else data_parallel.shape,
                                            module_resident=module_resident(engine.model), borrowed=frozenset(lent),
                                            updates=engine.settings.updates)
    except HostMemoryError as e:
        if not shared:
            raise
        raise HostMemoryError(f"{e}{shared}", e.facts) from e
    host = (HostState if data_parallel is None else data_parallel.host_state)(
        captured, engine.compute_dtype, pin=engine.backend.name == "cuda",
        grad_accum=host_accum, placement=engine.host_cost.placement, nvme_dir=engine.nvme_dir,
        **({"borrowed": lent} if lent else {}))
    if host.disk is not None:
        host.disk.record_into(engine.backend.timeline)
    # Weights waiting in files (load_checkpoint or from_pretrained before the first trace)
    # stream in now, one tensor at a time; a failure leaves the engine without host state.
    state = engine.state
    state.host_built(host)
    # One copy of the weights: the module's become views of the masters (a rank's masters are
    # a share: under data parallelism the module keeps its own).
    if state.materialized and data_parallel is None:
        model_params.lend(state)


def frozen_lent(engine, captured: CapturedModel) -> dict[str, torch.Tensor]:
    """With share_frozen: the frozen weights and buffers of the engine `engine` shares the device
    with that this capture holds frozen too, by name, shape and dtype (runtime/host.py borrows them)."""
    owner = engine.device_owner
    if not engine.share_frozen or owner is None or owner.host is None:
        return {}
    state = captured.state
    return {n: t for n, t in owner.host.consts.items()
            if n in state and not state[n].trainable and tuple(t.shape) == tuple(state[n].shape)
            and t.dtype == state[n].dtype}
