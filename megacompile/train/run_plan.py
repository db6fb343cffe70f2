"""`megacompile plan --run run.yaml`: the step a run would take, planned before the run, on any machine.

The model is the one `megacompile train` builds, on the meta device: its config as the run edits it
(rope_scaling, added tokens, the router's loss), checked against the stage as the run checks it
(seq against the positions, isolated packing), shaped by the fine-tuning method (LoRA's
adapters, frozen layers, a vision tower held still), and under dft or eaft inside the objective the
run trains, with the routers' loss inside the term's wrapper (router_loss.WholeTerm, with its rows'
attention_mask and scale); under stage rm the reward model the run trains (the decoder under a one-number score,
without the lm_head), planned on the rows the run scores. The settings are the run's: its rows and
width, its micro-batch and accumulation or its global batch, its dtype, its budgets, its stage's
keys. Nothing is read of the weights, and nothing of the run is written. The data is read only
where the run gives epochs, not steps: the stage reads and tokenises it as the run would, in a
temporary folder removed after, to count the optimizer steps of those epochs.

A vision-language run's images per row and their size are read from its data (run_images.py),
unless the command's flags give them. A run's rows are planned at `seq` tokens, the width every
micro-batch is padded or packed to.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from ..errors import ArgumentError
from . import methods, rope_scaling, router_loss, vocab
from .config import RunConfig
from .model import meta_model
from .stages import kind, open_stage

POST_TRAINING = ("dpo", "kto", "rm", "grpo")
# run.yaml's keys of each post-training stage that the stage's plan reads (planner/posttrain_step.py)
STAGE_KEYS = {"dpo": ("precompute_ref_log_probs", "loss_type", "sync_ref_model"),
              "kto": ("loss_type",),
              "rm": (),
              "grpo": ("num_generations", "max_prompt_length", "max_completion_length", "num_iterations",
                       "steps_per_generation", "beta", "generator")}
# run.yaml's generator -> the plan's name for it
GENERATORS = {"engine": "engine", "hf": "kv_cache", "hf_streamed": "hf_streamed"}


@dataclass
class RunPlan:
    """What `megacompile plan` plans for a run: the model (on meta) and the run's settings."""
    model: nn.Module
    stage: str                          # sft and pt plan one training step; the others, plan_stage's parts
    compute_dtype: str
    seq: int
    batch: int                          # rows per micro-batch (dpo, rm: preference pairs)
    grad_accum: int
    global_batch: int | None            # the planner chooses batch x grad_accum
    accumulation: str
    updates: str
    hbm_budget: float | None            # None: the card's share, as a run on it takes
    host_budget: float | None           # None: this machine's share
    nvme_budget: float | None
    steps: int                          # optimizer steps: given, or the epochs' (epoch_steps)
    epochs: float | None                # the run's epochs, where it gives them in place of steps
    stage_keys: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # the module the run's engine trains in place of `model` (stage rm's reward model: the decoder
    # under a one-number score, no lm_head; the routers' whole term under sft and pt), and its inputs
    # from the model's rows (plan_stage's)
    trained: nn.Module | None = None
    inputs: Callable[[dict, bool], dict] | None = None


