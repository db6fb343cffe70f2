"""Which parameters a run trains: `finetuning_type` full, lora or freeze (LlamaFactory's keys).

    lora    the model wrapped by PEFT (LoraConfig + get_peft_model): the base weights frozen, only
            the adapters trained (fp32 masters and AdamW state for them alone); lora_target names
            the Linear modules (their last name: q_proj, ...) or `all`, every Linear of the
            decoder blocks (not lm_head), and a mixture-of-experts' routed experts (their fused
            weights, PEFT's target_parameters) under `all` or their projections' names;
            additional_target names modules trained whole beside them (PEFT's modules_to_save);
            pissa_init starts the adapters as each weight's principal part, the base streaming as
            the residual (pissa.py).
    freeze  freeze_trainable_layers N: the last N decoder blocks trained (-N: the first N);
            freeze_trainable_modules: which modules of those blocks (all, or names);
            freeze_extra_modules: modules trained besides (embed_tokens, lm_head, norm); each name
            matched as LlamaFactory matches it, a substring of the parameters' names (freeze.py).
    A vision-language model's freeze_vision_tower, freeze_multi_modal_projector and
    freeze_language_model freeze those parts on top of either (vision_freeze.py); LoRA's adapters
    go on its language model, and on its tower (and projector) where their keys are false, as
    LlamaFactory's LoRA puts them.

    full    every parameter trains: the model as it is.

    lora.py, freeze.py  the two methods; vision_freeze.py  a vision-language model's parts;
    lora_export.py  a LoRA run's export; pissa.py  PiSSA's start; names.py  module names as run.yaml
    gives them.
This package is the one place (with config.py) that reads finetuning_type: the rest of train/
asks `adapters(c)`, `apply(c, model)`, `saved(c)`.

The keys are checked with the rest of run.yaml (check); the names they give are checked against
the model on the meta device (apply, before the data is read), and the same apply then shapes the
module the engine trains. Frozen weights stream to the device as any frozen weight does: no
master, no moments, no gradient offload.
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...errors import ArgumentError
from ...optim import MAX_LR, MAX_RATIO
from . import pissa, vision_freeze
from .freeze import freeze
from .lora import base_dtype, file_key, merged, require_peft, scaling, transposed, with_adapters
from .lora_experts import experts_adapted
from .lora import lora_skeleton as _lora_skeleton
from .names import names

TYPES = ("full", "lora", "freeze")
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "use_dora", "use_rslora", "loraplus_lr_ratio",
             "additional_target", "merge_adapter")
WHOLE_STAGES = ("sft", "pt")        # the stages whose objective trains additional_target's copies as PEFT does
FREEZE_KEYS = ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules")
# LlamaFactory's defaults of the two kinds' keys, which its dumps write whatever the finetuning_type
# and which it does not read under the other kind: there they ask for nothing
LLAMAFACTORY_DEFAULTS = {"lora_rank": 8, "lora_alpha": None, "lora_dropout": 0.0, "lora_target": "all",
                         "use_dora": False, "use_rslora": False, "loraplus_lr_ratio": None, "additional_target": None,
                         "freeze_trainable_layers": 2, "freeze_trainable_modules": "all", "freeze_extra_modules": None}


def adapters(c) -> bool:
    """The run trains LoRA adapters over a frozen base (finetuning_type: lora); every room but
    this one and config.py asks this rather than reading finetuning_type."""
    return c.finetuning_type == "lora"


def _llamafactory_default(key: str, value) -> bool:
    if key not in LLAMAFACTORY_DEFAULTS:
        return False
    default = LLAMAFACTORY_DEFAULTS[key]
    if isinstance(default, bool) or isinstance(value, bool) or not isinstance(default, (int, float)):
        return type(value) is type(default) and value == default
    return isinstance(value, (int, float)) and value == default     # lora_dropout: 0 or 0.0


def check(c, raw: dict, files: bool = True) -> None:
    """run.yaml's fine-tuning keys on the RunConfig `c` (raw: the keys as given), in place; files
    False: the adapter folder not looked for (a run read for its model alone, whose checkpoint holds
    the adapters it trained)."""
    if c.finetuning_type not in TYPES:
        raise ArgumentError(f"finetuning_type must be one of {', '.join(TYPES)}; got {c.finetuning_type!r}")
    for keys, kind in ((LORA_KEYS, "lora"), (FREEZE_KEYS, "freeze")):
        stray = [k for k in keys if raw.get(k) is not None and c.finetuning_type != kind
                 and not _llamafactory_default(k, raw[k])]
        if stray:
            raise ArgumentError(f"{', '.join(stray)} {'applies' if len(stray) == 1 else 'apply'} to "
                                f"finetuning_type: {kind}, and this run is finetuning_type: {c.finetuning_type}; "
                                f"set finetuning_type: {kind}, or leave {'it' if len(stray) == 1 else 'them'} out")
    c.lora_rank = _whole("lora_rank", c.lora_rank, 1)
    if c.lora_alpha is None:
        c.lora_alpha = 2 * c.lora_rank          # LlamaFactory's default
    if isinstance(c.lora_alpha, bool) or not isinstance(c.lora_alpha, (int, float)) or not c.lora_alpha > 0:
        raise ArgumentError(f"lora_alpha must be a number > 0 (the adapter's scale is lora_alpha / lora_rank; "
                            f"default 2 * lora_rank); got {c.lora_alpha!r}")
    if (isinstance(c.lora_dropout, bool) or not isinstance(c.lora_dropout, (int, float))
            or not 0 <= c.lora_dropout < 1):
        raise ArgumentError(f"lora_dropout must be a number in [0, 1); got {c.lora_dropout!r}")
    c.lora_target = names("lora_target", c.lora_target)
    if not isinstance(c.use_dora, bool):
        raise ArgumentError(f"use_dora must be true (DoRA: PEFT's LoRA with a learned magnitude per output) or false; "
                            f"got {c.use_dora!r}")
    if not isinstance(c.use_rslora, bool):
        raise ArgumentError(f"use_rslora must be true (rank-stabilised LoRA: the adapters' scale is lora_alpha / "
                            f"sqrt(lora_rank)) or false (lora_alpha / lora_rank); got {c.use_rslora!r}")
    ratio = c.loraplus_lr_ratio
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= MAX_RATIO):
        raise ArgumentError(f"loraplus_lr_ratio must be a number > 0 (LoRA+: each adapter's B trains at lr x it, "
                            f"e.g. 16), or null (every adapter at lr); got {ratio!r}")
    if ratio is not None and c.lr * ratio > MAX_LR:
        raise ArgumentError(f"loraplus_lr_ratio {ratio:g} with lr {c.lr:g} trains each adapter's B at lr "
                            f"{c.lr * ratio:g}, above the {MAX_LR:g} AdamW can train with; LoRA+ takes ratios of "
                            "2 to 256 (16 is usual)")
    whole = c.additional_target
    c.additional_target = [] if whole is None else names("additional_target", whole, allow_all=False)
    if c.additional_target and c.stage not in WHOLE_STAGES:
        raise ArgumentError(f"additional_target trains whole modules beside the adapters in stages sft and pt; under "
                            f"stage {c.stage} the reference would be the policy's own copies, not the base's modules: "
                            "leave it out (or train those modules in an sft run first)")
    if not isinstance(c.merge_adapter, bool):
        raise ArgumentError(f"merge_adapter must be true (export the merged model) or false (export the adapter); "
                            f"got {c.merge_adapter!r}")
    layers = c.freeze_trainable_layers
    if isinstance(layers, bool) or not isinstance(layers, int) or layers == 0:
        raise ArgumentError(f"freeze_trainable_layers must be a whole number other than 0 (N: the last N decoder "
                            f"blocks trained, -N: the first N); got {layers!r}")
    c.freeze_trainable_modules = names("freeze_trainable_modules", c.freeze_trainable_modules)
    extra = c.freeze_extra_modules
    c.freeze_extra_modules = [] if extra is None else names("freeze_extra_modules", extra, allow_all=False)
    if c.finetuning_type == "lora" and c.bundled:
        raise ArgumentError("finetuning_type: lora needs a Hugging Face model (the adapter is exported in PEFT's "
                            "format); the bundled model is not one: use full or freeze")
    if c.finetuning_type == "lora":
        require_peft("finetuning_type: lora")
    _check_adapter(c, files)
    pissa.check(c, adapters(c))
    vision_freeze.check(c, adapters(c))


def _check_adapter(c, files: bool) -> None:
    """adapter (LlamaFactory's adapter_name_or_path): one PEFT adapter folder the run's LoRA adapters
    start from; its config is held to the run's lora keys once the model is built (check_adapter)."""
    from ...io import lora_adapter
    if c.adapter is None:
        return
    if c.finetuning_type != "lora":
        raise ArgumentError(f"adapter: {c.adapter!r} is a LoRA adapter to go on training, which needs finetuning_type: "
                            "lora; to train the whole model from it, merge it into the model first (PEFT's "
                            "merge_and_unload, then save_pretrained) and give that folder as model")
    if not isinstance(c.adapter, str) or "," in c.adapter:
        raise ArgumentError(f"adapter takes one adapter folder; got {c.adapter!r}: merge the earlier adapters into "
                            "the model first (PEFT's merge_and_unload), and give the last one here")
    if files and not lora_adapter.holds_adapter(c.adapter):
        raise ArgumentError(f"adapter: {c.adapter} holds no PEFT adapter (adapter_config.json and "
                            "adapter_model.safetensors)")


def check_adapter(c, model: nn.Module) -> None:
    """The adapter against the run's LoRA adapters on `model`: its config (rank, alpha, targets) and
    every tensor's name and shape."""
    from ...io import lora_adapter
    if c.adapter is not None:
        lora_adapter.check(model, c.adapter)


def saved(c) -> dict:
    """The keys that say which parameters train, kept in every checkpoint (merge_adapter aside:
    it shapes the export only)."""
    keys = {"full": (), "lora": LORA_KEYS[:-1], "freeze": FREEZE_KEYS}[c.finetuning_type]
    return {"finetuning_type": c.finetuning_type, **{k: getattr(c, k) for k in keys}, **vision_freeze.given(c),
            **({"pissa_init": True, "pissa_iter": c.pissa_iter} if c.pissa_init else {})}


def check_resume(c, extra: dict) -> None:
    """A resume trains the parameters its checkpoint trained: other fine-tuning keys are refused
    (a checkpoint without them is of a full fine-tune)."""
    before, now = extra.get("finetuning") or {"finetuning_type": "full"}, saved(c)
    if before.get("finetuning_type") == "lora":
        # Saved before they were keys: plain LoRA.
        before = {**before, "use_dora": before.get("use_dora", False), "use_rslora": before.get("use_rslora", False),
                  "loraplus_lr_ratio": before.get("loraplus_lr_ratio"),
                  "additional_target": before.get("additional_target", [])}
    if before != now:
        changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in dict.fromkeys([*before, *now])
                   if before.get(k) != now.get(k)]
        raise ArgumentError(f"resume: the checkpoint trained other parameters ({', '.join(changed)}): a resume "
                            "keeps the fine-tuning keys of its run; set them back, or start a new run_dir")


