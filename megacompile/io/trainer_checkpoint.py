"""A transformers Trainer checkpoint taken in: the weights, AdamW's moments and step counts.

    checkpoint-500/                 what Trainer._save_checkpoint writes (LlamaFactory's and TRL's too)
        config.json, model.safetensors (or shards and their index); or, for a LoRA run,
        adapter_config.json, adapter_model.safetensors (PEFT's: lora_adapter.py)
        optimizer.pt                torch.optim.AdamW's state_dict(): per parameter index its
                                    exp_avg, exp_avg_sq and step, and the param groups
        trainer_state.json          global_step: the optimizer steps taken
        scheduler.pt, rng_state.pth, training_args.bin   (not read: see below)

A Trainer running DeepSpeed or FSDP saves no optimizer.pt: its global_stepN/ partitions (ZeRO),
or its pytorch_model_fsdp_0/ and optimizer_0/ shards, are taken in by sharded_checkpoint.py, which
read() and check() hand such a folder to; so is a torchtune save (its recipe_state.pt:
torchtune_layout.py).

The Trainer makes two param groups (Trainer.create_optimizer): the decayed parameters, then the
ones its rule exempts (optim/weight_decay.py hf_no_decay), each in named_parameters() order, and
numbers the parameters across both. The same split of this engine's trainable parameters by its
AdamW `no_decay` gives each index its name; one group, as a Trainer given its own optimizer may
make, is every trainable parameter in order; with AdamW `lr_ratios`, LlamaFactory's LoRA+ four
groups (_layouts) are read too, their lrs' ratio held to this engine's. Every index's moments must
have its parameter's
shape, and the groups' sizes and weight decays must be the split's, or nothing is loaded: a
mapping that only looks right would train the moments of one parameter into another.

The learning rate follows this engine's schedule at global_step (the masters' step counter), not
scheduler.pt; the random states and the data order are the run's own (a Trainer's sampler is not
replayed). Moments come through a memory map of optimizer.pt: each one's pages are read once, into
the host state, and given back as soon as it is copied (pages.py), so the file is never held whole
beside the host state (8 bytes per parameter more at the end of the load).
"""
from __future__ import annotations

import os
import zipfile
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from ..errors import WeightsFileError
from . import dcp_layout, lora_adapter, pages, sharded_checkpoint, torchtune_layout, zero_layout
from .adamw_settings import betas_and_eps, close, not_adamw, settled
from .foreign_checkpoint import describe as describe_foreign
from .hf_layout import INDEX, SINGLE
from .saved_dict import json_object
from .hf_load import plan_items, shard_map
from .source import MASTER, Item, PendingLoad

if TYPE_CHECKING:
    from ..optim import AdamW
    from ..state.training import TrainingState

OPTIMIZER, TRAINER_STATE = "optimizer.pt", "trainer_state.json"


def is_trainer_checkpoint(path: str) -> bool:
    """A folder a Trainer saved with its weights (a model's, or a LoRA adapter's: lora_adapter.py)
    and its optimizer (what read() takes), or one with DeepSpeed ZeRO's partitions (a Trainer's or
    DeepSpeed's own), FSDP's shards or torchtune's recipe_state.pt in place of optimizer.pt
    (sharded_checkpoint.py)."""
    has = lambda name: os.path.isfile(os.path.join(path, name))   # noqa: E731
    return (os.path.isdir(path) and has(TRAINER_STATE) and has(OPTIMIZER)
            and ((has("config.json") and (has(SINGLE) or has(INDEX))) or lora_adapter.holds_adapter(path))
            or _sharded_here(path))


def named(path: str) -> str:
    """What a run's log calls the checkpoint (is_trainer_checkpoint) it starts from."""
    if torchtune_layout.holds(path):
        return "the torchtune checkpoint"
    if zero_layout.holds(path):
        sharded = "DeepSpeed ZeRO"
    elif dcp_layout.holds(path) or dcp_layout.holds_whole(path):
        sharded = "FSDP"
    else:
        return "the Trainer checkpoint"
    by_a_trainer = os.path.isfile(os.path.join(path, TRAINER_STATE))
    return f"the Trainer's {sharded} checkpoint" if by_a_trainer else f"the {sharded} checkpoint"


