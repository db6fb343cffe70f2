"""engine.torch_optimizer.state_dict() and load_state_dict(): the host AdamW's moments and step
counts as torch.optim.AdamW's state_dict holds them, so torch's resume idiom

    torch.save({"model": engine.state_dict(), "optimizer": engine.torch_optimizer.state_dict()}, f)
    ...   # a new engine
    engine.load_state_dict(saved["model"]); engine.torch_optimizer.load_state_dict(saved["optimizer"])

goes on exactly where the run left off. The dict:

    {"state": {i: {"step": tensor(float32), "exp_avg": fp32, "exp_avg_sq": fp32}, ...},
     "param_groups": [{lr, betas, eps, weight_decay, ..., "params": [0, 1, ..., n - 1]}]}

i numbers model.parameters() (torch.optim.AdamW(model.parameters())'s numbering), frozen ones
included; as in torch, a parameter never stepped has no entry (zero moments), a frozen one never.
`step` is the parameter's own AdamW count; a load takes the largest as the engine's steps done (so
a schedule of the step goes on from there) and each parameter's shortfall as its missed steps.
One param group: AdamW no_decay and lr_ratios are compile()'s AdamW's, not the dict's.

Not in it (engine.save_checkpoint keeps them): random states, the counts of skipped steps, the
gradient sums of a step between its micro-batches (refused there). Refused, naming
save_checkpoint/load_checkpoint: data parallelism (each rank holds a share of the moments) and,
for state_dict(), moments on the disk tier (the dict would hold them all in RAM at once).
"""
from __future__ import annotations

import numbers
import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import CheckpointError
from . import unbuilt
from .source import Item, PendingLoad

if TYPE_CHECKING:
    from ..state import TrainingState

MOMENTS = ("exp_avg", "exp_avg_sq")
_MEMORY = "<engine.torch_optimizer.load_state_dict>"
_INSTEAD = "engine.save_checkpoint(path) / engine.load_checkpoint(path) keep the whole training state"


class TorchAdamWState:
    """What the LR handle serves its state_dict() and load_state_dict() from; holds its
    TrainingState weakly (the state holds the handle)."""

    def __init__(self, state: "TrainingState"):
        self._state = weakref.ref(state)

    def state_dict(self, group: dict) -> dict:
        state = self._live("state_dict")
        _refuse_moments_on_disk(state)
        refuse_mid_step(state, "engine.torch_optimizer.state_dict()")
        params, trainable = _numbered(state)
        steps = {name: state.adamw_step(name) for name in trainable}
        stepped = [(i, name) for i, name in enumerate(params) if steps.get(name, 0) > 0]
        if state.host is not None:
            state.wait_updates()
            read = {t: (lambda name, t=t: state.host.view(t, name).clone()) for t in MOMENTS}
        elif stepped:
            tables = unbuilt.tables(state)[0]
            read = {t: (lambda name, t=t: tables[t][name]().clone()) for t in MOMENTS}
        out = {i: {"step": torch.tensor(float(steps[name])), **{t: read[t](name) for t in MOMENTS}}
               for i, name in stepped}
        return {"state": out,
                "param_groups": [{**{k: v for k, v in group.items() if k != "params"},
                                  "params": list(range(len(params)))}]}

    def load_state_dict(self, saved: dict, check_group: Callable[[dict, str], dict]) -> dict:
        """Checks `saved` whole, then writes the moments and counters; returns the param group's
        values for the handle to take."""
        state = self._live("load_state_dict")
        where = "engine.torch_optimizer.load_state_dict"
        if not isinstance(saved, Mapping) or not {"state", "param_groups"} <= set(saved):
            raise CheckpointError(f"{where} takes a torch optimizer state_dict ('state' and 'param_groups'), got "
                                  f"{type(saved).__name__}" + (f" with keys {sorted(map(str, saved))[:5]}"
                                                               if isinstance(saved, Mapping) else ""))
        groups = saved["param_groups"]
        if not isinstance(groups, (list, tuple)) or len(groups) != 1 or not isinstance(groups[0], Mapping):
            n = len(groups) if isinstance(groups, (list, tuple)) else groups
            raise CheckpointError(
                f"{where}: the state_dict has {n} param groups; the host AdamW has one over every trainable "
                "parameter (weight decay 0 and lr multiples per parameter are compile()'s "
                "megacompile.AdamW(no_decay=..., lr_ratios=...)). Nothing was loaded")
        group = dict(groups[0])
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise CheckpointError(f"{where}: the state_dict is of an AdamW with {flag}=True, which the host "
                                      "AdamW does not run; nothing was loaded")
        settings = {k: v for k, v in group.items() if k != "params"}
        check_group(settings, f"{where}: param_groups[0]")
        params, trainable = _numbered(state)
        ids = group.get("params")
        if not isinstance(ids, (list, tuple)) or len(ids) != len(params):
            raise CheckpointError(
                f"{where}: param_groups[0]['params'] numbers {len(ids) if isinstance(ids, (list, tuple)) else ids!r} "
                f"parameters, the model has {len(params)} (model.parameters()): it is another model's, or an "
                "optimizer's over some of its parameters; nothing was loaded")
        position = {i: n for n, i in enumerate(ids)}
        entries = saved["state"] if isinstance(saved["state"], Mapping) else None
        if entries is None:
            raise CheckpointError(f"{where}: 'state' is a {type(saved['state']).__name__}, not a dict by parameter "
                                  "index; nothing was loaded")
        tensors, steps = {}, {}
        for i, entry in entries.items():
            if i not in position:
                raise CheckpointError(f"{where}: state {i!r} is no index of param_groups[0]['params']; "
                                      "nothing was loaded")
            name = params[position[i]]
            steps[name], moments = _checked_entry(entry, name, trainable, where)
            tensors.update(moments)
        total = max(steps.values(), default=0)
        for name, shape in trainable.items():
            for t in MOMENTS:
                tensors.setdefault(f"{t}/{name}", torch.zeros(shape))   # never stepped: AdamW starts from zero
        refuse_mid_step(state, where)
        items = [Item(_MEMORY, key, key.partition("/")[0], key.partition("/")[2]) for key in tensors]
        moments = PendingLoad(items, needs=MOMENTS, describe=f"{where}'s moments", memory={_MEMORY: tensors})
        missed = {name: total - steps.get(name, 0) for name in trainable if steps.get(name, 0) < total}
        state.moments_arrive(moments, {"steps_done": total, "micro_batches": total * state.grad_accum,
                                       "missed_steps": missed})
        return settings

    def _live(self, what: str) -> "TrainingState":
        state = self._state()
        if state is None:
            raise CheckpointError(f"engine.torch_optimizer.{what}: its engine is gone")
        state.refuse_partial(f"engine.torch_optimizer.{what}()")
        if state.data_parallel is not None:
            raise CheckpointError(f"engine.torch_optimizer.{what}() under data parallelism: each rank holds a share "
                                  f"of the AdamW moments; {_INSTEAD}, each rank its share")
        return state


