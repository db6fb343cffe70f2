"""This machine's GPU and host, measured into a profile (`megacompile calibrate --device cuda`)."""
from __future__ import annotations

import torch

from ..cost.hardware import HardwareProfile
from .cpu import host_adam_rate, measure


def measure_gpu(device: torch.device | None = None) -> HardwareProfile:
    """A profile of this machine's GPU and host, measured: dense bf16 and fp32 matmuls, device
    memory bandwidth, pinned host<->device copies each way, host memory bandwidth and the host
    AdamW as the engine runs it (host stream, its threads, bf16 copy-out). Efficiencies are 1.0:
    the peaks are what was reached, not datasheet figures."""
    device = device or torch.device("cuda", torch.cuda.current_device())

    def gpu_seconds(fn, repeat: int = 10) -> float:
        fn()
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / repeat

    n = 8192
    own = torch.Generator(device=device).manual_seed(0)     # leaves the global streams to the model
    peaks = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.empty(n, n, device=device, dtype=dtype).uniform_(-1, 1, generator=own)
        peaks[dtype] = 2 * n**3 / gpu_seconds(lambda: a @ a)
    big = torch.empty(2**28, dtype=torch.uint8, device=device)      # 256 MiB
    other = torch.empty_like(big)
    device_bw = 2 * big.numel() / gpu_seconds(lambda: other.copy_(big))
    host = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
    h2d = big.numel() / gpu_seconds(lambda: big.copy_(host, non_blocking=True))
    d2h = big.numel() / gpu_seconds(lambda: host.copy_(big, non_blocking=True))
    cpu = measure()
    return HardwareProfile(f"{torch.cuda.get_device_name(device)} (measured)",
                           torch.cuda.get_device_properties(device).total_memory, device_bw,
                           peaks[torch.bfloat16], peaks[torch.float32], h2d, d2h, cpu.host_bw,
                           host_adam_rate(compute_dtype=torch.bfloat16), 5e-6, matmul_efficiency=1.0,
                           memory_efficiency=1.0)
