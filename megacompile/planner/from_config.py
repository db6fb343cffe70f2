"""Plan without running: from a model (possibly on the meta device) or a Hugging Face config to a
plan that says whether the model fits the device and host, and how fast it should train.

No weight is ever allocated: the model is built on the meta device, traced with fake tensors, and
host memory is counted, not allocated.
"""
from __future__ import annotations

import json
import os
import math
import time
from typing import Any

import torch
import torch.nn as nn

from ..capture import CapturedModel, capture, with_rope_positions
from ..capture.top import blocks_grouped_once
from ..cost import HardwareProfile, get_profile, profile_for
from .. import arguments
from ..errors import ArgumentError, MegacompileError
from ..optim import AdamW
from ..optim.adamw import given_optimizer
from ..passes import StepKind
from .result import Plan
from ..cost.hardware import replace
from ..cost.host_memory import host_costs
from ..settings import Settings, from_call
from .attention_choice import faster_attention_plan, records_cudnn_attention
from .image_inputs import image_inputs
from .quantized import planning_note, refuse_quantized_model
from .request import PlanRequest, fused, host_accumulation
from .search import lowest_budget, make_baseline_plan, make_plan, place_host_state
from .vision_share import vision_share

GiB = 2 ** 30


def model_from_config(config: Any) -> nn.Module:
    """A causal LM on the meta device from a Hugging Face config (a path to config.json or its
    folder, a dict, or a PretrainedConfig). Needs the `transformers` package."""
    folder = None
    if isinstance(config, (str, os.PathLike)):
        folder = os.fspath(config) if os.path.isdir(config) else None
        path = os.path.join(config, "config.json") if os.path.isdir(config) else config
        try:
            with open(path) as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise MegacompileError(f"cannot read the model config {path}: {e}") from e
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig
    except ImportError as e:
        raise MegacompileError("planning from a config needs `pip install transformers` (or pass an nn.Module "
                               "built on the meta device)") from e
    if isinstance(config, dict):
        config = dict(config)
        model_type = config.pop("model_type", None)
        if model_type is None:
            raise ArgumentError("the config has no model_type (e.g. \"llama\", \"qwen2\")")
        try:
            config = AutoConfig.for_model(model_type, **config)
        except Exception as e:  # noqa: BLE001 - transformers' own checks: one error that names the field
            if "Unrecognized model" in str(e):
                import transformers
                raise ArgumentError(f"the config's model_type {model_type!r} is unknown to transformers "
                                    f"{transformers.__version__} (causal LMs are e.g. 'llama', 'qwen2', 'gpt2', "
                                    "'mistral')") from e
            raise ArgumentError(f"the {model_type} config is invalid: {str(e).splitlines()[-1].strip()[:300]}") from e
    if not isinstance(config, PretrainedConfig):
        raise ArgumentError(f"expected a config path, dict or PretrainedConfig, got {type(config).__name__}")
    check_attention_shape(getattr(config, "text_config", None) or config)
    config.use_cache = False
    if getattr(config, "vision_config", None) is None:
        return _on_meta(AutoModelForCausalLM, config, f"a {type(config).__name__} is not a causal LM's config: planning "
                        "from a config builds decoders (AutoModelForCausalLM) and vision-language models "
                        "(AutoModelForImageTextToText, a config with a vision_config)")
    if hasattr(config, "text_config"):
        config.text_config.use_cache = False
    if folder is not None:      # where its image processor is read from (image_inputs.py)
        config._name_or_path = folder
    return _on_meta(AutoModelForImageTextToText, config, f"a {type(config).__name__} has a vision_config but "
                    "transformers builds no image-text-to-text model from it (AutoModelForImageTextToText): plan its "
                    "language model's config (text_config) instead")


def _on_meta(auto_class, config: Any, refusal: str) -> nn.Module:
    """auto_class's model of `config` on the meta device; `refusal` when it has none for it."""
    try:
        with torch.device("meta"):
            return auto_class.from_config(config)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ArgumentError(refusal) from e


