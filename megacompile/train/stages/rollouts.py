"""`stage: grpo`'s generator, chosen in run.yaml: TRL's keys for vLLM, ours for the rest.

    generator                    engine (default) | hf | hf_streamed      (ours)
    generator_dtype              bfloat16 (default) | float32: hf and hf_streamed's copy
    use_vllm                     false (default) | true                   (TRL's names from here on)
    vllm_mode                    colocate (TRL's default) | server
    vllm_server_base_url         the server's address; by default http://vllm_server_host:vllm_server_port
    vllm_server_host, _port      0.0.0.0 (this machine), 8000
    vllm_server_timeout          240: seconds to wait for the server to answer at the start
    vllm_gpu_memory_utilization  0.3: colocate
    vllm_max_model_length        colocate: vLLM's max_model_len (by default the row's length,
                                 max_prompt_length + max_completion_length)
    vllm_model_impl              vllm (default) | transformers | auto: colocate, vLLM's model_impl
    vllm_enable_sleep_mode       false (default) | true: colocate, vLLM's weights and cache released
                                 from the device between rollouts (posttrain/vllm_generator.py)
    vllm_importance_sampling_correction  true (TRL's default): weigh each completion token by the
                                 trained policy's probability over vLLM's (posttrain/sampling_correction.py)
    vllm_importance_sampling_mode        sequence_mask (default) | sequence_truncate | token_mask |
                                 token_truncate
    vllm_importance_sampling_clip_max    3.0 (null: no upper bound); _cap is its old name
    vllm_importance_sampling_clip_min    none

Without use_vllm, TRL ignores the vLLM keys: they are accepted at TRL's defaults (as its GRPOConfig
writes them) and refused otherwise. The sampling filters (top_k, top_p, min_p,
repetition_penalty: keys.py) reach every generator.

Each key is checked, and refused where it names a choice another key contradicts, before anything
is read or written (stages.py calls `check`); `make` builds the generator once the engine exists.
"""
from __future__ import annotations

import importlib
import os
import time
import urllib.error
import urllib.request

import torch

from ...errors import ArgumentError, MegacompileError
from ...posttrain import Filters, sampling_correction

GENERATORS = ("engine", "hf", "hf_streamed")
DTYPES = ("bfloat16", "float32")
MODES = ("colocate", "server")
IMPLS = ("vllm", "transformers", "auto")
KEYS = ("generator", "generator_dtype", "use_vllm", "vllm_mode", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_gpu_memory_utilization", "vllm_max_model_length",
        "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap")
CORRECTION = {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": sampling_correction.DEFAULT_MODE,
              "vllm_importance_sampling_clip_max": sampling_correction.DEFAULT_CLIP_MAX}       # TRL's defaults
# what TRL's GRPOConfig writes of the vLLM keys without use_vllm (vllm_mode: server before TRL 1)
TRL_DEFAULTS = {**CORRECTION, "vllm_mode": ("colocate", "server"), "vllm_server_host": "0.0.0.0",
                "vllm_server_port": 8000, "vllm_server_timeout": 240.0, "vllm_gpu_memory_utilization": 0.3,
                "vllm_model_impl": "vllm", "vllm_enable_sleep_mode": False}
# where vLLM is reached: a resumed run may name another server or share of the GPU
MAY_CHANGE = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
              "vllm_gpu_memory_utilization", "vllm_enable_sleep_mode")
# what a checkpoint saved before these keys existed sampled with
IMPLIED = {"generator": "engine", "use_vllm": False, "vllm_importance_sampling_correction": False,
           "vllm_importance_sampling_clip_min": None, "vllm_max_model_length": None, "vllm_model_impl": None}
WEIGHTS_DIR = "rollout_weights"     # in run_dir: where the vLLM server reads each update


def _at_trl_default(key: str, value) -> bool:
    default = TRL_DEFAULTS.get(key)
    if isinstance(default, tuple):
        return value in default
    return key in TRL_DEFAULTS and isinstance(value, bool) == isinstance(default, bool) and value == default


def saved(before: dict) -> dict:
    """A checkpoint's generator keys as this version names them: vllm_importance_sampling_cap was
    clip_max's name."""
    before = {**IMPLIED, **before}
    if "vllm_importance_sampling_clip_max" not in before:
        before["vllm_importance_sampling_clip_max"] = before.get("vllm_importance_sampling_cap")
    before["vllm_importance_sampling_cap"] = None
    return before


def check(c, raw: dict) -> None:
    given = [k for k in KEYS if raw.get(k) is not None]
    if c.use_vllm is None:
        c.use_vllm = False
    if not isinstance(c.use_vllm, bool):
        raise ArgumentError(f"use_vllm must be true or false; got {c.use_vllm!r}")
    if c.use_vllm:
        _vllm(c, given, raw)
        return
    # TRL's own defaults of the vLLM keys, which its GRPOConfig writes out: they do nothing here
    given = [k for k in given if not _at_trl_default(k, raw[k])]
    for key in KEYS:
        if key.startswith("vllm_"):
            setattr(c, key, None)
    c.vllm_importance_sampling_correction = False
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


