"""This machine's GPU and host, measured into a profile (`megacompile calibrate --device cuda`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import warnings

from ..cost.estimate import CAUSAL_SHARE, KERNEL_FLOPS
from ..cost.hardware import HardwareProfile
from .cpu import HOST_ADAM_NUMEL, HOST_BW_BYTES, host_adam_rate, measure


@dataclass(frozen=True)
class GpuSizes:
    """What each measurement runs on. The defaults are a training step's sizes: matmuls large
    enough to reach peak, attention at a 7B-class shape (batch, heads, sequence, head width), and
    the host AdamW over 1 GiB of parameter state, well past any host cache."""
    matmul: int = 8192
    copy_bytes: int = 2**28                                   # 256 MiB each way
    attention: tuple[int, int, int, int] = (4, 32, 4096, 128)
    host_adam_numel: int = HOST_ADAM_NUMEL
    host_bw_bytes: int = HOST_BW_BYTES                        # past a server's last-level cache
    repeat: int = 10


def measure_gpu(device: torch.device | None = None, sizes: GpuSizes = GpuSizes()) -> HardwareProfile:
    """A profile of this machine's GPU and host, measured: dense bf16 and fp32 matmuls, causal bf16
    attention forward and backward (the share of the bf16 matmul rate it reaches), device memory
    bandwidth, pinned host<->device copies both ways at once (as a step runs them), host memory
    bandwidth and the host AdamW as the engine runs it (host stream, its threads, bf16 copy-out).
    Efficiencies are 1.0 but attention's: the peaks are what was reached, not datasheet figures."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    n = sizes.matmul
    own = torch.Generator(device=device).manual_seed(0)     # leaves the global streams to the model
    peaks = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.empty(n, n, device=device, dtype=dtype).uniform_(-1, 1, generator=own)
        peaks[dtype] = 2 * n**3 / gpu_seconds(lambda: a @ a, device, sizes.repeat)
    attention = attention_flops_per_s(device, sizes.attention, sizes.repeat, own)
    fused = fused_attention_flops_per_s(device, sizes.attention, sizes.repeat, own)
    big = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(big)
    device_bw = 2 * big.numel() / gpu_seconds(lambda: other.copy_(big), device, sizes.repeat)
    h2d, d2h = link_bandwidths(device, sizes.copy_bytes, sizes.repeat)
    cpu = measure(host_adam_numel=sizes.host_adam_numel, bandwidth_bytes=sizes.host_bw_bytes)
    return HardwareProfile(f"{torch.cuda.get_device_name(device)} (measured)",
                           torch.cuda.get_device_properties(device).total_memory, device_bw,
                           peaks[torch.bfloat16], peaks[torch.float32], h2d, d2h, cpu.host_bw,
                           host_adam_rate(sizes.host_adam_numel, compute_dtype=torch.bfloat16), 5e-6,
                           matmul_efficiency=1.0, memory_efficiency=1.0,
                           attention_efficiency=attention / peaks[torch.bfloat16],
                           fused_attention_efficiency=None if fused is None else fused / peaks[torch.bfloat16])


def gpu_seconds(fn, device: torch.device, repeat: int) -> float:
    """Seconds per call of `fn`, by CUDA events around `repeat` calls after one to warm up."""
    fn()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def attention_flops_per_s(device: torch.device, shape: tuple[int, int, int, int], repeat: int,
                          generator: torch.Generator) -> float:
    """FLOP/s of causal bf16 F.scaled_dot_product_attention, forward and backward, counted as the
    cost model counts them (torch's formulas, the causal share: cost/estimate.py), so the share of
    the matmul rate found here is the one the model prices attention at."""
    q, k, v, grad = (torch.empty(shape, device=device, dtype=torch.bfloat16).uniform_(-1, 1, generator=generator)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)
    flops = CAUSAL_SHARE * (sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape))
    return flops / gpu_seconds(step, device, repeat)


def fused_attention_flops_per_s(device: torch.device, shape: tuple[int, int, int, int], repeat: int,
                                generator: torch.Generator) -> float | None:
    """FLOP/s of megacompile's causal bf16 attention kernel (kernels/attention.py), forward and
    backward, counted as the cost model counts that kernel (the matmuls it runs, the causal share);
    None, with a warning, where it does not run here (a fused plan then prices it as torch's)."""
    from ..kernels.attention import attention
    q, k, v, grad = (torch.empty(shape, device=device, dtype=torch.bfloat16).uniform_(-1, 1, generator=generator)
                     for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step() -> None:
        torch.autograd.grad(attention(q, k, v, True), (q, k, v), grad)
    flops = KERNEL_FLOPS["attention"](q, k, v, True) + KERNEL_FLOPS["attention_backward"](grad, q, k, v, None, None, True)
    try:
        return flops / gpu_seconds(step, device, repeat)
    except Exception as e:  # noqa: BLE001 - a kernel that fails here must not cost the rest of the profile
        warnings.warn(f"megacompile's attention kernel did not run on this GPU ({type(e).__name__}: {e}); the "
                      "profile prices it as torch's attention", RuntimeWarning, stacklevel=2)
        return None


def link_bandwidths(device: torch.device, nbytes: int, repeat: int) -> tuple[float, float]:
    """Host->device and device->host B/s with both directions in flight at once, as a step runs
    its prefetches beside its offloads: each on its own stream, issued in turn, each timed from a
    common start to its own end. One direction at a time would miss what sharing the link (and
    the host memory behind it) costs."""
    pinned = device.type == "cuda"      # page-locked host memory, as the engine's host buffers
    up_src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    down_dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    up_dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    down_src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    streams = torch.cuda.Stream(device), torch.cuda.Stream(device)
    copies = (lambda: up_dst.copy_(up_src, non_blocking=True),
              lambda: down_dst.copy_(down_src, non_blocking=True))
    for copy in copies:                 # warm up
        copy()
    torch.cuda.synchronize(device)
    start = torch.cuda.Event(enable_timing=True)
    ends = [torch.cuda.Event(enable_timing=True) for _ in streams]
    start.record()
    for stream in streams:
        stream.wait_event(start)
    for _ in range(repeat):
        for stream, copy in zip(streams, copies):
            with torch.cuda.stream(stream):
                copy()
    for stream, end in zip(streams, ends):
        end.record(stream)
    for end in ends:
        end.synchronize()
    h2d, d2h = (nbytes * repeat / (start.elapsed_time(end) / 1e3) for end in ends)
    return h2d, d2h
