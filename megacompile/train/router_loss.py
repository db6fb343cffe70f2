"""`moe_aux_loss_coef` (LlamaFactory's key): a mixture-of-experts model trains with its routers'
load-balancing loss added to the language-model loss, at this coefficient.

transformers' MoE models compute that loss themselves where their config asks for it
(`output_router_logits`), times the config's `router_aux_loss_coef`, and add it to the loss their
forward returns with labels; megacompile captures it with exact gradients (docs/families.md). The
key sets those two fields of the config before the model is built, as LlamaFactory does (a
vision-language model's are its text_config's), so the config.json an export writes says what was
trained. Null or 0 leaves the folder's config.json as it is, as in LlamaFactory.

Stages sft and pt train the model's own loss, which holds the term. Their steps weigh each
micro-batch by its share of the step's target tokens (as the Trainer's num_items_in_batch does),
and the Trainer adds each micro-batch's router term whole beside it: with k micro-batches a step
trains k times the coefficient times their mean term. `WholeTerm` keeps that: the step hands each
micro-batch 1/weight (`SCALE`), and the term is scaled by it inside the loss, so weighted it is
whole again (one micro-batch a step: a scale of 1, the model's loss as it is). Its statistics count the tokens
the attention_mask marks: where the term is on, the rows carry one (0 on a row's padding, as
LlamaFactory's collator pads), so padding is neither routed into the load-balancing statistics nor
averaged over. The preference and RL stages
train an objective of the logits alone, as LlamaFactory's trainers of them do; the key is refused
there rather than taken and left without effect.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..errors import ArgumentError
from .config_values import weight_or_off

KEY = "moe_aux_loss_coef"
STAGES = ("sft", "pt")      # the stages whose loss is the model's own, the routers' term in it


def check(c) -> None:
    """The coefficient read (None for null and 0: the config's own), and refused where no loss takes it."""
    c.moe_aux_loss_coef = weight_or_off(KEY, c.moe_aux_loss_coef)
    if c.moe_aux_loss_coef is None:
        return
    if c.bundled:
        raise ArgumentError(f"{KEY}: the bundled model has no experts, so no router loss; leave {KEY} out")
    if c.stage not in STAGES:
        raise ArgumentError(f"{KEY} adds the routers' load-balancing loss to the language-model loss, which stages "
                            f"sft and pt train; stage {c.stage} trains its objective from the logits alone (as "
                            f"LlamaFactory's DPO, KTO and reward-model trainers do, whatever {KEY} says): leave {KEY} "
                            "out")
    if c.eval_batch is not None and (c.global_batch is not None or c.eval_batch != c.batch):
        raise ArgumentError(f"{KEY} with eval_batch (per_device_eval_batch_size) {c.eval_batch}: the held-out loss "
                            "holds the routers' term over an eval batch's tokens, and the engine computes it over a "
                            "micro-batch of batch rows; give eval_batch equal to batch"
                            + (" (and batch with grad_accum rather than global_batch)" if c.global_batch else "")
                            + ", or leave it out")


def edit(config, c, source: str) -> None:
    """Turn the router loss on in `config` (a transformers PretrainedConfig, changed in place) at the
    run's coefficient; nothing without one. `source` names the config in the refusal."""
    coef = c.moe_aux_loss_coef
    if coef is None:
        return
    holder = config if hasattr(config, "router_aux_loss_coef") else getattr(config, "text_config", None)
    if holder is None or not hasattr(holder, "router_aux_loss_coef") or not hasattr(holder, "output_router_logits"):
        kind = getattr(config, "model_type", type(config).__name__)
        raise ArgumentError(f"{KEY} {coef:g}: the {kind} model of {source} computes no router load-balancing loss "
                            "in transformers (its config has no router_aux_loss_coef): a dense model routes nothing, "
                            "and some MoE families balance their experts otherwise (DeepSeek-V3's score-correction "
                            f"bias); leave {KEY} out")
    holder.output_router_logits = True
    holder.router_aux_loss_coef = coef


def _holder(model):
    """The config that says whether the routers' loss is computed (a VLM's text_config), or None."""
    config = getattr(model, "config", None)
    return config if hasattr(config, "output_router_logits") else getattr(config, "text_config", None)


def on(model) -> bool:
    """Whether `model`'s own loss holds the routers' load-balancing term (its config asks for it,
    or the run's moe_aux_loss_coef turned it on): its rows then carry an attention_mask."""
    return bool(getattr(_holder(model), "output_router_logits", False))


def note(c, model) -> str | None:
    """The line a run prints where the model's loss would hold the router term and the objective
    leaves it out (None elsewhere): a stage of the logits alone (TRL's DPOTrainer would add the
    term), or the DFT loss (TRL's and LlamaFactory's leave it out too), said rather than left to be
    found."""
    if not on(model):
        return None
    if c.stage in STAGES and getattr(c, "loss_type", None) in ("dft", "eaft"):
        return (f"  note           loss_type {c.loss_type} trains its loss from the logits alone, so the routers' "
                f"load-balancing term is not trained (as LlamaFactory's {c.loss_type.upper()} loss leaves it out)")
    if c.stage in STAGES:
        return None
    return (f"  note           the model's config asks for the routers' load-balancing loss (output_router_logits); "
            f"stage {c.stage} trains its objective from the logits alone (as LlamaFactory's DPO, KTO and reward-model "
            "trainers do), so the term is not trained (TRL's DPO and KTO trainers add it)")


SCALE = "router_scale"     # the input WholeTerm takes: 1 / the micro-batch's weight in its step


def planned_rows(masked: bool):
    """The inputs WholeTerm takes in place of a causal LM's `rows` (input_ids and labels on the meta
    device, as the planner lays them out): its router_scale, and the attention_mask where the rows
    carry one (not under isolated packing)."""
    def rows_of(rows: dict, train: bool) -> dict:
        ids = rows["input_ids"]
        mask = {"attention_mask": torch.empty(ids.shape, dtype=torch.long, device=ids.device)} if masked else {}
        # in the order a micro-batch gives them (stages/sft.py): the rows', the mask, the scale
        return {**rows, **mask, SCALE: torch.empty((), dtype=torch.float32, device=ids.device)}
    return rows_of


class WholeTerm(nn.Module):
    """A mixture-of-experts causal LM whose loss holds its routers' term, for a step that weighs its
    micro-batches (Engine.weighted_step): forward(router_scale, **inputs) -> the model's output, its
    loss the language-model loss plus the term times router_scale, so that weighted by 1/router_scale
    the micro-batch adds its whole term (module docstring). The rest of the output is the model's."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.coef = float(_holder(policy).router_aux_loss_coef)

    def forward(self, router_scale: torch.Tensor, **inputs):
        out = self.policy(**inputs)
        if getattr(out, "aux_loss", None) is not None:     # else the model added no term to its loss
            out["loss"] = out.loss + (router_scale - 1) * self.coef * out.aux_loss
        return out