def check_attention_shape(config: Any) -> None:
    """Heads must split the hidden size (unless head_dim is given) and KV heads the heads: caught
    here, before a model is built and traced, with the numbers that do not divide."""
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (hidden, heads, kv)):
        return
    if heads < 1 or kv < 1 or hidden < 1:
        raise ArgumentError(f"hidden_size {hidden}, num_attention_heads {heads} and num_key_value_heads {kv} "
                            "must be positive")
    if getattr(config, "head_dim", None) is None and hidden % heads:
        raise ArgumentError(f"num_attention_heads {heads} does not divide hidden_size {hidden}: choose heads so "
                            f"that hidden_size / heads is a whole head size, e.g. {_divisor_near(hidden, heads)}")
    if heads % kv:
        raise ArgumentError(f"num_key_value_heads {kv} does not divide num_attention_heads {heads}: each KV head "
                            "serves a whole group of query heads")


def _divisor_near(n: int, k: int) -> int:
    return min((d for d in range(1, n + 1) if n % d == 0), key=lambda d: abs(d - k))


def plan_global_batch(model_or_config: Any, hbm_budget: float | None = None, global_batch: int | None = None, *,
                      settings: Settings | None = None, accumulation: str = "auto", on_split=None,
                      **kwargs) -> tuple[Plan, int]:
    """Choose the micro-batch for a global batch: every power-of-two divisor that fits is planned
    and the one with the highest predicted tokens/s wins. Returns the plan of one micro-batch
    step and the number of micro-batches to accumulate (compile(..., grad_accum=k)). Choosing the
    split, it lets the planner choose the accumulation too ("auto"), unless told otherwise.
    kwargs: plan()'s (not batch or grad_accum, which it chooses); `settings` as plan()'s (its
    grad_accum is the one chosen here); `on_split` as choose_micro_batch's."""
    global_batch = arguments.count("global_batch", global_batch, what=" (sequences per optimizer step)")
    if settings is not None:    # its settings as keywords: one path below
        if hbm_budget is not None and hbm_budget != settings.hbm_budget:
            raise ArgumentError(f"hbm_budget is given twice: {hbm_budget!r} and {settings.hbm_budget!r} in settings; "
                                "give each setting once")
        hbm_budget = settings.hbm_budget
        given = {k: getattr(settings, k) for k in PLAN_SETTINGS if k not in ("grad_accum", "accumulation")}
        clash = sorted(k for k in given if k in kwargs and not _same_setting(kwargs[k], given[k]))
        if clash:
            raise ArgumentError(f"{', '.join(clash)} given twice: as keywords and in settings; give each setting once")
        kwargs.update(given)
    Settings(hbm_budget=hbm_budget, accumulation=accumulation,
             **{k: v for k, v in kwargs.items() if k in PLAN_SETTINGS})
    kwargs["hardware"] = hardware_profile(kwargs.get("hardware", "h100"), kwargs.pop("nvme_bandwidth", None))
    model = model_or_config if isinstance(model_or_config, nn.Module) else model_from_config(model_or_config)
    search_lowest = kwargs.pop("smallest", False)
    with blocks_grouped_once():    # blocks found alike at the first micro-batch size stay alike
        best = choose_micro_batch(global_batch, lambda micro, k: plan(
            model, hbm_budget, batch=micro, grad_accum=k, accumulation=accumulation, smallest=False, **kwargs),
            on_split)
    if search_lowest:
        chosen, k = best
        best = (chosen.revised(minimum_budget_bytes=min(chosen.minimum_budget_bytes, chosen.lowest_budget()),
                               minimum_over_chunks=True), k)
    return best


def _same_setting(a: Any, b: Any) -> bool:
    return a is b if a is None or b is None else a == b


