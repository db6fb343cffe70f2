"""The run's model and engine: the bundled small Llama, a Hugging Face folder's weights
(megacompile.from_pretrained), or a Hugging Face config trained from scratch; its device budget
and, for global_batch, the micro-batch and accumulation the planner chooses."""
from __future__ import annotations

import copy
import inspect
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..capture import CHECKED_LINEAR_ATTENTION, GRID_INPUTS
from ..capture import with_rope_positions
from ..engine import Engine, Prepared, prepare, training_capture
from ..cost import default_host_budget_bytes
from ..errors import ArgumentError, BudgetTooSmallError, HostMemoryError
from ..optim import AdamW, hf_no_decay
from ..planner import minimum_budget_of
from ..settings import Settings, default_hbm_budget
from . import beside, methods, model_config, neftune
from .config import DROPOUT_OFF, RunConfig

GiB = 2 ** 30


@dataclass
class Setup:
    engine: Engine
    batch: int
    grad_accum: int
    shifted: bool      # labels already shifted (the bundled model) or shifted inside (Hugging Face)
    weight_bytes: int
    host_budget: float | None = None   # GiB the engine's host state was placed in (None: the machine's share)


def _hf_weights(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("model.safetensors", "model.safetensors.index.json"))


def meta_model(c: RunConfig) -> nn.Module:
    """The model on the meta device, for planning: no weight memory."""
    if c.bundled:
        from ..models import LlamaConfig, TinyLlama
        with torch.device("meta"):
            return TinyLlama(LlamaConfig(**c.bundled_model))
    if _hf_weights(c.model) or os.path.isfile(os.path.join(c.model, "config.json")):
        from transformers import AutoConfig
        from ..io.hf_load import auto_class
        config = AutoConfig.from_pretrained(c.model)
        if _hf_weights(c.model):      # refused before the data is read, not when the weights stream in
            from ..planner import refuse_quantized_weights
            refuse_quantized_weights(config, c.model)
        if getattr(config, "vision_config", None) is not None:   # as the folder's weights are built
            config.use_cache = False
            model_config.edit(config, c)
            with torch.device("meta"):
                return auto_class(config).from_config(config)
    from ..planner import model_from_config
    model = model_from_config(c.model)
    if not model_config.edited(c):
        return model
    config = copy.deepcopy(model.config)      # the config as transformers reads it, then the run's change
    model_config.edit(config, c)
    return model_from_config(config)


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
    # A gated delta-net's recurrence runs over the whole row: position ids reach only the attention
    # layers, and transformers' torch path of the rule has no document boundaries.
    recurrent = next((path for path, m in model.named_modules() if type(m).__name__ in CHECKED_LINEAR_ATTENTION), None)
    if recurrent is not None:
        raise ArgumentError(f"packing: isolated keeps packed documents apart in attention only, and '{recurrent}' "
                            f"({type(model.get_submodule(recurrent)).__name__}) is a linear-attention layer whose "
                            "recurrent state would carry from one document into the next; use packing: false (a "
                            "document a row) or packing: true (documents that see each other by design)")