def refuse_mid_step(state: "TrainingState", where: str) -> None:
    if state.micro_batches % state.grad_accum or state.waiting_micro_batches:
        raise CheckpointError(f"{where} between the micro-batches of a step: their gradient sums are in no "
                              f"optimizer state_dict; call it after the step's last micro-batch, or {_INSTEAD}")


def _refuse_moments_on_disk(state: "TrainingState") -> None:
    disk = state.host.disk if state.host is not None else None
    if disk is not None and any(disk.holds(t) for t in MOMENTS):
        raise CheckpointError("engine.torch_optimizer.state_dict(): the AdamW moments live on the disk tier "
                              f"(nvme_dir), and a dict would hold them all in RAM; {_INSTEAD}, streaming them")


def _numbered(state: "TrainingState") -> tuple[list[str], dict[str, tuple]]:
    """(model.parameters()' canonical names in order, the trainable ones' shapes)."""
    trainable = state.layout()[0]
    return [state.canonical.get(n, n) for n, _ in state.model.named_parameters()], trainable


def _checked_entry(entry, name: str, trainable: dict, where: str) -> tuple[int, dict[str, torch.Tensor]]:
    """(the parameter's step, its moments as float32 copies by table/name)."""
    if name not in trainable:
        raise CheckpointError(f"{where}: the state_dict holds AdamW state for {name}, which this engine does not "
                              "train (requires_grad False); nothing was loaded")
    if not isinstance(entry, Mapping) or set(entry) != {"step", *MOMENTS}:
        keys = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise CheckpointError(f"{where}: the state of {name} holds {keys}, not AdamW's step, exp_avg and "
                              "exp_avg_sq; nothing was loaded")
    step = entry["step"]
    step = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if not isinstance(step, numbers.Real) or isinstance(step, bool) or step != int(step) or step < 1:
        raise CheckpointError(f"{where}: the step of {name} is {entry['step']!r}, not a count >= 1; "
                              "nothing was loaded")
    out = {}
    for t in MOMENTS:
        value = entry[t]
        if (not isinstance(value, torch.Tensor) or value.is_meta or not value.is_floating_point()
                or tuple(value.shape) != tuple(trainable[name])):
            what = (f"shape {tuple(value.shape)}, dtype {value.dtype}" if isinstance(value, torch.Tensor)
                    else type(value).__name__)
            raise CheckpointError(f"{where}: {t} of {name} is {what}; the parameter is float of shape "
                                  f"{tuple(trainable[name])}; nothing was loaded")
        if not bool(torch.isfinite(value).all()):
            raise CheckpointError(f"{where}: {t} of {name} holds inf or NaN; nothing was loaded")
        out[f"{t}/{name}"] = value.detach().to("cpu", torch.float32, copy=True)
    return int(step), out
