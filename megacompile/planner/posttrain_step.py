"""The predicted step of a post-training stage (`megacompile plan --stage`, megacompile.plan_stage):
each of its parts a plan the planner makes anyway, a training step or a forward-only pass, timed
by the cost model; the parts summed.

    sft   one training step of `batch` rows of `seq` tokens
    dpo   one training step of 2 x `batch` rows (each pair's chosen and rejected rows, packed), and
          one forward-only pass of the reference over the same rows, unless its log-probabilities
          are precomputed (precompute_ref_log_probs) or no loss type reads them (simpo, orpo, sft)
    kto   one training step of `batch` rows (completions) and, for loss_type kto, a forward-only
          pass over their KL rows (each prompt with another completion); the reference's
          log-probabilities are computed once a run, not a step
    rm    one training step of 2 x `batch` rows (each pair's chosen and rejected sequences)
    (the logged rewards of dpo, kto and rm come out of the training step's own forward)
    grpo  per rollout batch of prompts x num_generations rows, max_prompt_length +
          max_completion_length tokens wide (TRL's names), in steps_per_generation micro-batches
          (one optimizer step of them each pass, TRL's default grad_accum):
          generation  engine generator: one forward-only pass of each micro-batch's rows per new
                      token, at the full width (posttrain/rollout.py's EngineGenerator); kv_cache: a
                      prefill over the prompts and one decode step per token from a bfloat16 copy
                      (cost/decode.py), on the device where the engine's plans fit beside it and
                      the cache, else streamed; hf_streamed: the copy's layers streamed from the
                      host every step (posttrain/streamed_copy.py). What the copy, the cache and
                      generate's passing tensors (cost/generation_memory.py) hold on the
                      device comes out of the budget the other parts plan in.
          old policy  a forward-only pass per micro-batch: the sampling policy's log-probabilities
          reference   the same when beta > 0 (the reference's own copy of the weights)
          training    num_iterations passes of a training step per micro-batch

A stage that runs a reference model at every step (grpo with beta > 0, dpo with sync_ref_model)
holds it as a second engine on the policy's device (train/reference_model.py): its forward plan is
one of the device's, in the same budget, and its weights, frozen in their own dtype, are a second
copy on the host, placed in what the policy's host state and offloaded activations leave of the
host budget; too little there is a HostMemoryError, as at the run's start. A streamed generation
copy's decoder layers are pinned in host memory for the whole run: they come out of the host budget
before the other parts are planned.

The objectives' per-token log-probabilities are costed as the model's own loss: the same lm-head
matmul and a log-softmax over the vocabulary either way. Generation is costed at
max_completion_length tokens, its bound: a batch whose rows all end early stops early.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn

from .. import arguments
from ..cost.decode import BF16
from ..cost.generation_memory import generate_transient_bytes
from ..errors import ArgumentError, BudgetTooSmallError, HostMemoryError
from ..ir.printer import fmt_bytes, fmt_need, fmt_seconds
from ..optim import AdamW
from ..settings import Settings
from .from_config import hardware_profile, model_from_config, plan
from .kv_generation import (Prefill, StepPart, adapter_bytes, cache_per_token, copy_places, decoder_layer_bytes,
                            kv_cache_note, kv_generation)
from .plan_json import params_json
from .result import Plan

STAGES = ("sft", "pt", "dpo", "kto", "rm", "grpo")     # pt (pretraining on text) trains as sft does
GENERATORS = ("engine", "kv_cache", "hf_streamed")
# DPO's loss types that read the policy alone (posttrain/dpo_losses.py's REFERENCE_FREE, which
# this layer cannot import; a test holds the two the same). Any other name is costed with the
# reference pass: posttrain checks the names, a run refuses one it does not know.
REFERENCE_FREE = ("sft", "simpo", "orpo", "orpo_per_pair")
# Each stage's keys and their defaults (TRL's names and defaults where TRL has the key).
KEYS: dict[str, dict[str, Any]] = {
    "sft": {},
    "pt": {},
    "dpo": {"precompute_ref_log_probs": False, "loss_type": "sigmoid", "sync_ref_model": False},
    "kto": {"loss_type": "kto"},
    "rm": {},
    "grpo": {"prompts": 1, "num_generations": 8, "max_prompt_length": 512, "max_completion_length": 256,
             "num_iterations": 1, "steps_per_generation": 1, "beta": 0.0, "generator": "engine"},
}


@dataclass
class StagePlan:
    stage: str
    rows: int                 # rows of one training step (grpo: of a micro-batch)
    seq: int                  # their width in tokens
    keys: dict[str, Any]      # the stage's keys, defaults filled in
    train: Plan               # the training step's plan
    forward: Plan | None      # the forward-only pass over the training step's rows, when a part runs it
    parts: list[StepPart] = field(default_factory=list)
    optimizer_steps: int = 1  # optimizer steps the parts make (grpo: num_iterations per rollout batch)
    reference_host_bytes: int = 0   # a reference engine's frozen weights on the host (0: none runs)
    generator_host_bytes: int = 0   # a streamed generation copy's decoder layers, pinned on the host
    generator_note: str | None = None   # with the engine generator: a copy with a cache would be quicker
    reference_shares_base: bool = False     # a LoRA policy's reference: its adapters alone, the base the policy's

    @property
    def total_s(self) -> float:
        return sum(p.seconds for p in self.parts)

    @property
    def per_optimizer_step_s(self) -> float:
        return self.total_s / self.optimizer_steps

    @property
    def weight_h2d_bytes(self) -> int:
        return sum(p.weight_h2d_bytes for p in self.parts)

    def part(self, name: str) -> StepPart | None:
        return next((p for p in self.parts if p.name == name), None)

    def summary(self) -> str:
        if self.stage == "grpo":
            micro = self.keys["steps_per_generation"]
            what = (f"{self.keys['prompts']} prompts x {self.keys['num_generations']} generations = "
                    f"{self.rows * micro} rows"
                    + (f" in {micro} micro-batches of {self.rows}" if micro > 1 else "")
                    + f" of {self.keys['max_prompt_length']} + {self.keys['max_completion_length']} tokens, "
                    f"{self.optimizer_steps} optimizer step{'s' if self.optimizer_steps > 1 else ''} each")
        elif self.stage in ("dpo", "rm"):
            what = f"{self.rows // 2} pairs: {self.rows} rows (chosen, then rejected) of {self.seq} tokens"
        else:
            what = f"{self.rows} rows of {self.seq} tokens"
        lines = [f"megacompile plan --stage {self.stage} ({what}, on {self.train.hardware.name})"]
        total = self.total_s
        for p in self.parts:
            share = f" ({p.seconds / total:.1%})" if total else ""
            link = f"; {fmt_bytes(p.weight_h2d_bytes)} of weights over the host link" if p.weight_h2d_bytes else ""
            lines.append(f"  {p.name:<19} {fmt_seconds(p.seconds)}{share}: {p.detail}{link}")
        per = "rollout batch" if self.stage == "grpo" else "step"
        lines.append(f"  {'total':<19} {fmt_seconds(total)} per {per}"
                     + (f", {fmt_seconds(self.per_optimizer_step_s)} per optimizer step" if self.optimizer_steps > 1
                        else "") + f"; {fmt_bytes(self.weight_h2d_bytes)} of weights over the host link")
        lines += [f"  note               {n}" for n in self.notes()]
        return "\n".join(lines)

    def notes(self) -> list[str]:
        """What dominates, and what the figures leave out."""
        out = []
        generation = self.part("generation")
        if generation is not None and self.total_s and generation.seconds / self.total_s > 0.5:
            link, compute = generation.weight_h2d_bytes / self.train.hardware.h2d_bw, generation.compute_s
            bound = ("the host link bounds it" if link > 1.1 * compute else "compute bounds it" if compute > 1.1 * link
                     else "the host link and compute take about as long")
            out.append(f"generation is {generation.seconds / self.total_s:.0%} of the rollout batch; its weights cross "
                       f"the host link in {fmt_seconds(link)}, its compute takes {fmt_seconds(compute)}: {bound}")
        if self.generator_note:
            out.append(self.generator_note)
        if self.generator_host_bytes:
            out.append(f"the streamed copy's decoder layers are pinned in host memory: "
                       f"{fmt_bytes(self.generator_host_bytes)} of the host budget, the policy's state planned in "
                       "the rest")
        if self.reference_host_bytes:
            held = self.train.host_bytes + self.train.stash_bytes
            what = ("the reference holds its own LoRA adapters on the host, the frozen base being the policy's"
                    if self.reference_shares_base else "the reference's weights are a second copy on the host, frozen")
            out.append(f"{what}: {fmt_bytes(self.reference_host_bytes)} beside the policy's {fmt_bytes(held)}, "
                       f"{fmt_bytes(held + self.reference_host_bytes)} in all")
        if self.stage == "dpo" and not reads_reference(self.keys["loss_type"]):
            out.append(f"loss_type {self.keys['loss_type']} reads the policy alone: no reference pass, no reference "
                       "log-probabilities")
        elif self.stage == "dpo" and self.keys["precompute_ref_log_probs"]:
            out.append("the reference's log-probabilities are given: its forward pass over each batch is paid once, "
                       "before training")
        return out

    def to_json(self) -> dict:
        return {"stage": self.stage, "rows": self.rows, "seq": self.seq, **self.keys,
                "parts": [p.to_dict() for p in self.parts], "total_s": self.total_s,
                "optimizer_steps": self.optimizer_steps, "per_optimizer_step_s": self.per_optimizer_step_s,
                "weight_h2d_bytes": self.weight_h2d_bytes, "hardware": self.train.hardware.name,
                "reference_host_bytes": self.reference_host_bytes, "generator_host_bytes": self.generator_host_bytes,
                "train_step_s": self.train.prediction.step_s, "notes": self.notes(),
                **{k: v for k, v in params_json(self.train).items() if k.endswith("_params")},
                "forward_s": self.forward.prediction.step_s if self.forward is not None else None}


def stage_keys(stage: Any, keys: dict[str, Any]) -> dict[str, Any]:
    """The stage's keys, checked, its defaults filled in; a key of another stage, or of none, refused."""
    if stage not in STAGES:
        raise ArgumentError(f"stage must be one of {', '.join(STAGES)}; got {stage!r}")
    own = KEYS[stage]
    for key in keys:
        if key in own:
            continue
        owners = [s for s in STAGES if key in KEYS[s]]
        if owners:
            raise ArgumentError(f"stage {stage}: {key} belongs to stage {owners[0]}; plan stage {owners[0]}, or leave "
                                f"{key} out")
        listed = ", ".join(own) if own else "none"
        raise ArgumentError(f"stage {stage}: no key {key!r}; its keys are {listed}")
    out = {**own, **keys}
    if stage == "dpo":
        arguments.flag("precompute_ref_log_probs", out["precompute_ref_log_probs"])
        arguments.flag("sync_ref_model", out["sync_ref_model"])
        names = [out["loss_type"]] if isinstance(out["loss_type"], str) else out["loss_type"]
        if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
            raise ArgumentError(f"stage dpo: loss_type is a loss type's name or a list of them (TRL's); got "
                                f"{out['loss_type']!r}")
        if out["sync_ref_model"] and (out["precompute_ref_log_probs"] or not reads_reference(names)):
            raise ArgumentError("stage dpo: sync_ref_model moves a reference the loss reads at every step; it is not "
                                "taken with precompute_ref_log_probs or a loss type that reads the policy alone")
    if stage == "kto" and out["loss_type"] not in ("kto", "apo_zero_unpaired"):
        raise ArgumentError(f"stage kto: loss_type must be kto or apo_zero_unpaired; got {out['loss_type']!r}")
    if stage == "grpo":
        arguments.count("prompts", out["prompts"], what=" (prompts per rollout batch)")
        arguments.count("num_generations", out["num_generations"], minimum=2,
                        what=" (completions per prompt: a group of one has no advantage)")
        for key in ("max_prompt_length", "max_completion_length", "num_iterations", "steps_per_generation"):
            arguments.count(key, out[key])
        rows = out["prompts"] * out["num_generations"]
        if rows % out["steps_per_generation"]:
            raise ArgumentError(f"the rollout batch's {rows} rows (prompts x num_generations) do not split into "
                                f"steps_per_generation {out['steps_per_generation']} micro-batches of equal rows")
        out["beta"] = arguments.number("beta", out["beta"], minimum=0.0)
        if out["generator"] not in GENERATORS:
            raise ArgumentError(f"generator must be one of {', '.join(GENERATORS)} (engine: the engine's own forward "
                                f"at a fixed width; kv_cache: a bfloat16 copy with a key-value cache; hf_streamed: "
                                f"that copy's layers streamed from the host); got "
                                f"{out['generator']!r}")
    return out