def lora_skeleton(c) -> nn.Module:
    """The LoRA model of a run on a model folder (lora.py's lora_skeleton), its adapters PiSSA's where
    pissa_init asks (c.pissa: the residual its base streams as)."""
    wrapped = _lora_skeleton(c)
    if c.pissa_init:
        c.pissa = pissa.initialise(wrapped, c)
    return wrapped


def lr_ratios(c):
    """AdamW's lr_ratios for the run: LoRA+ (loraplus_lr_ratio) as LlamaFactory groups it, each
    trained adapter's B and every other trained 1-D parameter (a DoRA magnitude, a bias) at lr x the
    ratio, the A matrices at lr; () for every other run."""
    if not adapters(c) or c.loraplus_lr_ratio is None:
        return ()
    ratio = float(c.loraplus_lr_ratio)

    def loraplus(model: nn.Module) -> dict[str, float]:
        return {n: ratio for n, p in model.named_parameters() if p.requires_grad and (".lora_B." in n or p.dim() == 1)}
    return loraplus


def apply(c, model: nn.Module, said: list[str] | None = None) -> nn.Module:
    """The module to train as c.finetuning_type says (the PEFT wrapper for lora; `model` itself,
    its requires_grad set, for freeze). On the meta device too: the names are checked there.
    `said`, when given, gets freeze's notes (what LlamaFactory's substring matching trains beyond
    the modules named) or LoRA's (what takes adapters), for the run to print once."""
    if c.finetuning_type == "lora":
        wrapped = with_adapters(model, c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_target,
                                base_dtype(c.compute_dtype), dora=c.use_dora, rslora=c.use_rslora,
                                whole=c.additional_target, initialised=not c.pissa_init,
                                parts=vision_freeze.adapted(c), said=said)
        if c.stage == "rm" and experts_adapted(wrapped):
            raise ArgumentError("stage rm writes the reward model with its adapters merged into the Linear weights "
                                "they sit on, and lora_target adapts the routed experts' fused weights too (PEFT's "
                                "target_parameters): leave the experts' projections out of lora_target (under all: "
                                "name the Linear modules)")
        vision_freeze.apply(c, wrapped)
        return wrapped
    if c.finetuning_type == "freeze":
        notes = freeze(model, c.freeze_trainable_layers, c.freeze_trainable_modules, c.freeze_extra_modules,
                       c.freeze_vision_tower, c.freeze_multi_modal_projector, c.freeze_language_model)
        if said is not None:
            said.extend(notes)
    vision_freeze.apply(c, model)
    return model


def _whole(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{key} must be a whole number >= {minimum}; got {value!r}")
    return value
