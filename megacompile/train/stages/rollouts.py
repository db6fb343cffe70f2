"""`stage: grpo`'s generator, chosen in run.yaml: TRL's keys for vLLM, ours for the rest.

    generator                    engine (default) | hf | hf_streamed      (ours)
    generator_dtype              bfloat16 (default) | float32: hf and hf_streamed's copy
    use_vllm                     false (default) | true                   (TRL's names from here on)
    vllm_mode                    server (TRL's default) | colocate
    vllm_server_base_url         http://localhost:8000: server
    vllm_gpu_memory_utilization  0.3: colocate
    vllm_importance_sampling_correction  true (TRL's default): weigh each completion token by the
                                 trained policy's probability over vLLM's (posttrain/sampling_correction.py)
    vllm_importance_sampling_mode        sequence_mask (default) | sequence_truncate | token_mask |
                                 token_truncate
    vllm_importance_sampling_cap         3.0

Without use_vllm, TRL ignores the last three: they are accepted at TRL's defaults (as its
GRPOConfig writes them) and refused otherwise.

Each key is checked, and refused where it names a choice another key contradicts, before anything
is read or written (stages.py calls `check`); `make` builds the generator once the engine exists.
"""
from __future__ import annotations

import importlib
import os

import torch

from ...errors import ArgumentError, MegacompileError
from ...posttrain import sampling_correction
from ..methods import adapters

GENERATORS = ("engine", "hf", "hf_streamed")
DTYPES = ("bfloat16", "float32")
MODES = ("server", "colocate")
KEYS = ("generator", "generator_dtype", "use_vllm", "vllm_mode", "vllm_server_base_url",
        "vllm_gpu_memory_utilization", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_cap")
CORRECTION = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": sampling_correction.DEFAULT_MODE,
              "vllm_importance_sampling_cap": sampling_correction.DEFAULT_CAP}       # TRL's defaults
# where vLLM is reached: a resumed run may name another server or share of the GPU
MAY_CHANGE = ("vllm_server_base_url", "vllm_gpu_memory_utilization")
# what a checkpoint saved before these keys existed sampled with
IMPLIED = {"generator": "engine", "use_vllm": False, "vllm_importance_sampling_correction": False}
WEIGHTS_DIR = "rollout_weights"     # in run_dir: where the vLLM server reads each update


def check(c, raw: dict) -> None:
    given = [k for k in KEYS if raw.get(k) is not None]
    if c.use_vllm is None:
        c.use_vllm = False
    if not isinstance(c.use_vllm, bool):
        raise ArgumentError(f"use_vllm must be true or false; got {c.use_vllm!r}")
    if adapters(c) and (c.use_vllm or c.generator not in (None, "engine")):
        chosen = "use_vllm: true" if c.use_vllm else f"generator: {c.generator}"
        raise ArgumentError(f"finetuning_type: lora with {chosen}: a generation copy takes plain weights, and a "
                            "LoRA policy's are the frozen base plus its adapters; sample with generator: engine "
                            "(the policy's own forward), or train full")
    if c.use_vllm:
        _vllm(c, given)
        return
    # TRL's own defaults of the correction, which its GRPOConfig writes out: they do nothing here
    given = [k for k in given if not (k in CORRECTION and raw[k] == CORRECTION[k])]
    c.vllm_importance_sampling_correction = False
    c.vllm_importance_sampling_mode = c.vllm_importance_sampling_cap = None
    vllm_only = [k for k in given if k.startswith("vllm_")]
    if vllm_only:
        raise ArgumentError(f"{', '.join(vllm_only)} appl{'ies' if len(vllm_only) == 1 else 'y'} to sampling with "
                            f"vLLM: set use_vllm: true, or leave {'it' if len(vllm_only) == 1 else 'them'} out")
    c.generator = "engine" if c.generator is None else c.generator
    if c.generator not in GENERATORS:
        raise ArgumentError(f"generator must be one of {', '.join(GENERATORS)} (engine: the policy's own forward; "
                            f"hf: a copy with a key-value cache on the device; hf_streamed: the copy's layers "
                            f"streamed from host memory), or use_vllm: true; got {c.generator!r}")
    if c.generator == "engine":
        if c.generator_dtype is not None:
            raise ArgumentError(f"generator_dtype is the dtype of generator hf's copy, and generator engine samples "
                                f"from the masters in compute_dtype; got generator_dtype {c.generator_dtype!r}: "
                                "leave it out, or set generator: hf")
        return
    c.generator_dtype = "bfloat16" if c.generator_dtype is None else c.generator_dtype
    if c.generator_dtype not in DTYPES:
        raise ArgumentError(f"generator_dtype must be one of {', '.join(DTYPES)}; got {c.generator_dtype!r}")