def reads_reference(loss_type: str | list[str]) -> bool:
    """Whether a DPO step of these loss types reads the reference's log-probabilities."""
    return any(n not in REFERENCE_FREE for n in ([loss_type] if isinstance(loss_type, str) else loss_type))


def plan_stage(model_or_config: Any, hbm_budget: float, stage: str = "sft", *, batch: int | None = None,
               seq: int | None = None, hardware: Any = "h100", compute_dtype: torch.dtype = torch.bfloat16,
               fuse: bool | None = Settings.fuse, host_budget: float | None = None, nvme_budget: float | None = None,
               nvme_bandwidth: float | None = None, images_per_row: int = 0, image_size: int | None = None,
               trained: nn.Module | None = None, inputs: Callable[[dict, bool], dict] | None = None,
               optimizer: AdamW | None = None, grad_accum: int = Settings.grad_accum,
               accumulation: str = Settings.accumulation, updates: str = Settings.updates, **keys) -> StagePlan:
    """The predicted step of a post-training stage, from its parts (see the module's docstring).

    `batch`: rows (sft, kto) or preference pairs (dpo, rm) per step, default 1; `seq`: their width, default
    2048. grpo takes neither: its rows are prompts x num_generations, its width max_prompt_length +
    max_completion_length. `keys`: the stage's (KEYS, TRL's names). `images_per_row`, `image_size`: a
    vision-language model's rows with images (every stage: every part, training and forward-only,
    generation's included, plans them; a grpo copy's generate holds the tower's pass over the
    rollout's images beside it). `trained`, `inputs`: the module a run of the stage trains in place of
    the model (stage rm's reward model: the model's decoder under a one-number score, no lm_head) and
    its inputs, inputs(rows, train), from the rows the parts plan the model with (input_ids and labels,
    and the family's image inputs laid out for the model); each part then plans `trained` on them, as
    `megacompile plan --run` plans such a run. `optimizer`, `grad_accum`, `accumulation`, `updates`: the
    run's engine's, which every part planned on it takes (its AdamW's max_grad_norm puts the gradients'
    norm in the training step; grad_accum > 1 the accumulation's gradient buffers in its host state);
    grpo's grad_accum is the run's, of micro-batches. The rest as plan()'s. Raises BudgetTooSmallError or
    HostMemoryError, as plan() does, when a part does not fit."""
    keys = stage_keys(stage, keys)
    images = {}
    if images_per_row or image_size is not None:
        images = dict(images_per_row=images_per_row, image_size=image_size)
    if stage == "grpo":
        given = [k for k, v in (("batch", batch), ("seq", seq)) if v is not None]
        if given:
            raise ArgumentError(f"stage grpo takes no {' or '.join(given)}: its rows are prompts x num_generations and "
                                "its width max_prompt_length + max_completion_length; give those")
        rollout = keys["prompts"] * keys["num_generations"]
        micro = keys["steps_per_generation"]       # forwards and training steps take one micro-batch's rows
        rows = rollout // micro
        width = keys["max_prompt_length"] + keys["max_completion_length"]
    else:
        micro = 1
        batch = 1 if batch is None else batch
        if stage in ("dpo", "rm"):
            batch = 2 * arguments.count("batch", batch, what=" (preference pairs per step, 2 rows each)")
        rows, width = arguments.tokens(batch, 2048 if seq is None else seq)
    profile = hardware_profile(hardware, nvme_bandwidth)
    model = model_or_config if isinstance(model_or_config, nn.Module) else model_from_config(model_or_config)
    per_token, places = None, [("engine", 0)]
    pixels = _rollout_pixels(model, rollout, width, images) if stage == "grpo" and images else None
    if stage == "grpo" and keys["generator"] != "engine":     # a cache past the whole budget: before planning
        per_token = cache_per_token(model)    # a copy with a cache generates the rollout batch at once
        cache = rollout * width * per_token
        _check_cache(cache, arguments.budget_bytes("hbm_budget", hbm_budget), 0, rollout, width)
        # and, while it samples, transformers' passing tensors (a prefill of the prompts, a step's logits)
        passing = generate_transient_bytes(model.config, rollout, keys["max_prompt_length"], BF16, pixels) or 0
        places = copy_places(model, keys["generator"], cache + passing)
    settings = dict(hardware=profile, compute_dtype=compute_dtype, fuse=fuse, nvme_budget=nvme_budget,
                    optimizer=optimizer, grad_accum=grad_accum, accumulation=accumulation, updates=updates)
    host_total = arguments.budget_bytes("host_budget", host_budget, optional=True)
    # What the generator holds on the device for the whole run comes out of the budget first, as a run
    # takes it (train/beside.py): the copy on the device if the engine's plans fit beside it and
    # the cache, else (and for hf_streamed) the streamed copy's resident parts and two layers, its
    # decoder layers then pinned in host memory, out of the host budget.
    for place, beside in places:
        layers_held = sum(decoder_layer_bytes(model)) if place == "streamed" else 0
        host_left = None if host_total is None else (host_total - layers_held) / 2 ** 30

        def planned(train: bool, n: int, width: int) -> Plan:
            if trained is not None:
                given = inputs(_rows(model, n, width, images), train)
                p = plan(trained, hbm_budget - beside / 2 ** 30, train=train, host_budget=host_left, inputs=given,
                         **settings)
                return p.revised(vision=_trained_vision(p, model, n, width, images, given)) if images else p
            return plan(model, hbm_budget - beside / 2 ** 30, batch=n, seq=width, train=train, host_budget=host_left,
                        **settings, **images)
        try:
            if host_left is not None and host_left <= 0:
                raise HostMemoryError(f"the streamed copy's decoder layers ({fmt_bytes(layers_held)}, pinned in host "
                                      f"memory) take the whole host budget of {fmt_bytes(host_total)}: give a larger "
                                      "host budget, or generator engine")
            if beside >= arguments.budget_bytes("hbm_budget", hbm_budget):
                raise BudgetTooSmallError("the budget leaves the engine's plans nothing", 0)
            train = planned(True, rows, width)
            # grpo's forward passes (and a cache generator's prefill) plan in the same room
            rollout_forward = planned(False, rows, width) if stage == "grpo" else None
            prefill = planned(False, rollout, keys["max_prompt_length"]) if per_token is not None else None
            break
        except BudgetTooSmallError as e:
            if place != places[-1][0]:
                continue
            if not beside:
                raise
            need = e.minimum_bytes + beside
            raise BudgetTooSmallError(
                f"the generator holds {fmt_bytes(beside)} on the device for the whole run (its {place} copy, "
                f"the rollout's key-value cache and the tensors its generate passes through), which leaves the "
                f"engine's plans {fmt_bytes(max(0, arguments.budget_bytes('hbm_budget', hbm_budget) - beside))}, and their smallest "
                f"needs {fmt_need(e.minimum_bytes)}: give hbm_budget >= {math.ceil(need / 2 ** 30 * 100) / 100:.2f}, "
                "or fewer rollout rows or tokens (a smaller cache), or generator engine. The planner: " + str(e),
                need) from e
    steps = keys["num_iterations"] if stage == "grpo" else 1
    each = f"{rows} x {width} tokens"
    passes = steps * micro
    parts = [_part("training", passes, train, f"{passes} training step{'s' if passes > 1 else ''} of {each}"
                   + (f" ({micro} micro-batches a step)" if micro > 1 else ""))]
    forward = None
    if stage == "dpo" and not keys["precompute_ref_log_probs"] and reads_reference(keys["loss_type"]):
        forward = planned(False, rows, width)
        parts.append(_part("reference forward", 1, forward, f"one forward-only pass of {each}"))
    if stage == "kto" and keys["loss_type"] == "kto":
        forward = planned(False, rows, width)
        parts.append(_part("KL forward", 1, forward, f"one forward-only pass of {each}, each prompt with another "
                                                     "completion"))
    advice = None
    if stage == "grpo":
        forward = rollout_forward
        generation = (_engine_generation(forward, keys, each, micro) if keys["generator"] == "engine" else
                      kv_generation(per_token, forward, Prefill.of(prefill), keys, rollout,
                                    on_device=place == "device", beside=beside))
        if keys["generator"] == "engine":
            advice = kv_cache_note(model, train, forward, keys, rollout, rows, width,
                                   arguments.budget_bytes("hbm_budget", hbm_budget), generation, images=pixels)
        passes = f"one forward-only pass of {each}" if micro == 1 else f"{micro} forward-only passes of {each}"
        parts[:0] = [generation, _part("old-policy forward", micro, forward, passes)]
        if keys["beta"] > 0:
            parts.insert(2, _part("reference forward", micro, forward, f"{passes} (beta > 0)"))
    reference = stage == "grpo" and keys["beta"] > 0 or stage == "dpo" and keys["sync_ref_model"]
    held = _reference_host_bytes(model, train, host_left) if reference else 0
    return StagePlan(stage, rows, width, keys, train, forward, parts, steps, held, layers_held, advice,
                     reference_shares_base=adapter_bytes(model) is not None)


