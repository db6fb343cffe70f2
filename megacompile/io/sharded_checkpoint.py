"""A checkpoint whose optimizer state another trainer sharded, taken in: the fp32 masters, AdamW's
moments and step counts.

Three layouts are read, each by a source of its own that gathers one parameter's tensor at a time
from the shards (so a model's checkpoint is never held whole beside the host state):

    DeepSpeed ZeRO 1, 2 or 3 (zero_layout.py): global_stepN/ with every rank's partitions; the
        folder DeepSpeed's save_checkpoint wrote, or the checkpoint-N of transformers' Trainer
        (LlamaFactory's, TRL's) running DeepSpeed
    FSDP (dcp_layout.py): pytorch_model_fsdp_0/ and optimizer_0/, torch.distributed.checkpoint
        folders as Accelerate's FSDP saves them (SHARDED_STATE_DICT), or pytorch_model_fsdp.bin
        and optimizer.bin gathered whole (FULL_STATE_DICT); a Trainer's checkpoint-N
    torchtune (torchtune_layout.py): an epoch_N/ its Hugging Face checkpointer wrote and the
        recipe_state.pt of that save (its optimizer state under torchtune's names)

The masters come from the shards (fp32, truer than any bf16 weights saved beside them), so the run
goes on as the other trainer's did. Nothing is loaded unless everything fits: the saved trained
parameters must be this model's trainable ones, by name and shape, every one, and the ones its run
froze (a LoRA run's base, a freeze run's layers) the ones this model freezes. Only the trained ones
are read: a frozen base is this model's own (its `model` folder), as it was the other run's.
Weight decays, betas and eps as in trainer_checkpoint.py, and an Adam that is not AdamW (L2 decay,
no bias correction): refused when strict, kept as this engine's with a note otherwise. The learning rate follows this engine's schedule at the steps done
(trainer_state.json's global_step, else the save's own count); the other trainer's scheduler,
random states and data order are not replayed.

A source has: describe (the checkpoint, named), shapes (trained parameter -> shape, by the name it
was saved under), frozen (the same for the frozen ones, None where not recorded), global_steps,
param_groups (torch's or DeepSpeed's, for their settings), first_group (the first: betas, eps),
step(name), weight_decay(name) and tensor(table, name) for table in "master", "exp_avg",
"exp_avg_sq".
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

from ..errors import WeightsFileError
from . import lora_adapter
from .adamw_settings import betas_and_eps, close, not_adamw, settled
from .source import MASTER, Item, PendingLoad

if TYPE_CHECKING:
    from ..state.training import TrainingState

TABLES = ("master", "exp_avg", "exp_avg_sq")
TRAINER_STATE = "trainer_state.json"
_MEMORY = "<the shards>"      # the items' source: tensors gathered as they are asked for


class _Gathered(Mapping):
    """`table/name` -> that table of the parameter `name`, gathered from the shards when asked for."""

    def __init__(self, source: Any, saved_as: dict[str, str]):
        self.source, self.saved_as = source, saved_as

    def __getitem__(self, key: str):
        table, _, name = key.partition("/")
        return self.source.tensor(table, self.saved_as[name])

    def __iter__(self):
        return (f"{t}/{n}" for n in self.saved_as for t in TABLES)

    def __len__(self) -> int:
        return len(self.saved_as) * len(TABLES)


def read(state: "TrainingState", source: Any, path: str, strict: bool = True,
         file_key: Callable[[str], str] | None = None) -> tuple[PendingLoad, dict, list[str], dict]:
    """(the load, the counters, notes, trainer_state.json or {global_step}) of the checkpoint
    `path` whose shards `source` reads, checked against the state: nothing changes here, nothing
    large is read."""
    saved_as, notes, steps, trainer_state = _checked(state, source, path, strict, file_key)
    missed = {}
    for name, saved in saved_as.items():
        taken = source.step(saved)
        if taken is None or taken < steps:
            missed[name] = steps - (taken or 0)
    items = [Item(_MEMORY, f"{table}/{name}", MASTER if table == "master" else table, name)
             for name in saved_as for table in TABLES]
    load = PendingLoad(items, own_buffers=True, needs=(MASTER, "exp_avg", "exp_avg_sq"), describe=source.describe,
                       memory={_MEMORY: _Gathered(source, saved_as)})
    if any(not p.requires_grad for p in state.model.parameters()):
        load = lora_adapter.beside_the_base(state, load)     # the frozen base stays where it waits
    counters = {"steps_done": steps, "micro_batches": steps * state.grad_accum, "skipped_steps": 0,
                "missed_steps": missed}
    return load, counters, notes, trainer_state


def check(state: "TrainingState", source: Any, path: str, file_key: Callable[[str], str] | None = None) -> None:
    """What read() refuses, refused before any engine exists (the state's model may be on meta)."""
    _checked(state, source, path, False, file_key)


def _checked(state: "TrainingState", source: Any, path: str, strict: bool, file_key: Callable[[str], str] | None):
    where = source.describe
    if lora_adapter.holds_adapter(path):    # its adapter's config (a Trainer's or torchtune's): rank, alpha, targets
        lora_adapter.check_config(state.model, path)
    canonical = _canonical(state, file_key)
    _check_frozen(state, source, where, canonical)
    shapes = state.layout()[0]
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    saved_as, problems = {}, []
    for saved, shape in source.shapes.items():
        name = canonical.get(saved)
        if name is None or name not in shapes:
            problems.append(f"{saved} is no parameter of this model")
        elif tuple(shapes[name]) != tuple(shape):
            problems.append(f"{saved} is {tuple(shape)}, this model's {name} is {tuple(shapes[name])}")
        else:
            saved_as[name] = saved
    absent = [n for n in trainable if n not in saved_as]
    if absent:
        problems.append(f"this model's {', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''} "
                        f"({len(absent)}) are not in it")
    if problems:
        raise WeightsFileError(f"cannot take in {where}: its trained parameters are not this model's: "
                               f"{'; '.join(problems[:3])}; nothing was loaded")
    steps, trainer_state = _steps(source, path)
    for saved in saved_as.values():
        taken = source.step(saved)
        if taken is not None and not 0 <= taken <= steps:
            raise WeightsFileError(f"cannot take in {where}: {saved} took {taken} AdamW steps of the {steps} "
                                   "global steps; nothing was loaded")
    return saved_as, _settings(state, source, saved_as, where, strict), steps, trainer_state


def _canonical(state: "TrainingState", file_key: Callable[[str], str] | None) -> dict[str, str]:
    """A name in the checkpoint -> this model's parameter it is. The shards hold the names of the
    module the other trainer trained: this module's own where it is the same (a PEFT model
    included), file_key's where this one wraps it (a post-training objective's policy)."""
    if file_key is None:
        return state.canonical
    return {file_key(k): n for k, n in state.canonical.items()} | state.canonical


def _check_frozen(state: "TrainingState", source: Any, where: str, canonical: dict[str, str]) -> None:
    """The parameters the checkpoint's run froze (a LoRA run's base) must be the ones this model
    freezes, by name and shape, where the checkpoint records them."""
    if source.frozen is None:
        return
    buffers = {n for n, _ in state.model.named_buffers()}     # a state_dict's buffers: not parameters at all
    theirs = {canonical.get(n, n): tuple(shape) for n, shape in source.frozen.items()
              if canonical.get(n, n) not in buffers}
    ours = {n: tuple(p.shape) for n, p in state.model.named_parameters() if not p.requires_grad}
    if theirs != ours:
        differ = sorted(set(theirs) ^ set(ours)) or sorted(n for n in ours if theirs[n] != ours[n])
        raise WeightsFileError(f"cannot take in {where}: it froze {len(theirs)} parameters, this model freezes "
                               f"{len(ours)} ({', '.join(differ[:3])} differ): a LoRA run's checkpoint goes into a model "
                               "with the same adapters on the same base (run.yaml: finetuning_type lora with its "
                               "lora_rank and lora_target); nothing was loaded")


def _steps(source: Any, path: str) -> tuple[int, dict]:
    """The optimizer steps done: a Trainer's global_step where it left trainer_state.json, else
    the save's own count; and trainer_state.json (or {global_step})."""
    trainer_state = {"global_step": source.global_steps}
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


def _lrs(state: "TrainingState", source: Any, saved_as: dict[str, str]) -> list[str]:
    """Each parameter's lr in the checkpoint over its AdamW lr_ratios ratio here must be one lr: one
    group's lr without ratios; LoRA+'s groups (each B at lr x ratio) with the ratio this engine has."""
    lrs = {name: source.lr(saved) for name, saved in saved_as.items()}
    if not all(isinstance(lr, (int, float)) for lr in lrs.values()) or not any(lrs.values()):
        return []       # no lr written, or a schedule at 0 when it saved: no ratio to read
    base = {name: lr / state.lr_ratios.get(name, 1.0) for name, lr in lrs.items()}
    if close(list(base.values()), [next(iter(base.values()))] * len(base)):
        return []
    ran = sorted(set(lrs.values()))
    if not state.lr_ratios:     # LoRA+'s groups, or lrs of the user's own: this engine steps all at one lr
        return [f"its param groups ran at {len(ran)} learning rates ({', '.join(map(repr, ran[:4]))}), this engine "
                "runs every parameter at one (LoRA+: give the run its loraplus_lr_ratio, AdamW its lr_ratios)"]
    ratios = sorted(set(state.lr_ratios.values()))
    return [f"its param groups ran at learning rates {', '.join(map(repr, ran[:4]))}, whose ratios are not this "
            f"engine's AdamW lr_ratios ({', '.join(f'{r:g}' for r in ratios[:4])} on {len(state.lr_ratios)} "
            "parameters)"]


def _settings(state: "TrainingState", source: Any, saved_as: dict[str, str], where: str,
              strict: bool) -> list[str]:
    """The checkpoint's AdamW betas, eps and each parameter's weight decay against this engine's."""
    opt = state.optimizer
    differences = betas_and_eps(opt, source.first_group)
    differences += not_adamw(source.param_groups)
    differences += _lrs(state, source, saved_as)
    decays = []
    for name, saved in saved_as.items():
        theirs = source.weight_decay(saved)
        ours = 0.0 if name in state.no_decay else opt.weight_decay
        if not close([theirs], [ours]):
            decays.append(f"{name} {theirs} (this engine {ours})")
    if decays:
        differences.append(f"the weight decay of {len(decays)} parameters: {', '.join(decays[:3])} (the Trainer's "
                           "split is megacompile.hf_no_decay)")
    return settled(differences, where, strict)