def _vllm(c, given: list[str]) -> None:
    ours = [k for k in ("generator", "generator_dtype") if k in given]
    if ours:
        raise ArgumentError(f"use_vllm: true samples with vLLM (in bfloat16), and {', '.join(ours)} choose"
                            f"{'s' if len(ours) == 1 else ''} another generator: leave "
                            f"{'it' if len(ours) == 1 else 'them'} out, or set use_vllm: false")
    c.generator = "vllm"
    for key, default in CORRECTION.items():
        if getattr(c, key) is None:
            setattr(c, key, default)
    if not isinstance(c.vllm_importance_sampling_correction, bool):
        raise ArgumentError(f"vllm_importance_sampling_correction must be true or false; got "
                            f"{c.vllm_importance_sampling_correction!r}")
    if isinstance(c.vllm_importance_sampling_cap, int) and not isinstance(c.vllm_importance_sampling_cap, bool):
        c.vllm_importance_sampling_cap = float(c.vllm_importance_sampling_cap)
    sampling_correction.check(c.vllm_importance_sampling_mode, c.vllm_importance_sampling_cap)
    c.vllm_mode = "server" if c.vllm_mode is None else c.vllm_mode
    if c.vllm_mode not in MODES:
        raise ArgumentError(f"vllm_mode must be colocate (vLLM in this process, sharing the GPU) or server (a "
                            f"vllm serve on this machine); got {c.vllm_mode!r}")
    if c.vllm_mode == "server":
        if c.vllm_importance_sampling_correction and c.temperature not in (None, 1, 1.0):
            # the server's log-probabilities are before the temperature unless it was started otherwise
            print(f"  note           temperature {c.temperature:g} with vLLM's sampling correction: start the server "
                  "with --logprobs-mode processed_logprobs, or its log-probabilities are before the temperature "
                  "and the correction weighs the tokens wrongly", flush=True)
        if "vllm_gpu_memory_utilization" in given:
            raise ArgumentError("vllm_gpu_memory_utilization applies to vllm_mode colocate; a server takes its own "
                                "(vllm serve --gpu-memory-utilization): leave it out")
        url = "http://localhost:8000" if c.vllm_server_base_url is None else c.vllm_server_base_url
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ArgumentError(f"vllm_server_base_url is the server's address, e.g. http://localhost:8000; got "
                                f"{url!r}")
        c.vllm_server_base_url = url
        return
    if "vllm_server_base_url" in given:
        raise ArgumentError("vllm_server_base_url applies to vllm_mode server; colocate runs vLLM in this process: "
                            "leave it out, or set vllm_mode: server")
    share = 0.3 if c.vllm_gpu_memory_utilization is None else c.vllm_gpu_memory_utilization
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ArgumentError(f"vllm_gpu_memory_utilization is the share of the GPU vLLM may take, in (0, 1], e.g. "
                            f"0.3; got {share!r}")
    c.vllm_gpu_memory_utilization = float(share)
    if not os.path.isdir(c.model):
        raise ArgumentError(f"use_vllm with vllm_mode colocate starts vLLM from the model's folder; model {c.model} "
                            "is not a folder: give the Hugging Face model folder")
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        from ...posttrain import MISSING
        raise MegacompileError(MISSING) from e


def make(c, engine, eos_id: int | tuple[int, ...] | None, pad_id: int, run_dir: str):
    """The run's generator over `engine`, whose masters it samples from (or copies); `eos_id`: the
    ids a completion stops at."""
    if c.generator == "engine":
        from ...posttrain import EngineGenerator
        return EngineGenerator(engine, eos_id=eos_id, pad_id=pad_id, seed=c.seed)
    if c.generator in ("hf", "hf_streamed"):
        from ...posttrain import HFGenerator
        from ...posttrain import StreamedHFGenerator
        kind = HFGenerator if c.generator == "hf" else StreamedHFGenerator
        return kind(engine, eos_id=eos_id, pad_id=pad_id, seed=c.seed, dtype=getattr(torch, c.generator_dtype))
    if c.vllm_mode == "colocate":
        from ...posttrain import VLLMGenerator
        return VLLMGenerator(engine, model=c.model, eos_id=eos_id, seed=c.seed,
                             gpu_memory_utilization=c.vllm_gpu_memory_utilization, max_model_len=c.seq)
    from ...posttrain import VLLMServerGenerator
    return VLLMServerGenerator(engine, c.vllm_server_base_url, os.path.abspath(os.path.join(run_dir, WEIGHTS_DIR)),
                               eos_id=eos_id, seed=c.seed)