def check_positions(c: RunConfig, model: nn.Module) -> None:
    """A row longer than the positions the model was trained with (max_position_embeddings) would
    train the rotary or learned positions past their range; refused before the data is read."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and c.seq > limit:
        config = os.path.join(c.model, "config.json") if os.path.isdir(c.model) else c.model
        raise ArgumentError(f"seq {c.seq:,} is longer than the model's max_position_embeddings, {limit:,} "
                            f"({config}): give seq <= {limit:,}, or rope_scaling: linear, yarn or llama3 to stretch "
                            "its rotary embedding to seq (LlamaFactory's key)")


def device_budget(c: RunConfig, model: nn.Module, captured, device: str) -> float:
    """GiB: hbm_budget; else DEVICE_SHARE (90%) of the GPU, or on the cpu backend budget_fraction
    of the weights (so the run streams), never less than the smallest plan of `captured` (its
    smallest micro-batch's training capture)."""
    if c.hbm_budget is not None:
        return c.hbm_budget
    if device == "cuda":
        return default_hbm_budget()
    dtype = getattr(torch, c.compute_dtype)
    weight_bytes = sum(p.numel() * dtype.itemsize for p in model.parameters())
    # With a global batch the accumulation is not chosen yet: the smallest micro-batch's plan.
    accumulate = 1 if c.global_batch else c.grad_accum
    settings = Settings(compute_dtype=dtype, grad_accum=accumulate, accumulation=c.accumulation, updates=c.updates)
    smallest = minimum_budget_of(captured, model, settings, hardware="cpu")
    return max(weight_bytes * c.budget_fraction / GiB, smallest * 1.02)


def forward_budget(c: RunConfig, model: nn.Module, captured) -> float:
    """GiB: the smallest plan of a forward-only capture on the cpu backend (a post-training stage's
    pass that scores its rows without a step), with device_budget's margin."""
    settings = Settings(compute_dtype=getattr(torch, c.compute_dtype))
    return minimum_budget_of(captured, model, settings, hardware="cpu", train=False) * 1.02


def disable_dropout(model: nn.Module) -> int:
    """TRL's `disable_dropout`: every nn.Dropout of the model (a LoRA adapter's too) at p 0, as TRL's
    trainers set it; a rate the model's attention reads from its config (Llama's attention_dropout)
    is left, as TRL leaves it. The count of modules that dropped anything before."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            count += module.p > 0
            module.p = 0.0
    return count


def make_module(c: RunConfig, meta: nn.Module, wrap=None, quiet: bool = False) -> nn.Module:
    """The module the engine trains, its random draws (a config's init, LoRA's adapters) from the
    global stream as it stands: the bundled model, a folder's model on meta (its weights stream
    from the files), or a config's, seeded; the method's (LoRA) applied, dropout off as asked, and
    `wrap`ped by the stage's objective."""
    folder = not c.bundled and _hf_weights(c.model)
    if c.bundled:
        from ..models import LlamaConfig, TinyLlama
        module = TinyLlama(LlamaConfig(**c.bundled_model))
    elif folder and methods.adapters(c):
        module = methods.lora_skeleton(c)      # adapters made, the base on meta: it streams from the files
    elif folder:
        from ..io.hf_load import build_model
        module = build_model(c.model, edit=lambda config: model_config.edit(config, c))
    else:                                           # a config: random init, seeded
        from ..io.hf_load import auto_class
        module = auto_class(meta.config).from_config(meta.config, dtype=torch.float32)
    if not methods.adapters(c) or not folder:
        module = methods.apply(c, module)
    if c.disable_dropout:
        off = disable_dropout(module)
        if off and not quiet:
            print(f"  note           disable_dropout: {off} dropout module{'s' if off > 1 else ''} of the model at p 0"
                  + (f" (stage {c.stage}'s default, as in TRL and LlamaFactory; disable_dropout: false keeps them)"
                     if c.stage in DROPOUT_OFF else ""), flush=True)
    neftune.apply(c, module)
    return module if wrap is None else wrap(module)


def compile_module(c: RunConfig, module: nn.Module, budget: float, wrap=None, **kwargs) -> Engine:
    """An engine over `module` (make_module's), its weights streamed from the model folder where
    there is one."""
    if not c.bundled and _hf_weights(c.model):
        from ..engine import compile_folder
        return compile_folder(module, c.model, budget, **kwargs,
                              file_key=file_key(methods.adapters(c), wrap is not None),
                              unused=getattr(module, "left_out", ()), grown=c.grown,
                              edits=(c.pissa,) if c.pissa is not None else ())
    return Engine(module, budget, **kwargs)


def adamw(c: RunConfig, lr) -> AdamW:
    """The run's AdamW at the learning rate (or schedule) `lr`."""
    return AdamW(lr=lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay,
                 # null: the norm is still measured for the log (clip_grad_norm_ at inf never clips)
                 max_grad_norm=math.inf if c.max_grad_norm is None else c.max_grad_norm,
                 # weight_decay as Hugging Face Trainer (so TRL, LlamaFactory) applies it: biases
                 # and norm weights exempt
                 no_decay=hf_no_decay, lr_ratios=methods.lr_ratios(c))


def check_import(c: RunConfig, meta: nn.Module, imported: str) -> None:
    """The Trainer checkpoint a new run starts from, checked against the run's model on meta (the
    fine-tuning method's parameters applied) and its AdamW, before anything of the run is written:
    what the engine's import would refuse is refused here (io/trainer_checkpoint.py)."""
    from ..io import trainer_checkpoint
    trainer_checkpoint.check(meta, adamw(c, c.lr), imported, file_key=file_key(methods.adapters(c), False))