def _sharded_here(path: str) -> bool:
    """Whether the folder's optimizer state is another trainer's shards (DeepSpeed ZeRO's
    partitions, FSDP's) in place of an optimizer.pt (sharded_checkpoint.py)."""
    return (os.path.isdir(path) and not os.path.isfile(os.path.join(path, OPTIMIZER))
            and (zero_layout.holds(path) or dcp_layout.holds(path) or dcp_layout.holds_whole(path)
                 or torchtune_layout.holds(path)))


def _sharded(path: str):
    """The source that reads the folder's shards, or None (_sharded_here)."""
    if not _sharded_here(path):
        return None
    if zero_layout.holds(path):
        return zero_layout.Partitions(path)
    if torchtune_layout.holds(path):
        return torchtune_layout.Recipe(path)
    return dcp_layout.Shards(path) if dcp_layout.holds(path) else dcp_layout.Whole(path)


def check(model: nn.Module, optimizer: "AdamW", path: str, file_key: Callable[[str], str] | None = None) -> None:
    """What read() refuses, refused before any engine exists: the checkpoint `path` against the
    model (on meta will do) and the AdamW its engine will have; optimizer.pt's moments are only
    mapped, never read. A run checks its Trainer import so before anything of it is written."""
    from ..state.training import TrainingState
    state = TrainingState(model, optimizer, compute_dtype=torch.float32, grad_accum=1)
    source = _sharded(path)
    if source is not None:
        sharded_checkpoint.check(state, source, path, file_key)
        return
    _checked(state, path, False, file_key, on_meta=True)


def read(state: "TrainingState", path: str, strict: bool = True,
         file_key: Callable[[str], str] | None = None) -> tuple[PendingLoad, dict, list[str], dict]:
    """(the load, the counters, notes, trainer_state.json) of the Trainer checkpoint `path`, checked
    against the state: nothing changes here. file_key: a state_dict key's name in the folder's
    files, where the module wraps the Trainer's model (from_pretrained.compile_folder's)."""
    source = _sharded(path)
    if source is not None:
        return sharded_checkpoint.read(state, source, path, strict, file_key)
    weights, saved, names, notes, trainer_state = _checked(state, path, strict, file_key)
    steps, shapes = trainer_state["global_step"], state.layout()[0]
    tensors, missed, stored = {}, {}, set()
    for index, name in enumerate(names):
        entry = saved["state"].get(index)
        if entry is None:       # never stepped (no gradient yet): AdamW's state is made at its first update
            tensors[f"exp_avg/{name}"] = tensors[f"exp_avg_sq/{name}"] = torch.zeros(shapes[name])
            missed[name] = steps
            continue
        tensors[f"exp_avg/{name}"], tensors[f"exp_avg_sq/{name}"] = entry["exp_avg"], entry["exp_avg_sq"]
        stored |= {f"exp_avg/{name}", f"exp_avg_sq/{name}"}
        taken = int(entry.get("step", 0))
        if taken < steps:
            missed[name] = steps - taken
    items = weights + [Item(_MEMORY, key, key.partition("/")[0], key.partition("/")[2]) for key in tensors]
    mapped = _mapped(os.path.join(path, OPTIMIZER))
    if mapped:      # what the checks read (the steps, and their pages' neighbours) goes back before the load
        for entry in saved["state"].values():
            for t in entry.values():
                if isinstance(t, torch.Tensor):
                    pages.drop(t)
    load = PendingLoad(items, own_buffers=True, needs=(MASTER, "exp_avg", "exp_avg_sq"),
                       describe=f"the Trainer checkpoint {path}", memory={_MEMORY: tensors},
                       mapped=frozenset(stored) if mapped else frozenset())
    if lora_adapter.holds_adapter(path):
        load = lora_adapter.beside_the_base(state, load)
    counters = {"steps_done": steps, "micro_batches": steps * state.grad_accum, "skipped_steps": 0,
                "missed_steps": missed}
    return load, counters, notes, trainer_state


