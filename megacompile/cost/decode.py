"""A decode step of a key-value-cache generator: one new token for each of `rows` rows, from a
bfloat16 copy of the weights. Every weight is read once per step whatever the number of rows, and
each row reads its cache so far; the step takes the longest of its matmul work, its device-memory
reads and, when the copy does not fit the device, the weights' crossing of the host link.

The same profile figures as the per-op roofline (estimate.py): peak FLOP/s times the matmul
efficiency, device bandwidth times the memory efficiency, the fixed cost per launched op.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import HardwareProfile

BF16 = 2    # bytes per element of the generator's weights and cache


def cache_bytes_per_token(layers: int, kv_heads: int, head_dim: int, itemsize: int = BF16) -> int:
    """A row's key and value cache, per token: each layer's keys and values (bfloat16 by default)."""
    return 2 * layers * kv_heads * head_dim * itemsize


def cache_shape(model) -> tuple[int, int, int] | None:
    """(layers, key-value heads, head size) of a model's key-value cache, from its Hugging Face config
    (a vision-language model's text config); None where the config does not say."""
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    layers = getattr(text, "num_hidden_layers", None)
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    hidden = getattr(text, "hidden_size", None)
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                                   and heads > 0 else None)
    shape = (layers, kv_heads, head_dim)
    return shape if all(isinstance(x, int) for x in shape) else None


@dataclass(frozen=True)
class DecodeStep:
    seconds: float            # one token for every row
    compute_s: float          # the matmul work: 2 FLOPs per parameter per row (model_flops.forward_params)
    device_read_s: float      # weights (when held on the device) and the cache, from device memory
    link_s: float             # the weights over the host link (0 when the copy is on the device)
    weights_on_device: bool


def decode_step(hw: HardwareProfile, *, weight_bytes: int, flop_params: int, rows: int, cache_bytes: int,
                ops: int, weights_on_device: bool) -> DecodeStep:
    """`cache_bytes`: all rows' cache read this step; `ops`: kernels launched per step (those of one
    forward pass)."""
    compute = 2.0 * flop_params * rows / (hw.peak_bf16 * hw.matmul_efficiency)
    bandwidth = hw.device_bw * hw.memory_efficiency
    device = (cache_bytes + (weight_bytes if weights_on_device else 0)) / bandwidth
    link = 0.0 if weights_on_device else weight_bytes / hw.h2d_bw
    return DecodeStep(max(compute, device, link) + ops * hw.op_overhead_s, compute, device, link, weights_on_device)