def _rows(model: nn.Module, rows: int, width: int, images: dict) -> dict:
    """The meta inputs plan() lays out for `model`'s `rows` rows of `width` tokens: input ids and
    labels, and with `images` the family's image inputs."""
    if images:
        from .image_inputs import image_inputs
        return image_inputs(model, rows, width, images["images_per_row"], images["image_size"])[0]
    rows, width = arguments.tokens(rows, width)
    ids = torch.empty(rows, width, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _trained_vision(p: Plan, model: nn.Module, rows: int, width: int, images: dict, given: dict):
    """The vision tower's share of a plan of the module a run trains in place of the model (stage
    rm's reward model), on the image inputs laid out for the model, as plan() gives a model's."""
    from .image_inputs import image_inputs
    from .vision_share import vision_share
    signature = image_inputs(model, rows, width, images["images_per_row"], images["image_size"])[1]
    return vision_share(p, signature, [i for i, k in enumerate(given) if k.startswith("pixel_")])


def _rollout_pixels(model: nn.Module, rows: int, width: int, images: dict) -> tuple[int, int]:
    """The pixel values' elements of a rollout batch of `rows` rows with these images each, and of its
    largest image (one tile): what a generation copy's tower passes over."""
    from .image_inputs import image_inputs
    inputs, signature = image_inputs(model, 1, width, images["images_per_row"], images["image_size"])
    per_row = inputs["pixel_values"].numel()
    return rows * per_row, per_row // (signature.images_per_row * signature.tiles_per_image)


def _reference_host_bytes(model: nn.Module, train: Plan, host_budget: float | None) -> int:
    """The reference engine's frozen weights and buffers on the host, in their own dtype;
    HostMemoryError when they do not fit in what the policy leaves of the host budget. Beside a LoRA
    policy the frozen base is the policy's own (compile(..., share_frozen=True)): only the adapters."""
    held = adapter_bytes(model)
    if held is None:
        held = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    budget = arguments.budget_bytes("host_budget", host_budget, optional=True)
    policy = train.host_bytes + train.stash_bytes
    if budget is not None and policy + held > budget:
        raise HostMemoryError(
            f"the reference model's frozen weights ({fmt_bytes(held)}) do not fit beside the policy's host state and "
            f"offloaded activations ({fmt_bytes(policy)}) in the host budget of {fmt_bytes(budget)}: give a host "
            f"budget of at least {math.ceil((policy + held) / 2 ** 30 * 100) / 100:.2f} GiB, or a stage without a "
            "reference at every step (grpo: beta 0; dpo: sync_ref_model false, whose reference log-probabilities "
            "are computed once)", {"smallest_host_budget_bytes": policy + held, "reference_host_bytes": held})
    return held


def _part(name: str, passes: int, p: Plan, detail: str) -> StepPart:
    return StepPart(name, passes, passes * p.prediction.step_s, passes * p.weight_h2d_bytes_per_step, detail,
                    passes * p.prediction.compute_s)


def engine_generator_advice(model: nn.Module, train: Plan, forward: Plan, keys: dict, rollout: int,
                            micro: int, budget_bytes: int) -> str | None:
    """For a run's GRPO with the engine generator, at its start: what a copy with a key-value cache
    would take instead (kv_cache_note), from the plans the run made. `forward`: the plan of the
    generator's pass, over one call's rows, run once per new token in each of `micro` calls."""
    rows, width = forward.captured.inputs[0].shape[:2]
    engine = _engine_generation(forward, keys, f"{rows} x {width} tokens", micro)
    return kv_cache_note(model, train, forward, keys, rollout, rows, width, budget_bytes, engine, for_run=True)


def _engine_generation(forward: Plan, keys: dict, each: str, micro: int = 1) -> StepPart:
    tokens = keys["max_completion_length"]
    per = "one per new token" if micro == 1 else f"{micro} per new token (a micro-batch's rows each)"
    return _part("generation", tokens * micro, forward,
                 f"engine generator, no key-value cache: {tokens * micro} forward-only passes of {each}, {per}, "
                 f"{fmt_seconds(forward.prediction.step_s)} each")


def _check_cache(cache_bytes: int, room: int, reserve: int, rows: int, width: int) -> None:
    if cache_bytes > room:
        raise BudgetTooSmallError(
            f"a key-value cache generator: the cache of {rows} rows x {width} tokens ({fmt_bytes(cache_bytes)}) "
            f"does not fit "
            f"the {fmt_bytes(room)} the budget leaves; fewer prompts or generations, or generator engine",
            cache_bytes + reserve)