def _checked(state: "TrainingState", path: str, strict: bool, file_key: Callable[[str], str] | None,
             on_meta: bool = False) -> tuple[list[Item], dict, list[str], list[str], dict]:
    """(the weights' items, optimizer.pt's state_dict, each index's parameter name, notes,
    trainer_state.json), every refusal of the module docstring made: nothing is allocated.
    on_meta: the state's model is wholly on meta (hf_load.plan_items)."""
    if not is_trainer_checkpoint(path):
        foreign = describe_foreign(path) if os.path.isdir(path) else None
        missing = [n for n in (TRAINER_STATE, OPTIMIZER, "config.json") if not os.path.isfile(os.path.join(path, n))]
        why = (foreign if foreign and "Hugging Face Trainer" not in foreign else
               f"a Trainer checkpoint holds {TRAINER_STATE}, {OPTIMIZER}, config.json and the model's safetensors; "
               f"this one lacks {', '.join(missing) or SINGLE}" + (" (a Trainer saving with save_only_model writes "
                                                                     "no optimizer.pt: start from its weights)"
                                                                     if OPTIMIZER in missing else ""))
        raise WeightsFileError(f"cannot take in the Trainer checkpoint {path}: {why}; nothing was loaded")
    trainer_state = json_object(os.path.join(path, TRAINER_STATE), "the Trainer's state")
    steps = trainer_state.get("global_step")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise WeightsFileError(f"{path}/{TRAINER_STATE}: global_step is {steps!r}, not a count of steps")
    model = state.model
    canonical = state.canonical if file_key is None else {file_key(k): n for k, n in state.canonical.items()}
    weights = (lora_adapter.items(state, path) if lora_adapter.holds_adapter(path)
               else plan_items(canonical, model, path, shard_map(path), on_meta=on_meta))
    saved = _optimizer_state(os.path.join(path, OPTIMIZER))
    names = _names_by_index(state, model, saved["param_groups"], path)
    shapes = state.layout()[0]
    problems = []
    for index, name in enumerate(names):
        entry = saved["state"].get(index)
        if entry is None:
            continue
        for table in ("exp_avg", "exp_avg_sq"):
            t = entry.get(table)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shapes[name]:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"parameter {index}'s {table} is {got}, {name} is {shapes[name]}")
        taken = int(entry.get("step", 0))
        if not 0 <= taken <= steps:
            problems.append(f"parameter {index} ({name}) took {taken} AdamW steps of the {steps} global steps")
    if problems:
        raise WeightsFileError(f"cannot take in the Trainer checkpoint {path}: its {OPTIMIZER} does not fit this "
                               f"model's trainable parameters in the Trainer's order: {'; '.join(problems[:3])}; "
                               "nothing was loaded")
    return weights, saved, names, _settings(state, saved["param_groups"], path, strict), trainer_state


_MEMORY = "<optimizer.pt>"      # the items the load takes from tensors in memory, not from a file


def _mapped(path: str) -> bool:
    """Whether optimizer.pt is read through a memory map: torch.save's zip format is; a file of the
    legacy format is read whole."""
    return zipfile.is_zipfile(path)


def _optimizer_state(path: str) -> dict:
    try:     # weights_only: tensors, numbers and containers, nothing a pickle could run
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=_mapped(path))
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise WeightsFileError(f"cannot read {path} as torch's optimizer state_dict: {e}") from e
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list) and saved["param_groups"]):
        raise WeightsFileError(f"{path} is not an optimizer's state_dict (state and param_groups)")
    kinds = {key for entry in saved["state"].values() if isinstance(entry, dict) for key in entry}
    if saved["state"] and not {"exp_avg", "exp_avg_sq"} <= kinds:
        raise WeightsFileError(f"{path} is not AdamW's state (it holds {', '.join(sorted(map(str, kinds))[:5])}, not "
                               "exp_avg and exp_avg_sq: Adafactor's, an 8-bit AdamW's or another optimizer's): "
                               "megacompile's AdamW cannot go on from it; start a new run from the checkpoint's "
                               "weights; nothing was loaded")
    amsgrad = [g for g in saved["param_groups"] if g.get("amsgrad")]
    if amsgrad:
        raise WeightsFileError(f"{path} was written by AdamW with amsgrad=True, which megacompile's AdamW does not "
                               "run; nothing was loaded")
    return saved


