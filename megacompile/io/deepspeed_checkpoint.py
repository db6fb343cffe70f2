"""A DeepSpeed ZeRO checkpoint taken in: the fp32 masters, AdamW's moments and step counts.

A run of DeepSpeed ZeRO (1, 2 or 3, any number of ranks, with or without offload) leaves its true
state in its partitions (zero_layout.py): the fp32 masters, not the bf16 weights a Trainer may save
beside them, and both AdamW moments. Taken in here, by the names DeepSpeed saved them under, they
are this engine's masters and moments, and training goes on as DeepSpeed's would. Two folders hold
one: DeepSpeed's own save_checkpoint folder, and the checkpoint-N of transformers' Trainer (so
LlamaFactory's and TRL's) running DeepSpeed, whose trainer_state.json gives the steps.

Nothing is loaded unless everything fits: the saved trained parameters must be this model's trainable
ones, by name and shape, every one, and the ones its run froze (a LoRA run's base, a freeze run's
layers) the ones this model freezes. Only the trained ones are read: a frozen base is this model's
own (its `model` folder), as DeepSpeed's run had it. Weight decays, betas and eps as in trainer_checkpoint.py: refused when
strict, kept as this engine's with a note otherwise. The learning rate follows this engine's schedule
at the steps done; DeepSpeed's lr scheduler state, random states and data order are not replayed.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

from ..errors import WeightsFileError
from . import lora_adapter
from .adamw_settings import betas_and_eps, close, settled
from .source import MASTER, Item, PendingLoad
from .zero_layout import TABLES, Partitions

if TYPE_CHECKING:
    from ..state.training import TrainingState

TRAINER_STATE = "trainer_state.json"
_MEMORY = "<DeepSpeed partitions>"      # the items' source: tensors gathered as they are asked for


class _Gathered(Mapping):
    """`table/name` -> that table of the parameter `name`, gathered from the ranks when asked for."""

    def __init__(self, partitions: Partitions, saved_as: dict[str, str]):
        self.partitions, self.saved_as = partitions, saved_as

    def __getitem__(self, key: str):
        table, _, name = key.partition("/")
        return self.partitions.tensor(table, self.saved_as[name])

    def __iter__(self):
        return (f"{t}/{n}" for n in self.saved_as for t in TABLES)

    def __len__(self) -> int:
        return len(self.saved_as) * len(TABLES)


def read(state: "TrainingState", path: str, strict: bool = True,
         file_key: Callable[[str], str] | None = None) -> tuple[PendingLoad, dict, list[str], dict]:
    """(the load, the counters, notes, trainer_state.json or {global_step}) of the DeepSpeed
    checkpoint `path`, checked against the state: nothing changes here, nothing large is read."""
    partitions, saved_as, notes, steps, trainer_state = _checked(state, path, strict, file_key)
    missed = {}
    for name, saved in saved_as.items():
        taken = partitions.step(partitions.slots[saved].flat)
        if taken is None or taken < steps:
            missed[name] = steps - (taken or 0)
    items = [Item(_MEMORY, f"{table}/{name}", MASTER if table == "master" else table, name)
             for name in saved_as for table in TABLES]
    load = PendingLoad(items, own_buffers=True, needs=(MASTER, "exp_avg", "exp_avg_sq"),
                       describe=f"the DeepSpeed checkpoint {path}",
                       memory={_MEMORY: _Gathered(partitions, saved_as)})
    if any(not p.requires_grad for p in state.model.parameters()):
        load = lora_adapter.beside_the_base(state, load)     # the frozen base stays where it waits
    counters = {"steps_done": steps, "micro_batches": steps * state.grad_accum, "skipped_steps": 0,
                "missed_steps": missed}
    return load, counters, notes, trainer_state


def check(state: "TrainingState", path: str, file_key: Callable[[str], str] | None = None) -> None:
    """What read() refuses, refused before any engine exists (the state's model may be on meta)."""
    _checked(state, path, False, file_key)


def _checked(state: "TrainingState", path: str, strict: bool, file_key: Callable[[str], str] | None):
    partitions = Partitions(path)
    where = f"the DeepSpeed checkpoint {path}"
    canonical = _canonical(state, file_key)
    _check_frozen(state, partitions, where, canonical)
    if state.lr_ratios:
        raise WeightsFileError(f"cannot take in {where} into an AdamW with lr_ratios: DeepSpeed's param groups "
                               "are not read for ratios; nothing was loaded")
    shapes = state.layout()[0]
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    saved_as, problems = {}, []
    for saved, slot in partitions.slots.items():
        name = canonical.get(saved)
        if name is None or name not in shapes:
            problems.append(f"{saved} is no parameter of this model")
        elif tuple(shapes[name]) != slot.shape:
            problems.append(f"{saved} is {slot.shape}, this model's {name} is {tuple(shapes[name])}")
        else:
            saved_as[name] = saved
    absent = [n for n in trainable if n not in saved_as]
    if absent:
        problems.append(f"this model's {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''} "
                        f"({len(absent)}) are not in it")
    if problems:
        raise WeightsFileError(f"cannot take in {where}: its trained parameters are not this model's: "
                               f"{'; '.join(problems[:3])}; nothing was loaded")
    steps, trainer_state = _steps(partitions, path)
    for name, saved in saved_as.items():
        taken = partitions.step(partitions.slots[saved].flat)
        if taken is not None and not 0 <= taken <= steps:
            raise WeightsFileError(f"cannot take in {where}: {saved} took {taken} AdamW steps of the {steps} "
                                   "global steps; nothing was loaded")
    return partitions, saved_as, _settings(state, partitions, saved_as, where, strict), steps, trainer_state


def _canonical(state: "TrainingState", file_key: Callable[[str], str] | None) -> dict[str, str]:
    """A name in the checkpoint -> this model's parameter it is. DeepSpeed saves the names of the
    module it trained: this module's own where it is the same (a PEFT model included), file_key's
    where this one wraps it (a post-training objective's policy)."""
    if file_key is None:
        return state.canonical
    return {file_key(k): n for k, n in state.canonical.items()} | state.canonical


def _check_frozen(state: "TrainingState", partitions: Partitions, where: str, canonical: dict[str, str]) -> None:
    """The parameters the checkpoint's run froze (a LoRA run's base) must be the ones this model
    freezes, by name and shape, where the checkpoint records them (ZeRO 2 and 3 do)."""
    recorded = partitions.model_states.get("frozen_param_shapes")
    if recorded is None:
        return
    theirs = {canonical.get(n, n): tuple(shape) for n, shape in recorded.items()}
    ours = {n: tuple(p.shape) for n, p in state.model.named_parameters() if not p.requires_grad}
    if theirs != ours:
        differ = sorted(set(theirs) ^ set(ours)) or sorted(n for n in ours if theirs[n] != ours[n])
        raise WeightsFileError(f"cannot take in {where}: it froze {len(theirs)} parameters, this model freezes "
                               f"{len(ours)} ({', '.join(differ[:3])} differ): a LoRA run's checkpoint goes into a model "
                               "with the same adapters on the same base (run.yaml: finetuning_type lora with its "
                               "lora_rank and lora_target); nothing was loaded")


def _steps(partitions: Partitions, path: str) -> tuple[int, dict]:
    """The optimizer steps done: a Trainer's global_step where it left trainer_state.json, else
    DeepSpeed's global_steps; and trainer_state.json (or {global_step})."""
    trainer_state = {"global_step": partitions.model_states.get("global_steps")}
    file = os.path.join(path, TRAINER_STATE)
    if os.path.isfile(file):
        try:
            with open(file) as f:
                trainer_state = json.load(f)
        except (OSError, ValueError) as e:
            raise WeightsFileError(f"cannot read {file}: {e}") from e
    steps = trainer_state.get("global_step") if isinstance(trainer_state, dict) else None
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise WeightsFileError(f"{path}: its global step is {steps!r}, not a count of steps")
    return steps, trainer_state


def _settings(state: "TrainingState", partitions: Partitions, saved_as: dict[str, str], where: str,
              strict: bool) -> list[str]:
    """DeepSpeed's AdamW betas, eps and each parameter's weight decay against this engine's."""
    opt = state.optimizer
    differences = betas_and_eps(opt, partitions.param_groups[0])
    decays = []
    for name, saved in saved_as.items():
        theirs = partitions.weight_decay(partitions.slots[saved].flat)
        ours = 0.0 if name in state.no_decay else opt.weight_decay
        if not close([theirs], [ours]):
            decays.append(f"{name} {theirs} (this engine {ours})")
    if decays:
        differences.append(f"the weight decay of {len(decays)} parameters: {', '.join(decays[:3])} (the Trainer's "
                           "split is megacompile.hf_no_decay)")
    return settled(differences, where, strict)

