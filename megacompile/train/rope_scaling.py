"""`rope_scaling` (LlamaFactory's key: linear, yarn or llama3): train past the positions the model
was trained with by stretching its rotary embedding, as LlamaFactory's configure_rope does.

Where `seq` (LlamaFactory's cutoff_len) is longer than the model's context (the rotary
parameters' original_max_position_embeddings where they have one, else max_position_embeddings),
the factor is ceil(seq / context), the model's config gets {rope_type, factor} (yarn and llama3
also the original context; llama3 LlamaFactory's low and high frequency factors, 1 and 4) over its
rope_theta, and max_position_embeddings becomes context x factor, before the model is built. A
seq within the context leaves the config as it is, as LlamaFactory does (the run says so). The
frequencies are a buffer of the built model, so the captured step trains what transformers'
scaled model computes, and the exported config.json carries the scaling (a LoRA adapter's base
is the model folder's: load it with the same rope parameters, or export with merge_adapter).

`dynamic` (NTK scaling that changes the frequencies with each batch's longest position) is
refused: the frequencies would depend on the data, which a captured step does not follow (and
LlamaFactory itself warns that it may not fine-tune well).
"""
from __future__ import annotations

import math

from ..errors import ArgumentError

KEY = "rope_scaling"
KINDS = ("linear", "yarn", "llama3")


def check(c) -> None:
    """The kind read (lower case), or refused."""
    value = c.rope_scaling
    if value is None:
        return
    kind = value.lower() if isinstance(value, str) else value
    if kind == "dynamic":
        raise ArgumentError(f"{KEY}: dynamic NTK scaling recomputes the rotary frequencies from each batch's longest "
                            "position, which a compiled training step cannot follow (LlamaFactory warns that it may "
                            f"not fine-tune well); give one of {', '.join(KINDS)}")
    if kind not in KINDS:
        raise ArgumentError(f"{KEY} is {value!r}; give one of {', '.join(KINDS)} (LlamaFactory's RoPE scalings), or "
                            "leave it out")
    if c.bundled:
        raise ArgumentError(f"{KEY}: the bundled model's positions are its own (no transformers config); give a "
                            f"model folder, or leave {KEY} out")
    if getattr(c, "generator", None) == "vllm":
        raise ArgumentError(f"{KEY}: vLLM builds the policy it samples from the model folder's config.json, whose "
                            "positions the run stretches; it would sample another model than the one trained: give "
                            f"generator: hf (use_vllm: false), or leave {KEY} out")
    c.rope_scaling = kind


def _context(config) -> int | None:
    """The positions the model was trained with: the rotary parameters' original context, else
    max_position_embeddings."""
    rope = getattr(config, "rope_parameters", None) or {}
    original = rope.get("original_max_position_embeddings") if isinstance(rope, dict) else None
    return original if isinstance(original, int) else getattr(config, "max_position_embeddings", None)


def scaled(config, c, source: str) -> tuple[dict, int] | None:
    """(the rope parameters, max_position_embeddings) `config` gets for the run's seq, or None
    where the run asks for no scaling or its seq is within the model's context."""
    if c.rope_scaling is None:
        return None
    rope = getattr(config, "rope_parameters", None)
    context = _context(config)
    if getattr(config, "vision_config", None) is not None or not isinstance(rope, dict) or "rope_type" not in rope \
            or not isinstance(context, int):
        kind = getattr(config, "model_type", type(config).__name__)
        why = ("its rotary parameters are per layer type" if isinstance(rope, dict) and "rope_type" not in rope
               else "it is a vision-language model, whose positions are its text model's (multimodal RoPE)"
               if getattr(config, "vision_config", None) is not None else "it has no rotary parameters")
        raise ArgumentError(f"{KEY} {c.rope_scaling}: the {kind} model of {source} cannot be scaled so: {why}; leave "
                            f"{KEY} out")
    if c.seq <= context:
        return None
    factor = float(math.ceil(c.seq / context))
    new = {k: rope[k] for k in ("rope_theta", "partial_rotary_factor") if k in rope}
    new |= {"rope_type": c.rope_scaling, "factor": factor}
    if c.rope_scaling in ("yarn", "llama3"):
        new["original_max_position_embeddings"] = context
    if c.rope_scaling == "llama3":
        new |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return new, int(context * factor)


def edit(config, c, source: str) -> None:
    """The run's scaling into `config` (a transformers PretrainedConfig, changed in place); nothing
    where scaled() says none."""
    found = scaled(config, c, source)
    if found is not None:
        config.rope_parameters, config.max_position_embeddings = found


def note(c) -> str | None:
    """The line a run prints of its scaling, read from the model's config as its folder has it."""
    if c.rope_scaling is None:
        return None
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(c.model)
    found = scaled(config, c, c.model)
    context = _context(config)
    if found is None:
        return (f"  note           {KEY} {c.rope_scaling}: seq {c.seq:,} is within the model's {context:,} positions, "
                "so its rotary embedding is left as it is (as LlamaFactory leaves it)")
    return (f"  rope           {c.rope_scaling} scaling, factor {found[0]['factor']:g}: seq {c.seq:,} over the model's "
            f"{context:,} positions; max_position_embeddings {found[1]:,}")