def _layouts(state: "TrainingState", trainable: list[str]) -> list[tuple[list[list[str]], list[float]]]:
    """The param groups a Trainer of this engine's AdamW makes, each as (the groups' parameter
    names, their weight decays): the Trainer's two, decayed and exempt; one, every parameter; and
    with lr_ratios, LlamaFactory's LoRA+ four: lr (the A matrices), lr x ratio decayed and exempt
    (each B, the 1-D parameters), and its adapters on embeddings (none here: Linear modules alone)."""
    wd = state.optimizer.weight_decay
    decayed = [n for n in trainable if n not in state.no_decay]
    exempt = [n for n in trainable if n in state.no_decay]
    layouts = [([decayed, exempt], [wd, 0.0]), ([trainable], [wd])]
    if state.lr_ratios:
        at_lr = [n for n in trainable if n not in state.lr_ratios]
        scaled = [n for n in trainable if n in state.lr_ratios]
        layouts.append(([at_lr, [n for n in scaled if n not in state.no_decay],
                         [n for n in scaled if n in state.no_decay], []], [wd, wd, 0.0, wd]))
    return layouts


def _layout(state: "TrainingState", groups: list[dict]) -> tuple[list[list[str]], list[float]] | None:
    """The layout (_layouts) whose group sizes the checkpoint's param groups have, or None."""
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    sizes = [len(g.get("params", ())) for g in groups]
    return next((layout for layout in _layouts(state, trainable) if [len(g) for g in layout[0]] == sizes), None)


def _names_by_index(state: "TrainingState", model: nn.Module, groups: list[dict], path: str) -> list[str]:
    """The trainable parameter each index of the optimizer's state names (module docstring)."""
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    decayed = [n for n in trainable if n not in state.no_decay]
    exempt = [n for n in trainable if n in state.no_decay]
    sizes = [len(g.get("params", ())) for g in groups]
    layout = _layout(state, groups)
    if layout is not None:
        order = [n for group in layout[0] for n in group]
    else:
        raise WeightsFileError(
            f"cannot take in the Trainer checkpoint {path}: its optimizer has param groups of {sizes} parameters; "
            f"this model has {len(trainable)} trainable ones, {len(decayed)} decayed and {len(exempt)} exempt by "
            "this engine's AdamW no_decay (the Trainer's split is megacompile.hf_no_decay): give the optimizer "
            "no_decay=megacompile.hf_no_decay, or the model the checkpoint was trained from; nothing was loaded")
    indices = [i for g in groups for i in g["params"]]
    if sorted(indices) != list(range(len(order))):
        raise WeightsFileError(f"cannot take in the Trainer checkpoint {path}: its param groups number the "
                               f"parameters {indices[:6]}..., not 0 to {len(order) - 1}; nothing was loaded")
    names = [""] * len(order)
    for position, index in enumerate(indices):
        names[index] = order[position]
    return names


def _settings(state: "TrainingState", groups: list[dict], path: str, strict: bool) -> list[str]:
    """AdamW's betas, eps and weight decays in the checkpoint against this engine's: refused when
    strict, kept as this engine's with a note otherwise."""
    opt = state.optimizer
    differences = betas_and_eps(opt, groups[0]) + not_adamw(groups)
    decays = [g.get("weight_decay", 0.0) for g in groups]
    layout = _layout(state, groups)
    wanted = layout[1] if layout is not None else [opt.weight_decay]
    if not close(decays, wanted):
        differences.append(f"weight_decay of its param groups: the checkpoint has {decays}, this engine {wanted}")
    if layout is not None and len(layout[0]) == 4:     # LoRA+: its B groups' lr over its A group's, the ratio
        ratio = {state.lr_ratios[n] for n in layout[0][1] + layout[0][2]}
        lrs = [g.get("lr") for g in groups[:3]]
        numbers = all(isinstance(x, (int, float)) and x >= 0 for x in lrs)
        if numbers and lrs == [0, 0, 0]:      # a schedule at 0 when it saved: no ratio to read
            pass
        elif len(ratio) != 1 or not numbers or not lrs[0] or \
                not close([lrs[1] / lrs[0], lrs[2] / lrs[0]], [next(iter(ratio))] * 2):
            differences.append(f"lr of its LoRA+ param groups: the checkpoint has {lrs}, whose ratio this engine's "
                               f"AdamW lr_ratios ({sorted(ratio)}) is not")
    if len(groups) == 1 and state.no_decay:
        differences.append(f"the checkpoint decays every parameter alike, this engine exempts {len(state.no_decay)} "
                           "(its AdamW no_decay)")
    return settled(differences, f"the Trainer checkpoint {path}", strict)

