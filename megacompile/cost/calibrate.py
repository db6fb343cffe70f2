"""Measure the `cpu` profile: the simulated device is this machine, so its numbers are measured.

A short routine (a few seconds) times a matmul, a large copy, an in-place update and the host
AdamW on this machine (on a host stream thread, with the threads the engine gives it), then runs
a small model on the cpu backend to fit the runtime's cost per schedule node, and caches the profile in MEGACOMPILE_CACHE_DIR (default ~/.cache/megacompile)
keyed by the CPU and torch's thread count.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import torch

from .hardware import HardwareProfile


def _median_seconds(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _cache_path() -> Path:
    root = Path(os.environ.get("MEGACOMPILE_CACHE_DIR", Path.home() / ".cache" / "megacompile"))
    key = f"{platform.machine()}-{platform.processor() or 'cpu'}-{os.cpu_count()}-t{torch.get_num_threads()}"
    return root / f"cpu_profile-v3-{key.replace(' ', '_').replace('/', '_')}.json"


def measure() -> HardwareProfile:
    n = 512
    own = torch.Generator().manual_seed(0)     # the global stream is the model's dropout's, not ours
    a, b = torch.randn(n, n, generator=own), torch.randn(n, n, generator=own)
    matmul = 2 * n**3 / _median_seconds(lambda: a @ b)
    big = torch.empty(32 * 2**20 // 4)
    other = torch.empty_like(big)
    copy_bw = 2 * big.numel() * 4 / _median_seconds(lambda: other.copy_(big))
    inplace_bw = 2 * big.numel() * 4 / _median_seconds(lambda: big.mul_(1.0))
    adam = host_adam_rate()
    overhead = _interpreter_overhead()
    # The simulated device is host memory: "device" bandwidth and both link directions are
    # host memory copies.
    return HardwareProfile("cpu (simulated device, measured)", 2**40, inplace_bw, matmul, matmul, copy_bw, copy_bw,
                           inplace_bw, adam, overhead, matmul_efficiency=1.0, memory_efficiency=1.0,
                           workspace_bytes=0, fragmentation=0.0, hidden_scratch=False)


def host_adam_rate(numel: int = 4 * 2**20, compute_dtype: torch.dtype = torch.float32, repeat: int = 3) -> float:
    """Params/s of the host AdamW as the engine runs it: on the host stream's thread with the
    intra-op threads that stream gets, over one owner's flat fp32 master, m, v and accumulated
    fp32 gradient, writing the compute copy when compute is not fp32 (Engine._adamw)."""
    from ..optim.fused_adamw import adamw_update_
    from ..runtime.backend import Timeline
    from ..runtime.stream import ThreadStream
    master, grad, m, v = (torch.zeros(numel) for _ in range(4))
    out = None if compute_dtype == torch.float32 else torch.empty(numel, dtype=compute_dtype)
    host = ThreadStream("host", Timeline(), threads=None)
    seconds = []

    def update() -> None:
        start = time.perf_counter()
        adamw_update_(master, grad, m, v, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                      out=out)
        seconds.append(time.perf_counter() - start)
    try:
        for _ in range(repeat + 1):
            host.submit(update, "adamw").wait()
    finally:
        host.close()
    return numel / sorted(seconds[1:])[len(seconds[1:]) // 2]


def _interpreter_overhead(ops: int = 200) -> float:
    """Seconds per op the runtime adds around each ATen call: a chain of tiny adds run the way
    the executor runs stage graphs, with every value held and dropped in the device ledger."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ..ir.stage_program import StageProgram
    from ..runtime.memory import DeviceMemory

    def chain(x):
        for _ in range(ops):
            x = x + 1
        return (x,)
    small = torch.zeros(4)
    program = StageProgram(make_fx(chain, tracing_mode="fake")(small))
    memory = DeviceMemory(2**40)
    run = lambda: program.run([small], lambda n, v: memory.hold(n, v), lambda n, v: memory.drop(n, v))  # noqa: E731
    return _median_seconds(run) / ops


def cpu_profile(refresh: bool = False) -> HardwareProfile:
    path = _cache_path()
    if not refresh and path.exists():
        try:
            return HardwareProfile(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            pass   # a stale or foreign file: measure again
    profile = measure()
    _save(path, profile)    # the fit below plans with it
    try:
        profile = replace(profile, node_overhead_s=_fit_node_overhead(profile))
    except BaseException:
        path.unlink(missing_ok=True)    # never leave a half-calibrated profile behind
        raise
    _save(path, profile)
    return profile


def _save(path: Path, profile: HardwareProfile) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile.to_dict()))
    os.replace(tmp, path)


def _fit_node_overhead(profile: HardwareProfile, steps: int = 7) -> float:
    """Seconds per schedule node the cpu backend spends beyond the per-op model: Python dispatch,
    handoffs to the copy and host threads, and those threads competing with the compute thread
    for the cores. A small Llama (4 blocks, width 64, 2 x 32 tokens) trains a few steps; the gap
    between its median step and the prediction without node overhead is spread over its nodes."""
    import statistics

    from .. import compile as compile_model
    from ..models.llama import LlamaConfig, TinyLlama
    from .predict import predict
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig(vocab=256, dim=64, layers=4, heads=4, kv_heads=2, ffn=128))
        ids = torch.randint(0, 256, (2, 32))
        engine = compile_model(model, hbm_budget=1.0, device="cpu")
        try:
            plan = engine.prepare(input_ids=ids, labels=ids)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step(input_ids=ids, labels=ids)
                engine.synchronize()
                times.append(time.perf_counter() - start)
        finally:
            engine.close()
    measured = statistics.median(times[1:])
    bare = predict(plan.program, plan.captured, replace(profile, node_overhead_s=0.0)).step_s
    return max(0.0, (measured - bare) / len(plan.program.nodes))


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
