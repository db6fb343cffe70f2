"""The run's model and engine: the bundled small Llama, a Hugging Face folder's weights
(megacompile.from_pretrained), or a Hugging Face config trained from scratch; its device budget
and, for global_batch, the micro-batch and accumulation the planner chooses."""
from __future__ import annotations

import inspect
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..engine import Engine
from ..errors import ArgumentError, BudgetTooSmallError
from ..optim import AdamW
from .config import RunConfig

GiB = 2 ** 30


@dataclass
class Setup:
    engine: Engine
    batch: int
    grad_accum: int
    shifted: bool      # labels already shifted (the bundled model) or shifted inside (Hugging Face)
    weight_bytes: int


def _hf_weights(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("model.safetensors", "model.safetensors.index.json"))


def meta_model(c: RunConfig) -> nn.Module:
    """The model on the meta device, for planning: no weight memory."""
    if c.bundled:
        from ..models import LlamaConfig, TinyLlama
        with torch.device("meta"):
            return TinyLlama(LlamaConfig(**c.bundled_model))
    from ..planner.from_config import model_from_config
    return model_from_config(c.model)


def check_isolation(model: nn.Module) -> None:
    """`isolated` packing is exact only where the model builds its causal mask from the
    position ids (transformers' create_causal_mask detects the restarts and makes it block
    diagonal); any other model is refused rather than trained across document borders."""
    inner = getattr(model, "model", model)
    module = sys.modules.get(type(inner).__module__)
    takes_positions = "position_ids" in inspect.signature(model.forward).parameters
    source = inspect.getsource(module) if module is not None and takes_positions else ""
    if not takes_positions or "create_causal_mask" not in source:
        raise ArgumentError(f"packing: isolated needs a decoder that masks attention by its position ids "
                            f"(transformers' create_causal_mask); {type(model).__name__} does not, so packed "
                            "documents would attend to each other; use packing: true or packing: false")


def check_positions(c: RunConfig, model: nn.Module) -> None:
    """A row longer than the positions the model was trained with (max_position_embeddings) would
    train the rotary or learned positions past their range; refused before the data is read."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and c.seq > limit:
        config = os.path.join(c.model, "config.json") if os.path.isdir(c.model) else c.model
        raise ArgumentError(f"seq {c.seq:,} is longer than the model's max_position_embeddings, {limit:,} "
                            f"({config}): give seq <= {limit:,}")


def device_budget(c: RunConfig, model: nn.Module, inputs: dict, device: str) -> float:
    """GiB: hbm_budget; else 90% of the GPU, or on the cpu backend budget_fraction of the
    weights (so the run streams), never less than the smallest plan."""
    if c.hbm_budget is not None:
        return c.hbm_budget
    if device == "cuda":
        return 0.9 * torch.cuda.get_device_properties(0).total_memory / GiB
    from ..planner.from_config import plan
    dtype = getattr(torch, c.compute_dtype)
    weight_bytes = sum(p.numel() * dtype.itemsize for p in model.parameters())
    try:
        # With a global batch the accumulation is not chosen yet: the smallest micro-batch's plan.
        accumulate = 1 if c.global_batch else c.grad_accum
        smallest = plan(model, 1e-6, hardware="cpu", inputs=inputs, compute_dtype=dtype, grad_accum=accumulate,
                        accumulation=c.accumulation).minimum_budget_bytes
    except BudgetTooSmallError as e:
        smallest = e.minimum_bytes
    return max(weight_bytes * c.budget_fraction, smallest * 1.02) / GiB


def build(c: RunConfig, meta: nn.Module, first_inputs) -> Setup:
    """meta: meta_model(c); first_inputs(batch) -> the inputs of one micro-batch, for their shapes."""
    device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, c.compute_dtype)
    shifted = c.bundled
    batch, accumulate = c.batch, c.grad_accum
    probe = {k: v.to("meta") for k, v in first_inputs(1 if c.global_batch else batch).items()}
    budget = device_budget(c, meta, probe, device)
    if c.global_batch is not None:
        from ..planner.from_config import plan_global_batch
        _, accumulate = plan_global_batch(meta, budget, c.global_batch, hardware="cpu" if device == "cpu" else "h100",
                                          seq=probe["input_ids"].shape[1], compute_dtype=dtype,
                                          host_budget=c.host_budget, accumulation=c.accumulation)
        batch = c.global_batch // accumulate
    from .schedule import learning_rate
    optimizer = AdamW(lr=learning_rate(c.lr, c.schedule, c.warmup, c.min_lr, c.steps), betas=tuple(c.betas),
                      eps=c.eps, weight_decay=c.weight_decay,
                      # null: the norm is still measured for the log (clip_grad_norm_ at inf never clips)
                      max_grad_norm=math.inf if c.max_grad_norm is None else c.max_grad_norm)
    kwargs = dict(optimizer=optimizer, compute_dtype=dtype, device=device, grad_accum=accumulate,
                  host_budget=c.host_budget, accumulation=c.accumulation)
    torch.manual_seed(c.seed)
    if c.bundled:
        from ..models import LlamaConfig, TinyLlama
        engine = Engine(TinyLlama(LlamaConfig(**c.bundled_model)), budget, **kwargs)
    elif _hf_weights(c.model):
        from ..engine import from_pretrained
        engine = from_pretrained(c.model, budget, **kwargs)
    else:                                           # a config: random init, seeded
        from transformers import AutoModelForCausalLM
        config = meta.config
        engine = Engine(AutoModelForCausalLM.from_config(config, dtype=torch.float32), budget, **kwargs)
    weight_bytes = sum(p.numel() * dtype.itemsize for p in meta.parameters())
    return Setup(engine, batch, accumulate, shifted, weight_bytes)