def choose_micro_batch(global_batch: int, plan_one, on_split=None) -> tuple[Plan, int]:
    """plan_one(micro, k) for every micro-batch size that divides the global batch (halving from
    the whole of it), k = global_batch // micro micro-batches a step: the plan with the highest
    predicted tokens/s among those that fit the card (Plan.fits_card; any, when none does), and
    its k. Raises what stopped the smallest micro-batch when none fits. `on_split(micro, k,
    outcome, seconds)` hears of each split as it is planned: its Plan, or the error that refused
    it, and the seconds planning it took (split_line says it in a line)."""
    from ..errors import BudgetTooSmallError, HostMemoryError
    best, smallest, host_short = None, None, None
    micro = global_batch
    while micro >= 1:
        if global_batch % micro == 0:
            began = time.perf_counter()
            try:
                candidate = plan_one(micro, global_batch // micro)
            except BudgetTooSmallError as e:
                smallest = e
                if on_split is not None:
                    on_split(micro, global_batch // micro, e, time.perf_counter() - began)
            except HostMemoryError as e:   # accumulation's gradient buffers: a larger micro-batch may fit
                host_short = host_short or e
                if on_split is not None:
                    on_split(micro, global_batch // micro, e, time.perf_counter() - began)
            else:
                if on_split is not None:
                    on_split(micro, global_batch // micro, candidate, time.perf_counter() - began)
                if best is None or ((candidate.fits_card, candidate.prediction.tokens_per_s)
                                    > (best[0].fits_card, best[0].prediction.tokens_per_s)):
                    best = (candidate, global_batch // micro)
        micro //= 2
    if best is None:
        # Host RAM, when it stopped the micro-batches small enough for the device.
        raise host_short or smallest
    return best


def split_line(micro: int, k: int, outcome, seconds: float) -> str:
    """One split of a global batch as choose_micro_batch's on_split hears of it: its predicted step
    and tokens/s, or why it does not fit, and how long planning it took."""
    from ..errors import BudgetTooSmallError
    from ..ir.printer import fmt_need
    head = f"  split          {micro} row{'s' * (micro != 1)} x {k} accumulated".ljust(44)   # as `micro-batch` says it
    took = f" (planned in {seconds:.0f} s)"
    if isinstance(outcome, BudgetTooSmallError):
        return f"{head}does not fit: its smallest budget is {fmt_need(outcome.minimum_bytes)}{took}"
    if isinstance(outcome, Exception):
        return f"{head}does not fit the host: {str(outcome).split(';')[0][:160]}{took}"
    p = outcome.prediction
    step = p.step_s * outcome.grad_accum / outcome.micro_batches_per_run
    how = ", layer by layer" if outcome.micro_batches_per_run > 1 else ""
    card = "" if outcome.fits_card else " (more than the card holds)"
    return f"{head}{step:.2f} s a step{how}, {p.tokens_per_s:,.0f} tok/s predicted{card}{took}"


def split_fields(micro: int, k: int, outcome, seconds: float) -> dict:
    """split_line's facts for `megacompile plan --json`: the split, whether it fits (the budget and
    the card), its predicted step and tokens/s or its smallest budget, the seconds planning took."""
    from ..errors import BudgetTooSmallError
    fields = {"micro_batch": micro, "micro_batches": k, "planning_seconds": round(seconds, 3)}
    if isinstance(outcome, Exception):
        return {**fields, "fits": False, "error": str(outcome),
                **({"smallest_budget_bytes": outcome.minimum_bytes} if isinstance(outcome, BudgetTooSmallError)
                   else {})}
    return {**fields, "fits": outcome.fits_card, "layer_major": outcome.micro_batches_per_run > 1,
            "predicted_step_s": outcome.prediction.step_s * outcome.grad_accum / outcome.micro_batches_per_run,
            "predicted_tokens_per_s": outcome.prediction.tokens_per_s}


# plan()'s arguments that are settings of the run (megacompile/settings.py); the rest say what is
# planned (shapes, the model's objects) or for which hardware.
PLAN_SETTINGS = ("compute_dtype", "fuse", "host_budget", "nvme_budget", "grad_accum", "accumulation")


def hardware_profile(hardware: Any, nvme_bandwidth: float | None = None, host: str | None = None,
                     host_cores: int | None = None) -> HardwareProfile:
    """plan()'s `hardware` as a profile: a HardwareProfile as it is, a name or a profile.json, or
    "cpu": this machine's, measured when not cached yet (megacompile/calibrate); `host` ("desktop",
    "workstation", "server": cost/host.py) replaces its host side, and `host_cores` the cores its
    AdamW runs on (a datasheet host's: a profile.json holds its host's measured rate). The planner
    below only reads the profile it is handed."""
    if nvme_bandwidth is not None and (isinstance(nvme_bandwidth, bool) or not isinstance(nvme_bandwidth, (int, float))
                                       or not 0 < nvme_bandwidth < float("inf")):
        raise ArgumentError(f"nvme_bandwidth is the disk tier's disk bandwidth in GB/s, each way, and must be a "
                            f"positive finite number; got {nvme_bandwidth!r}")
    if not isinstance(hardware, (str, os.PathLike, HardwareProfile)):
        raise ArgumentError(f"hardware must be a profile name (e.g. \"h100\", \"cpu\"), a profile.json path or a "
                            f"HardwareProfile; got {hardware!r}")
    if isinstance(hardware, HardwareProfile):
        profile = hardware
    elif os.fspath(hardware).lower() == "cpu":
        profile = profile_for("cpu")
    else:
        profile = get_profile(os.fspath(hardware))
    if host is not None:
        from ..cost.host import with_host
        profile = with_host(profile, host)
    if host_cores is not None:
        if not isinstance(hardware, HardwareProfile) and os.fspath(hardware).lower().endswith(".json") \
                and host is None:
            raise ArgumentError(f"--host-cores {host_cores} with the measured profile {os.fspath(hardware)}: it "
                                "holds its host's own AdamW rate, measured on its cores; leave --host-cores out, or "
                                "give a datasheet host (--host server) to plan with another count")
        from ..cost.host import with_cores
        profile = with_cores(profile, host_cores)
    if nvme_bandwidth is not None:
        profile = replace(profile, disk_read_bw=nvme_bandwidth * 1e9, disk_write_bw=nvme_bandwidth * 1e9)
    return profile


def plan(model_or_config: Any, hbm_budget: float | None = None, *, settings: Settings | None = None,
         hardware: str | HardwareProfile = "h100", batch: int = 1,
         seq: int = 2048, compute_dtype: torch.dtype = torch.bfloat16, inputs: dict | None = None,
         optimizer: AdamW | None = None, loss_fn=None, train: bool = True, style: str | None = None,
         fuse: bool | None = Settings.fuse, host_budget: float | None = None, nvme_budget: float | None = None,
         nvme_bandwidth: float | None = None, grad_accum: int = Settings.grad_accum,
         accumulation: str = Settings.accumulation, ranks: tuple[int, int] | None = None,
         smallest: bool = False, images_per_row: int = 0, image_size: int | None = None,
         updates: str = Settings.updates) -> Plan:
    """The plan megacompile.compile() would run, built without weights or a device.

    `inputs` defaults to input_ids and labels of shape (batch, seq); any tensors given only lend
    their shapes (meta tensors are fine). Raises BudgetTooSmallError, naming the smallest budget,
    when nothing fits, and HostMemoryError when `host_budget` (GiB of host RAM; default: not
    limited) cannot hold the masters and AdamW state; offloaded activations are kept within it.
    `nvme_budget` (GiB of disk) lets the plan put the AdamW moments, then the fp32 masters, on a
    disk tier when host RAM is short; `nvme_bandwidth` (GB/s, each way) replaces the profile's disk
    bandwidth. `grad_accum` sizes the gradient buffers, and the time the disk tier has per step;
    `accumulation` ("micro" as compile()'s default, "layer", "auto") whether its micro-batches may run
    layer-major (passes/layer_major.py): "auto" takes it when predicted faster.
    `compute_dtype` defaults to bfloat16, what a GPU run is planned in (compile()'s is float32).
    `style` ("megatrain", "zero3") plans another system's schedule instead, for
    comparison, timed by the same cost model. `fuse` defaults to what compile() does on that
    hardware: the fused kernels on a GPU, none on the cpu backend. `ranks` (R, L): the plan of one
    of R data-parallel ranks, L per node; `host_budget` is then the node's, and the host check is
    the rank's sharded figure within 1/L of it (cost/host_shards.py).
    `images_per_row` (a vision-language model: LLaVA, Gemma 3, Idefics3, SmolVLM) plans rows that
    each hold that many images of `image_size` pixels a side (default: the vision tower's), laid
    out as the family's processor writes them (planner/image_inputs.py); the seq tokens of a row
    include its image tokens. The plan's `vision` then holds the vision tower's share of the
    predicted time and of the device peak (planner/vision_share.py).
    `minimum_budget_bytes` is the smallest budget for the plan's own blocks (whole, or over the
    sequence chunks it runs them in); below it the planner may still fit them over more chunks.
    With `smallest` it is the smallest budget any plan fits (planning at it fits, a little below it
    is refused; megacompile.minimum_budget names it without a plan): every chunk count is captured
    and solved, which can take as long again as the plan.
    `updates` ("at_commit" as compile()'s default, "as_gradients_land") where the host AdamW updates
    are placed and timed (compile()'s `updates`).
    `settings`: a megacompile.Settings holding the plain settings (hbm_budget, compute_dtype, fuse,
    host_budget, nvme_budget, grad_accum, accumulation, updates) instead of keywords; a keyword given beside
    it must agree with it.
    """
    settings = Settings(**from_call(plan, settings, dict(
        hbm_budget=hbm_budget, compute_dtype=compute_dtype, fuse=fuse, host_budget=host_budget,
        nvme_budget=nvme_budget, grad_accum=grad_accum, accumulation=accumulation, updates=updates)))
    budget_bytes = settings.budget_bytes
    planned = _Planned(model_or_config, settings, hardware=hardware, batch=batch, seq=seq, inputs=inputs,
                       optimizer=optimizer, loss_fn=loss_fn, train=train, style=style, nvme_bandwidth=nvme_bandwidth,
                       ranks=ranks, images_per_row=images_per_row, image_size=image_size)
    card = card_bytes(planned.profile)
    if style is not None:
        return planned.baseline(budget_bytes, style).revised(card_bytes=card)
    result = planned.at(budget_bytes)
    settled: dict[str, Any] = {"minimum_over_chunks": smallest, "notes": planned.notes,   # what this call adds
                               "card_bytes": card}
    if planned.images is not None:
        settled["vision"] = vision_share(result, *planned.images)
    if planned.captured.rechunk is not None:     # blocks that run over sequence chunks may fit lower
        settled["lowest_budget"] = planned.lowest
        if smallest:
            settled["minimum_budget_bytes"] = min(result.minimum_budget_bytes, planned.lowest())
    if result.micro_batches_per_run > 1 and planned.accumulation == "auto":
        host_cost = place_host_state(planned.captured, settings.compute_dtype, 1, planned.host_budget_bytes,
                                     settings.nvme_budget_bytes)
        settled.update(host_cost=host_cost, host_bytes=host_cost.ram_bytes)
    return result.revised(**settled)


def card_bytes(profile: HardwareProfile) -> int | None:
    """The memory of the card a plan is made for, which its device need is held to beside the
    budget: the profile's (a named card's datasheet figure, or a measured one's); None for the
    simulated cpu device, which is no card."""
    if profile.name.startswith("cpu") or not profile.device_bytes:
        return None
    return profile.device_bytes


def minimum_budget(model_or_config: Any, *, settings: Settings | None = None,
                   compute_dtype: torch.dtype = torch.bfloat16,
                   fuse: bool | None = Settings.fuse, host_budget: float | None = None,
                   nvme_budget: float | None = None, grad_accum: int = Settings.grad_accum,
                   accumulation: str = Settings.accumulation, **kwargs) -> float:
    """The smallest hbm_budget, in GiB, at which `model_or_config` (an nn.Module, on the meta
    device or not, or a Hugging Face config: a path, dict or PretrainedConfig) fits for these
    inputs: planning at it fits, and any smaller budget is refused with a BudgetTooSmallError that
    names it. The whole blocks or over sequence chunks, whichever fits less. kwargs: plan()'s
    (hardware, batch, seq, inputs, optimizer, loss_fn, train, nvme_bandwidth, ranks, images_per_row,
    image_size), with the same defaults; `settings` as plan()'s (its hbm_budget is not read)."""
    settings = Settings(**from_call(minimum_budget, settings, dict(
        compute_dtype=compute_dtype, fuse=fuse, host_budget=host_budget, nvme_budget=nvme_budget,
        grad_accum=grad_accum, accumulation=accumulation)))
    unknown = sorted(set(kwargs) - set(_Planned.WHAT) | ({"style"} & set(kwargs)))
    if unknown:
        raise ArgumentError(f"minimum_budget takes plan()'s arguments but hbm_budget, style and smallest; got "
                            f"{', '.join(unknown)}")
    # A bytes figure over 2**30 is exact as a float (a power of two divides it), so the GiB given
    # back plans at the very byte the refusal named.
    return _Planned(model_or_config, settings, **kwargs).lowest() / GiB


def minimum_budget_of(captured: CapturedModel, model: nn.Module, settings: Settings, hardware: Any,
                      train: bool = True) -> float:
    """minimum_budget(model, ...) from a training capture of it already made (`train` False: a
    forward-only one): a run that plans before it trains captures each input shape once
    (engine/prepared.py)."""
    ids = torch.empty(1, 1, dtype=torch.long, device="meta")     # stand-ins: the capture holds the shapes
    return _Planned(model, settings, hardware=hardware, inputs={"input_ids": ids}, captured=captured,
                    train=train).lowest() / GiB


def _context_notes(model: nn.Module, seq: int) -> tuple[str, ...]:
    """A warning, not a refusal, when the rows are longer than the model's context: rope scaling
    may extend it, but the positions past it were not trained as the config stands."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or seq <= limit:
        return ()
    return (f"seq {seq} is longer than the model's context (max_position_embeddings {limit}): positions past "
            f"{limit} were not trained; extend the context (rope_scaling in the config) or give seq <= {limit}",)


def _quantized_notes(model: nn.Module, settings: Settings) -> tuple[str, ...]:
    """A quantized checkpoint's config is planned as the full-precision model it describes: said."""
    config = getattr(model, "config", None)
    note = None if config is None else planning_note(config, str(settings.compute_dtype).replace("torch.", ""))
    return () if note is None else (note,)


class _Planned:
    """A model captured for plan(): the plan at any budget, from one capture."""
    WHAT = ("hardware", "batch", "seq", "inputs", "optimizer", "loss_fn", "train", "style", "nvme_bandwidth", "ranks",
            "images_per_row", "image_size")

    def __init__(self, model_or_config: Any, settings: Settings, *, hardware: Any = "h100", batch: int = 1,
                 seq: int = 2048, inputs: dict | None = None, optimizer: AdamW | None = None, loss_fn=None,
                 train: bool = True, style: str | None = None, nvme_bandwidth: float | None = None,
                 ranks: tuple[int, int] | None = None, images_per_row: int = 0, image_size: int | None = None,
                 captured: CapturedModel | None = None):
        self.settings, accumulation = settings, settings.accumulation
        host_budget_bytes = settings.host_budget_bytes
        if ranks is not None:     # as compile() under data parallelism: micro-batches one by one
            if accumulation == "layer":
                raise ArgumentError("accumulation='layer' is not supported with data parallelism yet")
            accumulation = "micro"
            host_budget_bytes = None if host_budget_bytes is None else host_budget_bytes // ranks[1]
        self.accumulation, self.host_budget_bytes, self.ranks = accumulation, host_budget_bytes, ranks
        if inputs is None:
            batch, seq = arguments.tokens(batch, seq)
        elif images_per_row or image_size is not None:
            raise ArgumentError("give either inputs or images_per_row/image_size: the images are laid out in the "
                                "inputs plan() builds from batch and seq")
        elif not isinstance(inputs, dict):
            raise ArgumentError(f"inputs must be a dict of tensors (e.g. input_ids, labels), got "
                                f"{type(inputs).__name__}")
        optimizer = given_optimizer(optimizer)
        from ..passes.baselines import STYLES
        if style is not None and style not in STYLES:
            raise ArgumentError(f"style must be one of {', '.join(STYLES)} (or None for megacompile's plan); "
                                f"got {style!r}")
        if isinstance(model_or_config, nn.Module):
            refuse_quantized_model(model_or_config)     # a model quantized in memory: refused as compile() does
        self.profile = profile = hardware_profile(hardware, nvme_bandwidth)
        model = model_or_config if isinstance(model_or_config, nn.Module) else model_from_config(model_or_config)
        if getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False
        self.notes = (_context_notes(model, seq) if inputs is None else ()) + _quantized_notes(model, settings)
        self.images = None      # (ImageSignature, the indexes of the inputs that hold images)
        if image_size is not None and not images_per_row:
            raise ArgumentError(f"image_size {image_size!r} was given without images_per_row: give the images in "
                                "each row too (images_per_row=1 or more)")
        if images_per_row:
            inputs, signature = image_inputs(model, batch, seq, images_per_row, image_size)
            self.images = (signature, [i for i, k in enumerate(inputs) if k.startswith("pixel_")])
        if inputs is None:
            ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
            inputs = {"input_ids": ids, "labels": ids}
        # Trace for a GPU when torch has one (attention then lowers to the GPU kernels); a CPU-only
        # torch cannot run autograd on fake CUDA tensors, so it traces the CPU kernels instead.
        gpu = torch.cuda.is_available() and not profile.name.startswith("cpu")
        device = torch.device("cuda" if gpu else "cpu")
        fuse = fused(settings.fuse, on_gpu=not profile.name.startswith("cpu"))     # as compile() would there

        def traced(flash_attention: bool = False) -> CapturedModel:
            with blocks_grouped_once():   # planning: the first blocks of each group stand for the rest
                return capture(model, (), inputs, device=device, compute_dtype=settings.compute_dtype,
                               loss_fn=loss_fn, train=train, flash_attention=flash_attention)
        if captured is None:
            # Qwen-VL's 3D rope positions are computed from the grids' values, as a step does.
            inputs = with_rope_positions(model, (), inputs)
            captured = traced()
        clip = optimizer.max_grad_norm is not None
        if train:
            settings.check_updates(clip=optimizer.max_grad_norm not in (None, math.inf),
                                   ranks=1 if ranks is None else ranks[0])
        self.kind = StepKind(update=train, clip=clip, updates=settings.updates)
        # A fused plan traced with cuDNN's attention is also planned with FlashAttention's, and the
        # faster of the two kept, as compile() does (planner/attention_choice.py).
        self.flash_captured = None
        if fuse:
            from ..fusion import fuse as fuse_stages
            if records_cudnn_attention(captured):
                self.flash_captured = fuse_stages(traced(flash_attention=True))
            captured = fuse_stages(captured)
        self.captured = captured
        self.host_cost = None
        if style is None:
            # Layer-major lands one gradient sum per step: its host state is that of grad_accum=1.
            self.host_cost = place_host_state(captured, settings.compute_dtype,
                                              host_accumulation(settings.grad_accum, accumulation),
                                              host_budget_bytes, settings.nvme_budget_bytes, ranks=ranks,
                                              updates=settings.updates)

    def baseline(self, budget_bytes: int, style: str) -> Plan:
        host_bytes = host_costs(self.captured, self.settings.compute_dtype)[0].ram_bytes
        return make_baseline_plan(self.captured, budget_bytes, style, host_bytes=host_bytes,
                                  backend=f"planned for {self.profile.name}", hardware=self.profile)

    def at(self, budget: int) -> Plan:
        request = PlanRequest(
            budget, self.kind, f"planned for {self.profile.name}", self.profile, host_bytes=self.host_cost.ram_bytes,
            host_cost=self.host_cost, host_budget_bytes=self.host_budget_bytes, grad_accum=self.settings.grad_accum,
            accumulation=self.accumulation)
        flash = self.flash_captured
        return faster_attention_plan(lambda c: make_plan(c, request), self.captured,
                                     None if flash is None else lambda: flash)

    def lowest(self) -> int:
        """Bytes: the smallest budget any plan fits (search.lowest_budget)."""
        return lowest_budget(self.at)