def build(c: RunConfig, meta: nn.Module, first_inputs, wrap=None, heaviest_inputs=None, beside_of=None,
          host_beside_of=None, forward_inputs=None) -> Setup:
    """meta: meta_model(c); first_inputs(batch) -> the inputs of one micro-batch, for their shapes;
    wrap(model) -> the module the engine trains instead of the model (a post-training objective,
    whose parameters carry the model's names under `policy.`); heaviest_inputs(batch) -> a
    micro-batch whose shapes need more memory than the first's (more image tokens), or None: the
    default budget (no hbm_budget) fits its smallest plan too; beside_of(meta, card_bytes) -> what
    the run holds on a GPU beside the engine's plans (train/beside.py), taken out of the
    budget first; host_beside_of(meta, device) -> what it holds in host memory beside the engine's
    state, taken out of the host budget.

    Each input shape is captured and planned once before the first step, on the module the engine
    trains and with the request the engine makes (engine/prepared.py): the smallest micro-batch's
    capture serves the budget and the choice; the chosen size's capture and plan are handed to the
    engine (Engine.adopt), which runs them at its first step."""
    device = c.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, c.compute_dtype)
    shifted = c.bundled
    batch, accumulate = c.batch, c.grad_accum
    from .schedule import learning_rate
    optimizer = adamw(c, learning_rate(c.lr, c.schedule, c.warmup, c.min_lr, c.steps))
    settings = c.settings()
    held = host_beside_of(meta, device) if host_beside_of is not None else []
    host_budget = c.host_budget
    if held:        # the engine's state in what they leave of the run's host budget
        total = c.host_budget if c.host_budget is not None else default_host_budget_bytes() / GiB
        host_budget = beside.host_for_engine(total, held)
        settings = settings.replace(host_budget=host_budget)
    torch.manual_seed(c.seed)
    module = make_module(c, meta, wrap)

    def shapes(b: int, given: dict | None = None) -> dict:
        # As the engine's step sees them: Qwen2.5-VL's 3D positions computed from the values, its
        # image grids kept with their values (constants of the capture), the rest shapes alone.
        inputs = with_rope_positions(module, (), first_inputs(b) if given is None else given)
        return {k: v if k in GRID_INPUTS else v.to("meta") for k, v in inputs.items()}

    # Each micro-batch size is captured once; the budget's smallest plan, the choice among sizes and
    # the engine's first step share the capture, and the engine takes the chosen plan (adopt).
    captures: dict[int, object] = {}
    prepared: dict[tuple, Prepared] = {}

    def prepared_for(b: int, k: int, budget: float) -> Prepared:
        run = settings.replace(hbm_budget=budget, grad_accum=k, device=device)
        if b not in captures:
            captures[b] = training_capture(module, shapes(b), run)
        if (b, k) not in prepared:
            prepared[b, k] = prepare(module, shapes(b), run, optimizer.max_grad_norm is not None, captures[b])
        return prepared[b, k]
    # Planning draws no number from the run's random stream (a first cpu calibration would).
    with torch.random.fork_rng(devices=[]):
        first = 1 if c.global_batch else batch
        if first not in captures:
            captures[first] = training_capture(module, shapes(first), settings.replace(device=device))
        budget, on_device = beside.for_engine(device, device_budget(c, module, captures[first], device), meta,
                                              beside_of)
        heaviest = heaviest_inputs(first) if heaviest_inputs is not None and c.hbm_budget is None else None
        if heaviest is not None and device != "cuda":   # a later micro-batch with more image tokens fits too
            heavy = training_capture(module, shapes(first, heaviest), settings.replace(device=device))
            budget = max(budget, device_budget(c, module, heavy, device))
        forward = forward_inputs(first) if forward_inputs is not None and c.hbm_budget is None else None
        if forward is not None and device != "cuda":    # and the stage's forward-only pass at its heaviest
            ahead = training_capture(module, shapes(first, forward), settings.replace(device=device), train=False)
            budget = max(budget, forward_budget(c, module, ahead))
        try:
            if c.global_batch is not None:
                from ..planner import choose_micro_batch, split_line
                _, accumulate = choose_micro_batch(c.global_batch, lambda micro, k: prepared_for(micro, k, budget).plan,
                                                   lambda *split: print(split_line(*split), flush=True))
                batch = c.global_batch // accumulate
            chosen = prepared_for(batch, accumulate, budget)
        except BudgetTooSmallError as e:
            if not on_device:
                raise
            raise beside.too_small(e, on_device) from e
        except HostMemoryError as e:
            if not held:
                raise
            raise beside.host_short(e, held) from e
        kwargs = dict(optimizer=optimizer, compute_dtype=dtype, device=device, grad_accum=accumulate,
                      host_budget=host_budget, accumulation=c.accumulation, updates=c.updates, fuse=c.fuse,
                      on_nonfinite=c.on_nonfinite, nvme_dir=c.nvme_dir, nvme_budget=c.nvme_budget,
                      dump_dir=c.dump_dir, retrace=c.retrace)
        engine = compile_module(c, module, budget, wrap, **kwargs)
        try:
            engine.adopt(chosen)
            engine.prepare(**first_inputs(batch))   # takes the capture and plan made above
        except BaseException:
            engine.close()
            raise
    weight_bytes = sum(p.numel() * dtype.itemsize for p in meta.parameters())
    return Setup(engine, batch, accumulate, shifted, weight_bytes, host_budget)


def file_key(lora: bool, objective: bool):
    """The module's state_dict key -> the name the model folder's files give it: a post-training
    objective's keys less `policy.`, a PEFT model's less its wrapping (methods.file_key)."""
    if not (lora or objective):
        return None

    def key(k: str) -> str:
        k = k.removeprefix("policy.") if objective else k
        return methods.file_key(k) if lora else k
    return key
