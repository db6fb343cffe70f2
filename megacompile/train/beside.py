"""What a run holds beside the engine, taken out of its budgets first: on a GPU beside the engine's
plans, in host memory beside its state.

hbm_budget (or, without one, 90% of the card) is the run's device memory, not the engine's alone.
Stage grpo can hold more than the engine's arena on the GPU for the whole run: a generator's copy of
the policy (`generator: hf` in generator_dtype; `hf_streamed`: its resident parts and two decoder
layers) with the key-value cache of a rollout batch, colocated vLLM's share of the card
(`vllm_gpu_memory_utilization`, as TRL gives it), a reward model's bfloat16 copy. Each is sized here
before anything is planned, and the engine plans in what is left: a run whose parts do not fit
beside the smallest plan stops before it trains, naming them.

host_budget (or its default, 90% of the RAM the process may fill) is likewise the run's host
memory. Beside the engine's state (masters, moments, gradients, offloaded activations) stage grpo
holds, for the whole run, the streamed copy's decoder layers (`hf_streamed` on a GPU: pinned host
memory), and on the cpu backend, whose simulated device is host memory, the generator's whole copy
and cache and each reward model's float32 copy. The engine's state is placed in what they leave.

A vision-language run of any stage holds processed pixels in host memory too: those kept for the
images read again (data/images.PixelCache, at most its limit), a micro-batch's pixel inputs while
its step runs, and in stage grpo a rollout's (the engine generator's: a call's rows).

transformers' tensors that pass while it generates (the prefill's largest layer, a step's logits
and sampling: cost/generation_memory.py) are counted with the copy, and those of a reward model's
forward as it scores a batch of completions with it: they pass before the engine runs again, but
the engine's arena is held meanwhile. Not counted: vLLM's own host memory.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..cost import (cache_bytes_per_token, cache_shape, forward_transient_bytes, generate_transient_bytes,
                    prefill_chunk)
from ..errors import BudgetTooSmallError, HostMemoryError
from ..ir import fmt_bytes
from .config import RunConfig

GiB = 2 ** 30


def on_gpu(device: str) -> bool:
    """'cuda' or 'cuda:N'."""
    return torch.device(device).type == "cuda"


@dataclass(frozen=True)
class Beside:
    what: str
    nbytes: int


def _bytes(tensors, dtype: torch.dtype) -> int:
    return sum(t.numel() * (dtype.itemsize if t.dtype.is_floating_point else t.element_size()) for t in tensors)


def _model_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """A copy of `model` made in `dtype`: its floating parameters in it, its buffers as the model makes
    them (rotary frequencies stay float32)."""
    return _bytes(model.parameters(), dtype) + sum(b.numel() * b.element_size() for b in model.buffers())


def generator_copy(c: RunConfig, meta: nn.Module, card_bytes: int, images: tuple[int, int] | None = None
                   ) -> list[Beside]:
    """The rollout generator's share of the GPU, per run.yaml's generator keys; `images`: a rollout
    batch's images at their heaviest (their pixel values' elements, the largest image's)."""
    if c.use_vllm and c.vllm_mode == "colocate":
        share = c.vllm_gpu_memory_utilization
        return [Beside(f"colocated vLLM's vllm_gpu_memory_utilization {share:g} of the card", int(share * card_bytes))]
    if c.generator not in ("hf", "hf_streamed") or c.use_vllm:
        return []
    dtype = getattr(torch, c.generator_dtype)
    if c.generator == "hf":
        copy, what = _model_bytes(meta, dtype), f"generator hf's {c.generator_dtype} copy of the policy"
    else:
        from ..posttrain import decoder_layers
        layers = decoder_layers(meta)
        per_layer = [_bytes(m.parameters(), dtype) for m in layers]
        copy = _model_bytes(meta, dtype) - sum(per_layer) + 2 * max(per_layer, default=0)
        what = f"generator hf_streamed's resident parts and two decoder layers in {c.generator_dtype}"
    return [Beside(what, copy)] + _cache(c, meta, dtype) + _passing(c, meta, dtype, images)