def _vllm(c, given: list[str], raw: dict) -> None:
    ours = [k for k in ("generator", "generator_dtype") if k in given]
    if ours:
        raise ArgumentError(f"use_vllm: true samples with vLLM (in bfloat16), and {', '.join(ours)} choose"
                            f"{'s' if len(ours) == 1 else ''} another generator: leave "
                            f"{'it' if len(ours) == 1 else 'them'} out, or set use_vllm: false")
    c.generator = "vllm"
    _correction(c, raw)
    if c.loss_type == "vespo" and c.vllm_importance_sampling_correction and \
            not c.vllm_importance_sampling_mode.startswith("token"):
        raise ArgumentError(f"loss_type vespo takes the sampler's correction token by token into its weight: "
                            f"vllm_importance_sampling_mode token_truncate or token_mask, as TRL requires; got "
                            f"{c.vllm_importance_sampling_mode}")
    c.vllm_mode = "colocate" if c.vllm_mode is None else c.vllm_mode
    if c.vllm_mode not in MODES:
        raise ArgumentError(f"vllm_mode must be colocate (vLLM in this process, sharing the GPU; TRL's default) or "
                            f"server (a vllm serve on this machine); got {c.vllm_mode!r}")
    mine = ("vllm_gpu_memory_utilization", "vllm_max_model_length", "vllm_model_impl", "vllm_enable_sleep_mode") \
        if c.vllm_mode == "server" else \
        ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout")
    other = [k for k in given if k in mine and not _at_trl_default(k, raw[k])]
    if other:
        raise ArgumentError(f"{', '.join(other)} appl{'ies' if len(other) == 1 else 'y'} to vllm_mode "
                            f"{'colocate' if c.vllm_mode == 'server' else 'server'}"
                            + (" (a server takes its own: vllm serve --gpu-memory-utilization, --max-model-len)"
                               if c.vllm_mode == "server" else "; colocate runs vLLM in this process")
                            + f": leave {'it' if len(other) == 1 else 'them'} out, or set vllm_mode: "
                            f"{'colocate' if c.vllm_mode == 'server' else 'server'}")
    for key in mine:
        setattr(c, key, None)
    _server(c, given) if c.vllm_mode == "server" else _colocate(c)


def _correction(c, raw: dict) -> None:
    cap, clip_max = "vllm_importance_sampling_cap", "vllm_importance_sampling_clip_max"
    if raw.get(cap) is not None:
        if raw.get(clip_max) not in (None, raw[cap], sampling_correction.DEFAULT_CLIP_MAX):
            raise ArgumentError(f"{cap} is TRL's old name of {clip_max}, and both are given ({raw[cap]!r}, "
                                f"{raw[clip_max]!r}): give {clip_max} alone")
        c.vllm_importance_sampling_clip_max = raw[cap]
    elif clip_max not in raw:
        c.vllm_importance_sampling_clip_max = sampling_correction.DEFAULT_CLIP_MAX
    c.vllm_importance_sampling_cap = None       # null clip_max, given: no upper bound, as in TRL
    for key in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode"):
        if getattr(c, key) is None:
            setattr(c, key, CORRECTION[key])
    if not isinstance(c.vllm_importance_sampling_correction, bool):
        raise ArgumentError(f"vllm_importance_sampling_correction must be true or false; got "
                            f"{c.vllm_importance_sampling_correction!r}")
    for key in ("vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        value = getattr(c, key)
        if isinstance(value, int) and not isinstance(value, bool):
            setattr(c, key, float(value))
    sampling_correction.check(c.vllm_importance_sampling_mode, c.vllm_importance_sampling_clip_max,
                              c.vllm_importance_sampling_clip_min)


def _server(c, given: list[str]) -> None:
    if c.vllm_importance_sampling_correction and c.temperature not in (None, 1, 1.0):
        # the server's log-probabilities are before the temperature unless it was started otherwise
        print(f"  note           temperature {c.temperature:g} with vLLM's sampling correction: start the server "
              "with --logprobs-mode processed_logprobs, or its log-probabilities are before the temperature "
              "and the correction weighs the tokens wrongly", flush=True)
    host = "0.0.0.0" if c.vllm_server_host is None else c.vllm_server_host
    port = 8000 if c.vllm_server_port is None else c.vllm_server_port
    if not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int) \
            or not 0 < port < 65536:
        raise ArgumentError(f"vllm_server_host and vllm_server_port are where vllm serve listens (0.0.0.0 and "
                            f"8000 by default); got {host!r} and {port!r}")
    named = [k for k in ("vllm_server_host", "vllm_server_port") if k in given and not _at_trl_default(k, getattr(c, k))]
    if c.vllm_server_base_url is not None and named:
        raise ArgumentError(f"vllm_server_base_url {c.vllm_server_base_url!r} and vllm_server_host/_port {host}:{port} "
                            "say where the server is twice: give the address once")
    url = _url(host, port) if c.vllm_server_base_url is None else c.vllm_server_base_url
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ArgumentError(f"vllm_server_base_url is the server's address, e.g. http://localhost:8000; got "
                            f"{url!r}")
    c.vllm_server_base_url, c.vllm_server_host, c.vllm_server_port = url, None, None
    timeout = 240.0 if c.vllm_server_timeout is None else c.vllm_server_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise ArgumentError(f"vllm_server_timeout is how many seconds to wait for the server to answer at the "
                            f"start (TRL's default 240); got {timeout!r}")
    c.vllm_server_timeout = float(timeout)


