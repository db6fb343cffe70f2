"""`neftune_noise_alpha` (transformers' TrainingArguments key, in LlamaFactory's YAMLs and TRL's
SFTConfig): NEFTune, uniform noise on the input embeddings of every training forward, of magnitude
alpha / sqrt(seq x hidden), as transformers' Trainer adds it.

The hook is transformers' own (`integrations.neftune`), on the module the Trainer hooks (the input
embeddings; a PEFT model's base's). megacompile captures it with the forward, so each training
step draws its noise from the engine's random state, in the order eager draws it (the dropout
guarantee, docs/architecture.md); the held-out loss runs in eval mode, without noise, as the
Trainer's evaluation does. Null or 0 is off, as in transformers.

Stages sft and pt alone: TRL's preference trainers would noise the reference's log-probabilities
too where the reference is the policy with its adapters off (both run in training mode), which
this project's stages compute otherwise; the key is refused there rather than trained differently.
"""
from __future__ import annotations

from ..errors import ArgumentError
from .config_values import weight_or_off

KEY = "neftune_noise_alpha"
STAGES = ("sft", "pt")


def check(c) -> None:
    """The alpha read (None for null and 0), and refused where it would not mean what it does in transformers."""
    c.neftune_noise_alpha = weight_or_off(KEY, c.neftune_noise_alpha)
    if c.neftune_noise_alpha is None:
        return
    if c.bundled:
        raise ArgumentError(f"{KEY}: the bundled model is no Hugging Face model, whose input embeddings transformers "
                            f"noises; give a model folder, or leave {KEY} out")
    if c.stage not in STAGES:
        raise ArgumentError(f"{KEY} noises the input embeddings of sft and pt training; under stage {c.stage} the "
                            "reference's log-probabilities would be noised too where TRL takes them from the policy "
                            f"in training mode: leave {KEY} out")
    if c.accumulation == "layer":
        raise ArgumentError(f"{KEY} draws its noise in each micro-batch's forward, and accumulation: layer runs a "
                            "step's micro-batches block by block, which would draw other values than the Trainer's: "
                            "give accumulation: micro (or auto, which takes micro for it)")


def apply(c, model) -> None:
    """Hook NEFTune's noise onto `model`'s input embeddings (a transformers model, or a PEFT one), as
    transformers' Trainer does when it starts training; nothing without an alpha."""
    if c.neftune_noise_alpha is None:
        return
    from transformers.integrations.neftune import activate_neftune
    activate_neftune(model, c.neftune_noise_alpha)
