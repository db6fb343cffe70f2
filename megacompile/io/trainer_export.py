"""A checkpoint transformers' Trainer resumes from, written from the engine: the way back.

    checkpoint-N/   the model folder save_pretrained writes (fp32 masters, config, tokenizer files);
                    a LoRA model's: PEFT's adapter (adapter_config.json, adapter_model.safetensors,
                    the adapters' fp32 masters) and the tokenizer files of the folder the model
                    came from, as a LoRA run's Trainer writes it
        optimizer.pt        torch.optim.AdamW's state_dict over the Trainer's two param groups (with
                            AdamW lr_ratios, LlamaFactory's LoRA+ four)
        scheduler.pt        the LambdaLR's step count (its base rates stay the resuming Trainer's)
        trainer_state.json  global_step, train_batch_size (the Trainer compares it with its own) and
                            the logging, eval and save intervals (the Trainer takes them from here)

`Trainer.train(resume_from_checkpoint=...)` (LlamaFactory's and TRL's resume_from_checkpoint)
then goes on as megacompile would: the same masters, moments and step counts (the parameter order
is the Trainer's: trainer_checkpoint.py reads it back the same way). The param groups' rate is the
one of the next step, which the Trainer's first resumed step runs at before its scheduler steps;
that is this engine's schedule, which is the Trainer's only when the two schedules agree.

The folder is written beside its place and renamed into it once whole: a failed export leaves no
folder the Trainer would resume from without its optimizer (it would start AdamW afresh silently).
optimizer.pt is made with torch.save, which takes every tensor at once: each moment goes in as a view
of its owner's flat buffer, which torch.save writes once for all its views, so the host state is
written as it stands, with no copy. Moments on the disk tier are read into RAM for it and copied out
parameter by parameter (8 bytes per parameter while it is written).
"""
from __future__ import annotations

import json
import os
import shutil
from typing import TYPE_CHECKING, NamedTuple

import torch

from ..errors import ArgumentError, CheckpointError, MegacompileError
from ..optim.weight_decay import exempt_parameters, hf_no_decay
from . import durable, hf_save, lora_adapter, lora_save, unbuilt

if TYPE_CHECKING:
    from ..state.training import TrainingState


def save(state: "TrainingState", path: str, batch_size: int, intervals: dict[str, int]) -> None:
    """intervals: logging_steps, eval_steps, save_steps, which a Trainer resuming from a checkpoint
    takes from it rather than from its arguments."""
    for key, value in {"batch_size": batch_size, **intervals}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            what = ("the rows of each micro-batch the resuming Trainer runs (its per_device_train_batch_size)"
                    if key == "batch_size" else f"the Trainer's {key} from this checkpoint on")
            raise ArgumentError(f"save_trainer_checkpoint({key}=...) is {what}, a whole number >= 1; got {value!r}")
    path = os.fspath(path)
    durable.prepare_parent(path, "Trainer checkpoint")
    if os.path.lexists(path):
        raise CheckpointError(f"cannot write the Trainer checkpoint {path}: something is there already; give a new "
                              "path (a Trainer names its checkpoints checkpoint-<step>)")
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    theirs = exempt_parameters(hf_no_decay, state.model)
    if set(state.no_decay) != set(theirs):
        raise MegacompileError(
            "save_trainer_checkpoint writes the Trainer's two param groups, whose weight-decay exemption is "
            "megacompile.hf_no_decay; this engine's AdamW no_decay exempts other parameters "
            f"({_some(set(state.no_decay) ^ set(theirs))}), so a Trainer would resume them under another decay: "
            "compile with AdamW(no_decay=megacompile.hf_no_decay)")
    groups = _groups(state, trainable, theirs)
    state.wait_updates()
    tmp = durable.partial_path(path)
    try:
        if lora_adapter.peft_model(state.model) is not None:      # PEFT's adapter, as a LoRA run's Trainer saves
            os.makedirs(tmp)
            lora_save.write_adapter(state, tmp)
            # The Trainer saves its tokenizer beside the adapter; the base model's generation config is not the adapter's.
            hf_save.copy_source_files(state, tmp, hf_save.source_files(state, hf_save.TOKENIZER_FILES))
        else:
            hf_save.save_pretrained(state, tmp, dtype=torch.float32)
        torch.save(_optimizer(state, groups), os.path.join(tmp, "optimizer.pt"))
        torch.save({"last_epoch": state.steps_done, "_step_count": state.steps_done + 1,
                    "_last_lr": [_next_lr(state) * g.ratio for g in groups], "lr_lambdas": [None] * len(groups)},
                   os.path.join(tmp, "scheduler.pt"))
        durable.write_text(os.path.join(tmp, "trainer_state.json"),
                           json.dumps({"global_step": state.steps_done, "train_batch_size": batch_size,
                                       **intervals, "log_history": []}, indent=2))
        durable.rename_into_place(tmp, path)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise durable.write_failed("Trainer checkpoint", path, e) from e
        raise


