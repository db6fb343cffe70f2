"""finetuning_type: lora: PEFT's adapters on the Linear modules lora_target names (in a
vision-language model, those of the parts the freeze_* keys leave to adapt: vision_freeze.adapted),
and on a mixture-of-experts' routed experts, whose projections are fused 3-D weights in
transformers 5 (PEFT's target_parameters, as PEFT turns the projections' names onto them); the base
frozen and held in the dtype compute reads."""
from __future__ import annotations

import math
import re
import warnings

import torch
import torch.nn as nn

from ...errors import ArgumentError
from .. import model_config
from . import vision_freeze
from .freeze import blocks
from .lora_experts import (WRAPPERS, check_expert_settings, family, fused_weights, refuse_collision,
                           refuse_unknown, whose, expert_weights, pre_fusion)
from .names import ALL, names


def require_peft(what: str) -> None:
    try:
        import peft  # noqa: F401
    except ImportError as e:
        raise ArgumentError(f"{what} needs the peft package: `pip install megacompile[lora]`") from e


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


def with_adapters(model: nn.Module, rank: int, alpha: float, dropout: float, target: list[str] | str,
                  base: torch.dtype = torch.float32, key: str = "lora_target", dora: bool = False,
                  rslora: bool = False, whole: list[str] = (), initialised: bool = True,
                  parts: frozenset[str] = vision_freeze.LANGUAGE_ONLY,
                  said: list[str] | None = None) -> nn.Module:
    """`model` wrapped by PEFT's LoRA on the Linear modules `target` names (of a vision-language
    model, those of `parts`, vision_freeze's keys; `all`: the decoder blocks' Linear modules, and
    the tower's where it is among the parts), and on the routed experts' fused weights its names
    stand for (expert_weights: PEFT's target_parameters); `whole` (run.yaml's
    additional_target): modules trained whole beside the adapters, PEFT's modules_to_save (a
    trained copy of each module whose name ends with one of them; the original stays frozen).
    initialised=False: the adapters are left as their Linear modules made them, to be set by the
    caller (PiSSA's, which PEFT makes without LoRA's own initialisation and its random draws).
    `said`, when given, gets what takes adapters (adapted_line) and what `all` leaves out."""
    from peft import LoraConfig, get_peft_model
    _check_whole(model, whole, target)
    everywhere = linear_names(model)
    vision = vision_freeze.is_vision_language(model)
    experts = {} if vision else expert_weights(model, target, key)
    mapping = pre_fusion(model) if experts else {}
    given = target
    if target == ALL and vision:
        found = set(vision_freeze.tower_linear_names(model)) if vision_freeze.TOWER in parts else set()
        if vision_freeze.LANGUAGE in parts:
            found |= {n for n in linear_names(model, _language_blocks(model)) if n != "lm_head"}
        target = sorted(found)
    elif target == ALL:
        target = linear_names(model, blocks(model)[1])
    unknown = [t for t in target if t not in everywhere and not (t in mapping and mapping[t] in experts)]
    if unknown:
        refuse_unknown(model, key, unknown, everywhere, vision)
    modules = [t for t in target if t in everywhere]
    # PEFT turns the experts' projections' names onto the fused weights alone, even where they name
    # Linear modules too (a shared expert's, a dense MLP layer's): `all` leaves those out as PEFT's
    # all-linear does; a list naming them asks for both, which one adapter cannot hold
    colliding = sorted(t for t in modules if t in mapping)
    if colliding and given != ALL:
        refuse_collision(model, key, target, colliding)
    modules = [t for t in modules if t not in colliding]
    if vision:      # the parts' modules alone: the vision tower has q_proj and the like too
        modules = vision_freeze.adapted_names(model, modules, parts)
        if not modules:
            words = " and ".join(vision_freeze.WORDS[p] for p in sorted(parts))
            raise ArgumentError(f"{key}: {', '.join(target)} name no Linear module of {words}, the parts that take "
                                "adapters here: adapters go on the language model unless freeze_language_model is "
                                "true, on the vision tower where freeze_vision_tower is false, on the projector where "
                                "freeze_multi_modal_projector is false")
    if experts:
        check_expert_settings(key, experts, dropout, dora, initialised)
    # Each fused weight at the rank and alpha PEFT gives it when it turns the projections' names onto
    # it (its transformers_weight_conversion): gate_up_proj, two projections, at twice each.
    patterns = {rf".*\.{re.escape(w)}": n for w, n in experts.items() if n > 1}
    config = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=modules, target_parameters=sorted(experts) or None,
                        rank_pattern={p: n * rank for p, n in patterns.items()},
                        alpha_pattern={p: n * alpha for p, n in patterns.items()}, use_dora=dora,
                        use_rslora=rslora, modules_to_save=list(whole) or None, init_lora_weights=initialised)
    with warnings.catch_warnings():
        # PEFT reads transformers' deprecated is_gradient_checkpointing: a warning between the two
        # libraries, which says nothing a run could change
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        # PEFT matches rank_pattern against module names alone when it checks it, and says so of the
        # fused weights' patterns, which it applies to them
        warnings.filterwarnings("ignore", message="The following (rank|alpha)_pattern keys did not match",
                                category=RuntimeWarning)
        wrapped = get_peft_model(model, config)      # adapters in float32 (PEFT's autocast_adapter_dtype)
    if said is not None:
        if colliding:
            said.append(f"{key} all leaves out the Linear modules {', '.join(colliding)} "
                        f"{whose(model, colliding)}: PEFT turns these names of {family(model)} onto the routed "
                        f"experts' fused weights ({', '.join(fused_weights(model, colliding))}) alone, as its "
                        "all-linear does, so they take no adapter")
        said.append(adapted_line(wrapped, key))
    for p in wrapped.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != base:
            p.data = p.data.to(base)
    return wrapped