def _cache(c: RunConfig, meta: nn.Module, dtype: torch.dtype) -> list[Beside]:
    """The key-value cache of a rollout batch, generated at once: its rows x the row's width."""
    rows = c.batch * c.steps_per_generation
    shape = cache_shape(meta)
    if shape is None:
        return []
    per_token = cache_bytes_per_token(*shape, itemsize=dtype.itemsize)
    return [Beside(f"its key-value cache of {rows} rows x {c.seq} tokens", rows * c.seq * per_token)]


def _passing(c: RunConfig, meta: nn.Module, dtype: torch.dtype, images: tuple[int, int] | None = None
             ) -> list[Beside]:
    """What transformers' generate holds while it samples the rollout batch, besides the copy and
    the cache: the bound of cost/generation_memory.py (prompts with images: `images`)."""
    rows, prompt = c.batch * c.steps_per_generation, c.max_prompt_length or c.seq
    passing = generate_transient_bytes(getattr(meta, "config", None), rows, prompt, dtype.itemsize, images)
    if passing is None:
        return []
    chunk = prompt if images else min(prompt, prefill_chunk(rows))
    prefill = f"{rows} x {prompt} tokens" + (f" in chunks of {chunk} positions" if chunk < prompt else "")
    tower = ", the vision tower's pass over their images" if images else ""
    return [Beside(f"the tensors its generate passes through (a prefill of {prefill}{tower}, a step's logits and "
                   "sampling)", passing)]


def generator_host(c: RunConfig, meta: nn.Module, device: str, images: tuple[int, int] | None = None
                   ) -> list[Beside]:
    """What the rollout generator holds in host memory: on the cpu backend its copy and cache (the
    simulated device is host memory), on a GPU hf_streamed's decoder layers; `images`: as
    generator_copy's."""
    if c.use_vllm or c.generator not in ("hf", "hf_streamed"):
        return []
    dtype = getattr(torch, c.generator_dtype)
    if not on_gpu(device):
        return [Beside(f"generator {c.generator}'s {c.generator_dtype} copy of the policy", _model_bytes(meta, dtype))
                ] + _cache(c, meta, dtype) + _passing(c, meta, dtype, images)
    if c.generator == "hf":
        return []
    from ..posttrain import decoder_layers
    return [Beside(f"generator hf_streamed's decoder layers in {c.generator_dtype}, pinned",
                   sum(_bytes(m.parameters(), dtype) for m in decoder_layers(meta)))]


def kept_pixels() -> list[Beside]:
    """The processed pixels a vision-language run keeps for the images it reads again: at most the
    cache's limit (data/images.PixelCache)."""
    from .data.images import PixelCache
    return [Beside("processed pixels kept for the images read again, at most", PixelCache.LIMIT)]


def pixel_inputs(inputs: dict | None, what: str) -> list[Beside]:
    """The pixel inputs of a batch (`pixel_values`, `pixel_values_videos`), made in host memory
    for as long as it is used; none without images."""
    nbytes = sum(v.numel() * v.element_size() for k, v in (inputs or {}).items()
                 if k.startswith("pixel_values") and isinstance(v, torch.Tensor))
    return [Beside(what, nbytes)] if nbytes else []


def reward_model(folder: str, dtype: torch.dtype = torch.bfloat16, rows: int = 16, tokens: int = 0) -> list[Beside]:
    """A reward model's copy (posttrain/reward_models.py: bfloat16 on cuda, float32 on the cpu),
    sized from its config on meta, and what its forward passes through as it scores `rows`
    completions at a time of about `tokens` tokens (the run's row width: the reward model's own
    tokenizer and chat template may make a little more)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification
    from ..io.hf_load import parameters_on_meta
    config = AutoConfig.from_pretrained(folder)
    with parameters_on_meta():
        model = AutoModelForSequenceClassification.from_config(config)
    held = [Beside(f"reward model {folder} in {str(dtype)[6:]}", _model_bytes(model, dtype))]
    passing = forward_transient_bytes(config, rows, tokens, dtype.itemsize) if tokens else None
    if passing:
        held.append(Beside(f"the tensors its forward passes through ({rows} completions of {tokens} tokens)", passing))
    return held


def split(total_gib: float, beside: list[Beside]) -> tuple[float, str | None]:
    """The engine's budget (GiB) once `beside` is taken out of the run's `total_gib`, and the line the
    run's start prints (None: nothing beside)."""
    taken = sum(b.nbytes for b in beside)
    if not taken:
        return total_gib, None
    parts = "; ".join(f"{b.what}: {fmt_bytes(b.nbytes)}" for b in beside)
    left = total_gib - taken / GiB
    return left, (f"device budget  {fmt_bytes(total_gib * GiB)}: {fmt_bytes(max(0.0, left) * GiB)} for the engine's "
                  f"plans, {fmt_bytes(taken)} beside them ({parts})")