def resolve(c: RunConfig) -> RunPlan:
    """The model and settings `c` (a loaded run.yaml) plans with, checked as `megacompile train`
    checks them before it reads its data."""
    if c.bundled:
        raise ArgumentError("model: bundled is the small Llama `megacompile train` runs on this machine's own budget; "
                            "plan --run plans a Hugging Face model folder or config: give model: PATH")
    meta = meta_model(c)
    notes = list(vocab.resolve(c, meta))
    if c.grown is not None:
        meta = meta_model(c)      # built again with the grown vocabulary
    kind(c).check_model(c, meta)
    notes += [said for said in (router_loss.note(c, meta), rope_scaling.note(c)) if said]
    said: list[str] = []
    model = methods.apply(c, meta, said)
    notes += [f"  note           {note}" for note in said]
    if c.stage == "sft" and c.loss_type in ("dft", "eaft"):
        # the weighted loss reads the whole logits (no fused cross-entropy): the run's objective
        from ..posttrain import DFTObjective, EAFTObjective
        model = DFTObjective(model) if c.loss_type == "dft" else EAFTObjective(model, c.eaft_alpha)
    keys: dict[str, Any] = {}
    if c.stage in POST_TRAINING:
        if c.global_batch is not None:
            raise ArgumentError(f"plan --run plans stage {c.stage}'s step one micro-batch at a time: give batch and "
                                "grad_accum rather than global_batch")
        keys = {k: getattr(c, k) for k in STAGE_KEYS[c.stage] if getattr(c, k) is not None}
        if c.stage == "grpo":     # TRL's generation batch: batch x steps_per_generation rows, num_generations a prompt
            if c.generator == "vllm":
                raise ArgumentError("use_vllm: vLLM's share of the device is vLLM's own to size: plan --run plans "
                                    "the engine's generators; give generator: hf (a copy with a key-value cache, "
                                    "what vLLM holds too) in place of use_vllm to plan the run's step")
            keys["generator"] = GENERATORS[c.generator]
            keys["prompts"] = c.batch * c.steps_per_generation // c.num_generations
    trained = inputs = None
    if c.stage == "rm":       # the run trains the model's reward model (stages/rm.py), not its causal LM
        from .stages.rm import planned_rows, reward_model
        trained, inputs = reward_model(c, model), planned_rows
    elif c.stage in router_loss.STAGES and c.loss_type not in ("dft", "eaft") and router_loss.on(model):
        # the routers' term whole in each micro-batch's loss, over rows that carry an attention_mask
        # (stages/sft.py: WholeTerm), as the run trains it
        trained, inputs = router_loss.WholeTerm(model), router_loss.planned_rows(c.packing != "isolated")
    steps = c.steps if c.steps is not None else epoch_steps(c, model)
    return RunPlan(model=model, stage=c.stage, compute_dtype=c.compute_dtype, seq=c.seq, batch=c.batch,
                   grad_accum=c.grad_accum, global_batch=c.global_batch, accumulation=c.accumulation,
                   updates=c.updates, hbm_budget=c.hbm_budget, host_budget=c.host_budget, nvme_budget=c.nvme_budget,
                   steps=steps, epochs=c.epochs, stage_keys=keys, notes=notes, trained=trained, inputs=inputs)


def cpu_budget(c: RunConfig, run: RunPlan, images_per_row: int | None = None, image_size: int | None = None) -> float:
    """GiB a run on the cpu backend takes without hbm_budget, as it takes it (model.device_budget):
    budget_fraction of the trained module's weights in the compute dtype, so that it streams, and
    never less than 1.02 x the smallest plan of its first micro-batch (a preference pair's two rows
    each, a grpo micro-batch of rollouts; the reward model on the rows it scores), its rows holding
    the images the plan plans (`images_per_row` of `image_size` px: the heaviest its data shows).
    kto's KL rows, which the run sizes the budget for too, are not looked at here."""
    import torch
    from ..planner import minimum_budget
    from ..settings import Settings
    dtype = getattr(torch, c.compute_dtype)
    module = run.trained if run.trained is not None else run.model
    weight_bytes = sum(p.numel() * dtype.itemsize for p in module.parameters())
    rows = 1 if c.global_batch else c.batch
    rows, width = (2 * rows if c.stage in ("dpo", "rm") else rows,
                   c.max_prompt_length + c.max_completion_length if c.stage == "grpo" else c.seq)
    settings = Settings(compute_dtype=dtype, grad_accum=1 if c.global_batch else c.grad_accum,
                        accumulation=c.accumulation, updates=c.updates)
    if run.inputs is not None:
        ids = torch.empty(rows, width, dtype=torch.long, device="meta")
        smallest = minimum_budget(module, settings=settings, hardware="cpu", inputs=run.inputs(
            {"input_ids": ids, "labels": ids}, True))
    else:
        images = dict(images_per_row=images_per_row, image_size=image_size) if images_per_row or image_size else {}
        smallest = minimum_budget(module, settings=settings, hardware="cpu", batch=rows, seq=width, **images)
    return max(weight_bytes * c.budget_fraction / 2**30, smallest * 1.02)


def epoch_steps(c: RunConfig, model: nn.Module) -> int:
    """The optimizer steps `c`'s epochs make of its data, as `megacompile train` counts them: the
    stage reads its records (max_samples, the held-out split, packing) into a run folder in the
    temporary directory (TMPDIR), removed with what the stage made there; a grpo run's prompts are
    counted from its records (its reward functions are not loaded)."""
    if c.stage == "grpo":
        from .stages.grpo_keys import epoch_steps as grpo_steps, training_prompts
        return grpo_steps(c, training_prompts(c), c.epochs)
    with tempfile.TemporaryDirectory(prefix="megacompile-plan-") as folder:
        stage = open_stage(c, os.path.join(folder, "run"), model)
        try:
            return stage.steps_for(c.epochs)
        finally:
            stage.discard()
            stage.close()
