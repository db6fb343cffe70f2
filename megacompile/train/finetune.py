"""Which parameters a run trains: `finetuning_type` full, lora or freeze (LlamaFactory's keys).

    lora    the model wrapped by PEFT (LoraConfig + get_peft_model): the base weights frozen, only
            the adapters trained (fp32 masters and AdamW state for them alone); lora_target names
            the Linear modules (their last name: q_proj, ...) or `all`, every Linear of the
            decoder blocks (not lm_head).
    freeze  freeze_trainable_layers N: the last N decoder blocks trained (-N: the first N);
            freeze_trainable_modules: which modules of those blocks (all, or names);
            freeze_extra_modules: modules trained besides (embed_tokens, lm_head, norm).
    A vision-language model's freeze_vision_tower, freeze_multi_modal_projector and
    freeze_language_model freeze those parts on top of either (vision_freeze.py); LoRA's adapters
    go on its language model alone.

The keys are checked with the rest of run.yaml (check); the names they give are checked against
the model on the meta device (apply, before the data is read), and the same apply then shapes the
module the engine trains. Frozen weights stream to the device as any frozen weight does: no
master, no moments, no gradient offload.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..errors import ArgumentError
from . import vision_freeze

TYPES = ("full", "lora", "freeze")
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "merge_adapter")
FREEZE_KEYS = ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules")
ALL = "all"


def check(c, raw: dict) -> None:
    """run.yaml's fine-tuning keys on the RunConfig `c` (raw: the keys as given), in place."""
    if c.finetuning_type not in TYPES:
        raise ArgumentError(f"finetuning_type must be one of {', '.join(TYPES)}; got {c.finetuning_type!r}")
    for keys, kind in ((LORA_KEYS, "lora"), (FREEZE_KEYS, "freeze")):
        stray = [k for k in keys if raw.get(k) is not None and c.finetuning_type != kind]
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
        _peft("finetuning_type: lora")
    vision_freeze.check(c)


def saved(c) -> dict:
    """The keys that say which parameters train, kept in every checkpoint (merge_adapter aside:
    it shapes the export only)."""
    keys = {"full": (), "lora": LORA_KEYS[:-1], "freeze": FREEZE_KEYS}[c.finetuning_type]
    return {"finetuning_type": c.finetuning_type, **{k: getattr(c, k) for k in keys}, **vision_freeze.given(c)}


def check_resume(c, extra: dict) -> None:
    """A resume trains the parameters its checkpoint trained: other fine-tuning keys are refused
    (a checkpoint without them is of a full fine-tune)."""
    before, now = extra.get("finetuning") or {"finetuning_type": "full"}, saved(c)
    if before != now:
        changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in dict.fromkeys([*before, *now])
                   if before.get(k) != now.get(k)]
        raise ArgumentError(f"resume: the checkpoint trained other parameters ({', '.join(changed)}): a resume "
                            "keeps the fine-tuning keys of its run; set them back, or start a new run_dir")


def _peft(what: str) -> None:
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise ArgumentError(f"{what} needs the peft package: `pip install megacompile[lora]`") from e


def names(key: str, value: Any, allow_all: bool = True) -> list[str] | str:
    """A comma string or a list of module names, or `all`."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(v, str) and v.strip() for v in items):
        raise ArgumentError(f"{key} is a comma-separated string or a list of module names"
                            f"{' (or all)' if allow_all else ''}, e.g. q_proj,v_proj; got {value!r}")
    items = [v.strip() for v in items]
    if ALL in items:
        if not allow_all or len(items) > 1:
            raise ArgumentError(f"{key}: {'all is not taken here' if not allow_all else 'all stands alone'}; "
                                f"got {value!r}")
        return ALL
    return items


def apply(c, model: nn.Module) -> nn.Module:
    """The module to train as c.finetuning_type says (the PEFT wrapper for lora; `model` itself,
    its requires_grad set, for freeze). On the meta device too: the names are checked there."""
    if c.finetuning_type == "lora":
        wrapped = lora(model, c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_target, base_dtype(c.compute_dtype))
        vision_freeze.apply(c, wrapped)
        return wrapped
    if c.finetuning_type == "freeze":
        freeze(model, c.freeze_trainable_layers, c.freeze_trainable_modules, c.freeze_extra_modules)
    vision_freeze.apply(c, model)
    return model


def blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder blocks: the ModuleList of config.num_hidden_layers modules (else the longest)."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    wanted = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    fitting = [x for x in lists if len(x[1]) == wanted] or lists
    if not fitting:
        raise ArgumentError(f"{type(model).__name__} has no list of decoder blocks (an nn.ModuleList): "
                            "finetuning_type lora with lora_target all, and freeze, need one")
    return max(fitting, key=lambda x: len(x[1]))


def _language_blocks(model: nn.Module) -> nn.Module:
    """A vision-language model's decoder blocks: the longest list of modules in its language model."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
             and vision_freeze.part_of(n) == "freeze_language_model"]
    if not lists:
        raise ArgumentError(f"{type(model).__name__} has no language model with a list of decoder blocks: "
                            "finetuning_type lora with lora_target all needs one")
    return max(lists, key=lambda x: len(x[1]))[1]


def linear_names(model: nn.Module, within: nn.Module | None = None) -> list[str]:
    """The last names of the nn.Linear modules of `within` (default: the whole model)."""
    return sorted({n.rsplit(".", 1)[-1] for n, m in (within or model).named_modules() if isinstance(m, nn.Linear)})