def for_engine(device: str, total_gib: float, meta: nn.Module, beside_of) -> tuple[float, list[Beside]]:
    """The engine's budget in GiB on `device` out of the run's `total_gib`: on a GPU, less what
    `beside_of(meta, card_bytes)` holds beside it (the line saying so printed); elsewhere all of it."""
    if not on_gpu(device) or beside_of is None:
        return total_gib, []
    card = torch.cuda.get_device_properties(torch.device(device)).total_memory
    beside = beside_of(meta, card)
    left, line = split(total_gib, beside)
    if line is not None:
        print(f"  {line}", flush=True)
    if left <= 0:
        taken = sum(b.nbytes for b in beside)
        raise BudgetTooSmallError(
            f"the device budget of {fmt_bytes(total_gib * GiB)} leaves nothing for the engine's plans beside "
            f"{fmt_bytes(taken)} the run holds on the GPU besides them ({'; '.join(b.what for b in beside)}): give a "
            "larger hbm_budget, a smaller generator share (vllm_gpu_memory_utilization, fewer rollout rows), or "
            "generator engine", taken)
    return left, beside


def too_small(error: BudgetTooSmallError, beside: list[Beside]) -> BudgetTooSmallError:
    """The planner's refusal of the engine's budget, with what the run holds beside it named: the
    smallest run budget is the smallest plan's and theirs together."""
    taken = sum(b.nbytes for b in beside)
    need = error.minimum_bytes + taken
    return BudgetTooSmallError(f"the run holds {fmt_bytes(taken)} on the GPU beside the engine's plans "
                               f"({'; '.join(b.what for b in beside)}), and the plans' smallest needs "
                               f"{fmt_bytes(error.minimum_bytes)}: give hbm_budget >= {math.ceil(need / GiB * 100) / 100:.2f}"
                               ", or a smaller generator share (vllm_gpu_memory_utilization, fewer rollout rows or "
                               f"tokens), or generator engine. The planner: {error}", need)


def host_for_engine(total_gib: float, beside: list[Beside]) -> float:
    """The engine's host budget in GiB out of the run's `total_gib`, less `beside` (the line saying so
    printed); HostMemoryError when they leave nothing."""
    taken = sum(b.nbytes for b in beside)
    if not taken:
        return total_gib
    left = total_gib - taken / GiB
    parts = "; ".join(f"{b.what}: {fmt_bytes(b.nbytes)}" for b in beside)
    print(f"  host budget    {fmt_bytes(total_gib * GiB)}: {fmt_bytes(max(0.0, left) * GiB)} for the engine's state, "
          f"{fmt_bytes(taken)} beside it ({parts})", flush=True)
    if left <= 0:
        raise HostMemoryError(f"the host budget of {fmt_bytes(total_gib * GiB)} leaves nothing for the engine's "
                              f"state beside {fmt_bytes(taken)} the run holds in host memory besides it ({parts}): "
                              "give a larger host_budget, or generator engine", {"beside_bytes": taken})
    return left


def host_short(error: HostMemoryError, beside: list[Beside]) -> HostMemoryError:
    """The engine's refusal of its host budget, with what the run holds beside it named."""
    taken = sum(b.nbytes for b in beside)
    smallest = error.facts.get("smallest_host_budget_bytes")
    need = (f": give host_budget >= {math.ceil((smallest + taken) / GiB * 100) / 100:.2f}"
            if smallest is not None else "")
    return HostMemoryError(f"the run holds {fmt_bytes(taken)} in host memory beside the engine's state "
                           f"({'; '.join(b.what for b in beside)}){need}. The planner: {error}",
                           {**error.facts, "beside_bytes": taken,
                            **({"smallest_host_budget_bytes": smallest + taken} if smallest is not None else {})})