def adapted_line(wrapped: nn.Module, key: str) -> str:
    """What takes adapters, in one line: the Linear modules by last name, the routed experts' fused
    weights with their rank (gate_up_proj's doubled), and the trainable parameters in all."""
    linear = sorted({n.rsplit(".", 1)[-1] for n, m in wrapped.named_modules()
                     if hasattr(m, "lora_A") and not hasattr(m, "parameter_name")})
    fused = {m.parameter_name: m.r[next(iter(m.r))] for m in wrapped.modules()
             if hasattr(m, "parameter_name") and hasattr(m, "lora_A") and m.r}
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    experts = ", ".join(f"{w} (rank {r})" for w, r in sorted(fused.items()))
    return (f"{key}: adapters on {', '.join(linear) or 'no Linear module'}"
            + (f" and the routed experts' fused {experts}" if experts else "") + f": {trained:,} trainable parameters")


def _check_whole(model: nn.Module, whole: list[str], target: list[str] | str) -> None:
    """additional_target's names against the model, before PEFT matches them (by the end of a
    module's name, as it matches modules_to_save)."""
    modules = [n for n, _ in model.named_modules() if n]
    unknown = [w for w in whole if not any(n.endswith(w) for n in modules)]
    if unknown:
        tops = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if n and not len(m._modules)}
                      - set(linear_names(model)))
        raise ArgumentError(f"additional_target: {', '.join(unknown)} names no module of {type(model).__name__} (a "
                            f"module trained whole is named by the end of its name, e.g. embed_tokens, lm_head; its "
                            f"modules that are not Linear end in {', '.join(tops)})")
    both = [w for w in whole if target != ALL and w in target]
    if both:
        raise ArgumentError(f"additional_target: {', '.join(both)} {'is' if len(both) == 1 else 'are'} in lora_target "
                            "too: a module takes adapters or trains whole, not both; leave it out of one of them")


def whole_copies(wrapped: nn.Module, folder: str, grown=None) -> None:
    """The trained copy of each module additional_target names (PEFT's modules_to_save) starts as
    the module; the skeleton's base is uninitialised, so each copy is read from the folder's files,
    one tensor at a time, in float32 (as transformers loads it in a float32 model). grown: the
    run's grown vocabulary (io/grown_vocab.py), whose rows a copy gets."""
    from peft.utils import ModulesToSaveWrapper
    from safetensors import safe_open
    from ...io.hf_load import shard_map
    wanted: dict[str, list[torch.Tensor]] = {}
    for name, module in wrapped.named_modules():
        if isinstance(module, ModulesToSaveWrapper):
            for copy in module.modules_to_save.values():
                for leaf, t in copy.named_parameters():
                    wanted.setdefault(file_key(f"{name}.{leaf}"), []).append(t)      # the module's own name
    for path, keys in shard_map(folder).items():
        with safe_open(path, framework="pt", backend="pread") as f:
            for key in (keys if keys is not None else f.keys()):
                for t in wanted.pop(key, ()):
                    value = f.get_tensor(key)
                    if grown is not None and key in grown.keys:
                        value = grown.grow(key, value)
                    with torch.no_grad():
                        t.copy_(value.to(t.dtype))
    if wanted:
        raise ArgumentError(f"additional_target: {folder} holds no {next(iter(wanted))}, which the module trained whole "
                            "starts from (a weight tied to another is not in the files: name the module that owns it)")


def lora_skeleton(c) -> nn.Module:
    """The LoRA model of a run on a model folder: PEFT wraps the model built from config.json with
    its weights uninitialised (reserved, never touched), so the adapters are made as on the loaded
    model (the same random draws); then the base goes to meta, in the dtype it is held in, and
    streams from the folder's files into the host state, as a full fine-tune's weights do
    (engine/from_pretrained.py compile_folder with file_key)."""
    from transformers import AutoConfig
    from transformers.initialization import no_init_weights
    from ...io.hf_load import auto_class
    config = AutoConfig.from_pretrained(c.model)
    config.use_cache = False
    model_config.edit(config, c)
    with no_init_weights():
        base = auto_class(config).from_config(config, dtype=torch.float32)
        base.tie_weights()
    wrapped = with_adapters(base, c.lora_rank, c.lora_alpha, c.lora_dropout, c.lora_target, dora=c.use_dora,
                            rslora=c.use_rslora, whole=c.additional_target, initialised=not c.pissa_init,
                            parts=vision_freeze.adapted(c))
    if c.use_dora:
        dora_magnitudes(wrapped, c.model)
    if c.additional_target:
        whole_copies(wrapped, c.model, c.grown)
    release_frozen(wrapped)
    held = base_dtype(c.compute_dtype)
    for p in wrapped.parameters():
        if p.is_meta and p.dtype != held:
            p.data = p.data.to(held)
    return wrapped