def base_dtype(compute_dtype: str | torch.dtype) -> torch.dtype:
    """The dtype a LoRA run holds its frozen base in: bfloat16 compute reads the base in bfloat16
    only, so the host keeps it so (half the RAM, the same values on the device); float32 keeps
    it as it is."""
    return torch.bfloat16 if compute_dtype in ("bfloat16", torch.bfloat16) else torch.float32


def lora(model: nn.Module, rank: int, alpha: float, dropout: float, target: list[str] | str,
         base: torch.dtype = torch.float32, key: str = "lora_target") -> nn.Module:
    from peft import LoraConfig, get_peft_model
    everywhere = linear_names(model)
    vision = vision_freeze.is_vision_language(model)
    if target == ALL:
        target = ([n for n in linear_names(model, _language_blocks(model)) if n != "lm_head"] if vision else
                  linear_names(model, blocks(model)[1]))
    unknown = [t for t in target if t not in everywhere]
    if unknown:
        raise ArgumentError(f"{key}: {', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} no Linear "
                            f"module of {type(model).__name__}; its Linear modules are {', '.join(everywhere)} "
                            "(or all: every Linear of the decoder blocks)")
    modules = list(target)
    if vision:      # the language model's modules alone: the vision tower has q_proj and the like too
        modules = vision_freeze.language_model_names(model, modules)
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=modules)
    wrapped = get_peft_model(model, config)      # adapters in float32 (PEFT's autocast_adapter_dtype)
    for p in wrapped.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != base:
            p.data = p.data.to(base)
    return wrapped


def lora_skeleton(c) -> nn.Module:
    """The LoRA model of a run on a model folder: PEFT wraps the model built from config.json with
    its weights uninitialised (reserved, never touched), so the adapters are made as on the loaded
    model (the same random draws); then the base goes to meta, in the dtype it is held in, and
    streams from the folder's files into the host state, as a full fine-tune's weights do
    (engine/from_pretrained.py compile_folder with file_key)."""
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from ..io.hf_load import auto_class
    config = AutoConfig.from_pretrained(c.model)
    config.use_cache = False
    with no_init_weights():
        base = auto_class(config).from_config(config, dtype=torch.float32)
        base.tie_weights()
    wrapped = lora(base, c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_target)
    release_frozen(wrapped)
    held = base_dtype(c.compute_dtype)
    for p in wrapped.parameters():
        if p.is_meta and p.dtype != held:
            p.data = p.data.to(held)
    return wrapped


def file_key(key: str) -> str:
    """A PEFT model's state_dict key as the wrapped model's files name it."""
    key = key.removeprefix("base_model.model.")
    return key.replace(".base_layer.", ".")


def release_frozen(model: nn.Module) -> None:
    """The module's frozen weights to the meta device (a tied weight stays one parameter): their
    values are the engine's (host state), read there by lora_export."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and not p.is_meta:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                module._parameters[name] = moved[id(p)]


def lora_for_plan(model: nn.Module, rank: int, target: str, compute_dtype: torch.dtype) -> nn.Module:
    """`megacompile plan --lora-rank`: `model` (on meta) with LoRA adapters, as a run with
    run.yaml's defaults and this compute dtype holds it."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ArgumentError(f"--lora-rank must be a whole number >= 1; got {rank!r}")
    _peft("--lora-rank")
    return lora(model, rank, 2 * rank, 0.0, names("--lora-target", target), base_dtype(compute_dtype), "--lora-target")


def freeze(model: nn.Module, layers: int, modules: list[str] | str, extra: list[str]) -> None:
    prefix, stack = blocks(model)
    if abs(layers) > len(stack):
        raise ArgumentError(f"freeze_trainable_layers {layers}: {type(model).__name__} has {len(stack)} decoder "
                            f"blocks; give 1..{len(stack)} (the last N) or -{len(stack)}..-1 (the first N)")
    chosen = range(len(stack) - layers, len(stack)) if layers > 0 else range(-layers)
    trained = [f"{prefix}.{i}." for i in chosen]
    params = dict(model.named_parameters())
    in_blocks = {n: n[len(b):] for n in params for b in trained if n.startswith(b)}

    def has(path: str, module: str) -> bool:      # `module` as whole name components of `path`
        return f".{module}." in f".{path}"
    if modules != ALL:
        absent = [m for m in modules if not any(has(rel, m) for rel in in_blocks.values())]
        if absent:
            inside = sorted({n.rsplit(".", 1)[-1] for n, _ in stack[0].named_modules() if n})
            raise ArgumentError(f"freeze_trainable_modules: {', '.join(absent)} names no parameter of the decoder "
                                f"blocks; their modules are {', '.join(inside)} (or all)")
    absent = [m for m in extra if not any(has(n, m) for n in params)]
    if absent:
        outside = sorted({n.rsplit(".", 1)[-1] for n, _ in model.named_modules()
                          if n and not n.startswith(prefix + ".") and n != prefix})
        raise ArgumentError(f"freeze_extra_modules: {', '.join(absent)} names no parameter of "
                            f"{type(model).__name__}; modules outside the blocks are {', '.join(outside)}")
    for name, p in params.items():
        rel = in_blocks.get(name)
        block = rel is not None and (modules == ALL or any(has(rel, m) for m in modules))
        p.requires_grad_(block or any(has(name, m) for m in extra))


def _whole(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ArgumentError(f"{key} must be a whole number >= {minimum}; got {value!r}")
    return value