def _url(host: str, port: int) -> str:
    # 0.0.0.0 is where vllm serve listens by default; reached from here it is this machine
    return f"http://{'localhost' if host == '0.0.0.0' else host}:{port}"


def _colocate(c) -> None:
    share = 0.3 if c.vllm_gpu_memory_utilization is None else c.vllm_gpu_memory_utilization
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1:
        raise ArgumentError(f"vllm_gpu_memory_utilization is the share of the GPU vLLM may take, in (0, 1], e.g. "
                            f"0.3; got {share!r}")
    c.vllm_gpu_memory_utilization = float(share)
    length = c.vllm_max_model_length
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < c.seq):
        raise ArgumentError(f"vllm_max_model_length is vLLM's max_model_len, at least a row's length "
                            f"(max_prompt_length + max_completion_length = {c.seq:,}), or left out for that; "
                            f"got {length!r}")
    if c.vllm_model_impl is not None and c.vllm_model_impl not in IMPLS:
        raise ArgumentError(f"vllm_model_impl must be one of {', '.join(IMPLS)} (vLLM's model_impl); got "
                            f"{c.vllm_model_impl!r}")
    if c.vllm_model_impl == "vllm":
        c.vllm_model_impl = None            # vLLM's default, as a checkpoint saved before the key says
    c.vllm_enable_sleep_mode = False if c.vllm_enable_sleep_mode is None else c.vllm_enable_sleep_mode
    if not isinstance(c.vllm_enable_sleep_mode, bool):
        raise ArgumentError(f"vllm_enable_sleep_mode must be true or false; got {c.vllm_enable_sleep_mode!r}")
    if not os.path.isdir(c.model):
        raise ArgumentError(f"use_vllm with vllm_mode colocate starts vLLM from the model's folder; model {c.model} "
                            "is not a folder: give the Hugging Face model folder, or set vllm_mode: server")
    try:
        importlib.import_module("vllm")
    except ImportError as e:
        from ...posttrain import MISSING
        raise MegacompileError(MISSING) from e


def filters(c) -> Filters:
    return Filters(c.top_k, c.top_p, c.min_p, c.repetition_penalty)


def wait_for_server(url: str, timeout: float, poll: float = 2.0) -> None:
    """Return once the server answers /health (vllm serve may still be loading when the run starts),
    or raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=max(1.0, min(poll, timeout))):
                return
        except urllib.error.HTTPError:
            return                  # it answers: a server without the route is still up
        except OSError as e:
            if time.monotonic() + poll > deadline:
                raise MegacompileError(f"the vLLM server at {url} did not answer in vllm_server_timeout "
                                       f"{timeout:g} s ({e}): start it (docs/posttraining.md), or raise "
                                       "vllm_server_timeout") from e
        time.sleep(poll)


def make(c, engine, eos_id: int | tuple[int, ...] | None, pad_id: int, run_dir: str, never: tuple[int, ...] = ()):
    """The run's generator over `engine`, whose masters it samples from (or copies); `eos_id`: the
    ids a completion stops at; `never`: ids it never draws (a vision-language model's image tokens,
    for the generators that sample prompts with images: the engine's and the hf copies)."""
    drawn = filters(c)
    if c.generator == "engine":
        from ...posttrain import EngineGenerator
        return EngineGenerator(engine, eos_id=eos_id, pad_id=pad_id, seed=c.seed, filters=drawn, never=never)
    if c.generator in ("hf", "hf_streamed"):
        from ...posttrain import HFGenerator
        from ...posttrain import StreamedHFGenerator
        kind = HFGenerator if c.generator == "hf" else StreamedHFGenerator
        return kind(engine, eos_id=eos_id, pad_id=pad_id, seed=c.seed, dtype=getattr(torch, c.generator_dtype),
                    filters=drawn, never=never)
    if c.vllm_mode == "colocate":
        from ...posttrain import VLLMGenerator
        impl = {} if c.vllm_model_impl is None else {"model_impl": c.vllm_model_impl}
        return VLLMGenerator(engine, model=c.model, eos_id=eos_id, seed=c.seed, filters=drawn,
                             sleep=c.vllm_enable_sleep_mode,
                             gpu_memory_utilization=c.vllm_gpu_memory_utilization,
                             max_model_len=c.vllm_max_model_length or c.seq, **impl)
    from ...posttrain import VLLMServerGenerator
    wait_for_server(c.vllm_server_base_url, c.vllm_server_timeout)
    return VLLMServerGenerator(engine, c.vllm_server_base_url, os.path.abspath(os.path.join(run_dir, WEIGHTS_DIR)),
                               eos_id=eos_id, seed=c.seed, filters=drawn)
