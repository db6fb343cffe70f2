"""What a run changes in the model folder's config before its model is built, in one place for
every way the model is built (on meta for the plan, from the folder's weights, under LoRA's
adapters): the routers' load-balancing loss (router_loss.py), RoPE scaling (rope_scaling.py) and
a vocabulary grown by the tokens the run adds (vocab.py: the rows themselves arrive with the
weights, io/grown_vocab.py)."""
from __future__ import annotations

from . import rope_scaling, router_loss


def edited(c) -> bool:
    """Whether the run changes the model's config at all."""
    return c.moe_aux_loss_coef is not None or c.rope_scaling is not None or c.grown is not None


def edit(config, c) -> None:
    """The run's changes into `config` (a transformers PretrainedConfig, changed in place)."""
    router_loss.edit(config, c, c.model)
    rope_scaling.edit(config, c, c.model)
    if c.grown is not None:     # a vision-language model's vocabulary is its text model's
        config.get_text_config().vocab_size = c.grown.rows