class Group(NamedTuple):
    names: list[str]
    ratio: float             # its lr over the schedule's
    weight_decay: float


def _groups(state: "TrainingState", trainable: list[str], exempt: set[str]) -> list[Group]:
    """The param groups a Trainer makes for this engine's AdamW: its two, decayed and exempt; with
    lr_ratios of one ratio, LlamaFactory's LoRA+ four (trainer_checkpoint._layouts reads them back):
    lr and decayed (the A matrices), lr x ratio decayed and exempt (each B, the 1-D parameters), and
    its group for adapters on embeddings (none: adapters sit on Linear modules alone)."""
    wd = state.optimizer.weight_decay
    if not state.lr_ratios:
        return [Group([n for n in trainable if n not in exempt], 1.0, wd), Group([n for n in trainable if n in exempt],
                                                                                 1.0, 0.0)]
    ratios = sorted(set(state.lr_ratios.values()))
    at_lr = [n for n in trainable if n not in state.lr_ratios]
    held = [n for n in at_lr if n in exempt]
    if len(ratios) > 1 or held:
        why = (f"its ratios are {', '.join(f'{r:g}' for r in ratios)}" if len(ratios) > 1 else
               f"{_some(set(held))} step at lr yet are exempt from weight decay, which that group applies")
        raise MegacompileError(
            "save_trainer_checkpoint writes the Trainer's param groups: with AdamW lr_ratios, LlamaFactory's LoRA+ "
            f"four (one ratio for each B and every 1-D parameter); this engine's lr_ratios do not fit them ({why}), "
            "so a Trainer would resume them at other lrs: save_checkpoint keeps them")
    scaled = [n for n in trainable if n in state.lr_ratios]
    return [Group(at_lr, 1.0, wd), Group([n for n in scaled if n not in exempt], ratios[0], wd),
            Group([n for n in scaled if n in exempt], ratios[0], 0.0), Group([], 1.0, wd)]


def _optimizer(state: "TrainingState", groups: list[Group]) -> dict:
    """torch.optim.AdamW's state_dict: every parameter numbered across the groups in order; one that
    never took a step has no state, as torch keeps it."""
    opt, host = state.optimizer, state.host
    tables = None if host is not None else unbuilt.tables(state)[0]
    moments, index = {}, 0
    for group in groups:
        for name in group.names:
            steps = state.adamw_step(name)
            if steps > 0:
                pair = [_moment(host, t, name) if host is not None else _waiting(tables, t, name, state)
                        for t in ("exp_avg", "exp_avg_sq")]
                moments[index] = {"step": torch.tensor(float(steps)), "exp_avg": pair[0], "exp_avg_sq": pair[1]}
            index += 1
    settings = {"betas": tuple(opt.betas), "eps": opt.eps, "amsgrad": False, "maximize": False, "foreach": None,
                "capturable": False, "differentiable": False, "fused": None, "decoupled_weight_decay": True}
    numbered, first, lr = [], 0, _next_lr(state)
    for group in groups:
        numbered.append({"lr": lr * group.ratio, **settings, "weight_decay": group.weight_decay,
                         "params": list(range(first, first + len(group.names)))})
        first += len(group.names)
    return {"state": moments, "param_groups": numbered}


def _moment(host, table: str, name: str) -> torch.Tensor:
    """A view of the owner's flat buffer, which torch.save writes once for all its views: no copy.
    A disk tier's read is a fresh buffer of the whole owner, which a view would keep alive for each
    of the owner's parameters: that one is copied, its read let go."""
    view = host.view(table, name)
    return view.clone() if host.disk is not None and host.disk.holds(table) else view


def _waiting(tables: dict, table: str, name: str, state: "TrainingState") -> torch.Tensor:
    """A moment of an engine without host state yet: from the load it waits for, zeros without one."""
    source = tables[table].get(name)
    return torch.zeros(state.layout()[0][name]) if source is None else source().float().clone()


def _next_lr(state: "TrainingState") -> float:
    return float(state.step_context()["lr"])


def _some(names: set[str]) -> str:
    shown = sorted(names)[:3]
    return ", ".join(shown) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