def dora_magnitudes(wrapped: nn.Module, folder: str) -> None:
    """DoRA's magnitudes start as the norm of each output's row of the weight they sit beside (its
    adapter adds nothing yet), which PEFT computes from the weights it wraps; the skeleton's base
    is uninitialised, so each norm is taken from the folder's file, one weight at a time, in float32
    (the weight as transformers loads it in a float32 model)."""
    from safetensors import safe_open
    from ...io.hf_load import shard_map
    wanted = {}
    for name, module in wrapped.named_modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if magnitudes is not None and len(magnitudes):
            wanted[file_key(f"{name}.base_layer.weight")] = [m.weight for m in magnitudes.values()]
    for path, keys in shard_map(folder).items():
        with safe_open(path, framework="pt", backend="pread") as f:
            for key in (keys if keys is not None else f.keys()):
                for magnitude in wanted.pop(key, ()):
                    with torch.no_grad():
                        magnitude.copy_(torch.linalg.norm(f.get_tensor(key).float(), dim=1))
    if wanted:
        raise ArgumentError(f"use_dora: {folder} holds no {next(iter(wanted))}, whose norm DoRA's magnitude starts from")


def file_key(key: str) -> str:
    """A PEFT model's state_dict key as the wrapped model's files name it."""
    key = key.removeprefix("base_model.model.")
    # an experts module holds one wrapper per adapted weight: .base_layer.base_layer.gate_up_proj
    return WRAPPERS.sub(".", key).replace(".original_module.", ".")




def scaling(config) -> float:
    """The factor on an adapter's B A under a PEFT LoraConfig: lora_alpha / r, or with rank-stabilised
    LoRA (use_rslora) lora_alpha / sqrt(r)."""
    return config.lora_alpha / (math.sqrt(config.r) if config.use_rslora else config.r)


def transposed(model: nn.Module) -> frozenset[str]:
    """The names of `model`'s LoRA layers over a weight held (in, out), as GPT-2's Conv1D holds it
    (PEFT's fan_in_fan_out): their B A is added transposed."""
    return frozenset(name for name, m in model.named_modules()
                     if hasattr(m, "lora_A") and getattr(m, "fan_in_fan_out", False) is True)


def merged(state: dict[str, torch.Tensor], scaling: float, transposed: frozenset[str] = frozenset()
           ) -> dict[str, torch.Tensor]:
    """A PEFT-wrapped module's state_dict with each adapter added into its base weight,
    W + scaling B A (in float32), under the base model's names (no `base_layer`, no adapters). With
    DoRA's magnitude m beside it, that sum is scaled row by row to m: m / ||W + s B A|| (each
    output's norm over its inputs), as PEFT's merge does. The layers named in `transposed`
    (transposed(model)) hold W as (in, out): the sum and the norms are taken on W's transpose."""
    adapter = (".lora_A.", ".lora_B.", ".lora_magnitude_vector.")
    out = {k.replace(".base_layer.", "."): t for k, t in state.items() if not any(a in k for a in adapter)}
    for key, a in state.items():
        if ".lora_A." in key:
            owner, name = key.split(".lora_A.")
            weight = owner + ".weight"
            b = state[key.replace(".lora_A.", ".lora_B.")]
            flip = owner in transposed
            w = out[weight].float().T if flip else out[weight].float()        # (out, in)
            w = w + scaling * (b.float() @ a.float())
            magnitude = state.get(f"{owner}.lora_magnitude_vector.{name}")
            if magnitude is not None:
                w = w * (magnitude.float() / w.norm(dim=1)).unsqueeze(1)
            out[weight] = w.T.contiguous() if flip else w
    return out


def release_frozen(model: nn.Module) -> None:
    """The module's frozen weights to the meta device (a tied weight stays one parameter): their
    values are the engine's (host state), read there by io/lora_save.py."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and not p.requires_grad and not p.is_meta:
                if id(p) not in moved:
                    moved[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                module._parameters[name] = moved[id(p)]


def lora_for_plan(model: nn.Module, rank: int, target: str, compute_dtype: torch.dtype,
                  said: list[str] | None = None) -> nn.Module:
    """`megacompile plan --lora-rank`: `model` (on meta) with LoRA adapters, as a run with
    run.yaml's defaults and this compute dtype holds it (`said`: with_adapters' notes)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ArgumentError(f"--lora-rank must be a whole number >= 1; got {rank!r}")
    require_peft("--lora-rank")
    return with_adapters(model, rank, 2 * rank, 0.0, names("--lora-target", target), base_dtype(compute_dtype),
                         "--lora-target", said=said)
