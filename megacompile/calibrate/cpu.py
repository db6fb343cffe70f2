"""This machine's host, measured: the simulated device of the cpu backend is this machine.

A short routine (a few seconds) times a matmul, a large copy, the two copy streams' copies at
once, an in-place update and the host AdamW (on a host stream thread, with the threads the engine
gives it, over 1 GiB of parameter state) and the runtime's cost per ATen call. The cost per
schedule node is fitted apart (node_overhead.py).
"""
from __future__ import annotations

import time

import torch

# The host AdamW is timed over this many parameters: 1 GiB of float32 master, gradient and both
# moments. Far past any host cache, as a large model's update is; a few tens of MB would sit in a
# big server's last-level cache and run several times faster than the real update.
HOST_ADAM_NUMEL = 2**30 // 16
# The in-place update that times the host's memory bandwidth for the cpu profile: 32 MiB, as the
# simulated device's working sets are. A GPU's host is timed over HOST_BW_BYTES instead: 32 MiB
# sits in a server's last-level cache (the fourth lease's H200 host read 280 GB/s over it, twice
# what its 16 cores' AdamW then streamed).
CPU_BW_BYTES = 32 * 2**20
HOST_BW_BYTES = 2**30

from ..cost.hardware import HardwareProfile


def _median_seconds(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def measure(host_adam_numel: int = HOST_ADAM_NUMEL, bandwidth_bytes: int = CPU_BW_BYTES) -> HardwareProfile:
    """The cpu profile's figures but the node overhead, which keeps its default until fitted.
    host_adam_numel: the parameters the host AdamW is timed over; bandwidth_bytes: the buffer the
    in-place update that times the memory bandwidth runs over."""
    n = 512
    own = torch.Generator().manual_seed(0)     # the global stream is the model's dropout's, not ours
    a, b = torch.randn(n, n, generator=own), torch.randn(n, n, generator=own)
    matmul = 2 * n**3 / _median_seconds(lambda: a @ b)
    big = torch.zeros(bandwidth_bytes // 4)     # zeros: the pages are touched before the timing
    inplace_bw = 2 * big.numel() * 4 / _median_seconds(lambda: big.mul_(1.0))
    big = big[:CPU_BW_BYTES // 4]
    other = torch.empty_like(big)
    link_bw = duplex_copy_bw(big, other)
    adam = host_adam_rate(host_adam_numel)
    overhead = _interpreter_overhead()
    # The simulated device is host memory: "device" bandwidth is a host memory copy, and each
    # link direction a copy on its own stream thread while the other direction's runs.
    return HardwareProfile("cpu (simulated device, measured)", 2**40, inplace_bw, matmul, matmul, link_bw, link_bw,
                           inplace_bw, adam, overhead, matmul_efficiency=1.0, memory_efficiency=1.0,
                           workspace_bytes=0, fragmentation=0.0, hidden_scratch=False)


def duplex_copy_bw(a: torch.Tensor, b: torch.Tensor, repeat: int = 3) -> float:
    """B/s of one copy stream's copies while the other stream copies too, as a step's prefetches
    (h2d) and offloads (d2h) run: each stream copies its own pair of buffers, like `a` and `b`."""
    from ..runtime.backend import Timeline
    from ..runtime.stream import ThreadStream
    pairs = [(torch.empty_like(a), a), (torch.empty_like(b), b)]
    streams = [ThreadStream(name, Timeline()) for name in ("h2d", "d2h")]
    seconds: list[float] = []

    def copies(dst: torch.Tensor, src: torch.Tensor):
        def run() -> None:
            start = time.perf_counter()
            for _ in range(repeat):
                dst.copy_(src)
            seconds.append((time.perf_counter() - start) / repeat)
        return run
    try:
        for (dst, src), stream in zip(pairs, streams):   # warm up
            stream.submit(lambda d=dst, s=src: d.copy_(s), "").wait()
        for event in [stream.submit(copies(*pair), "") for pair, stream in zip(pairs, streams)]:
            event.wait()
    finally:
        for stream in streams:
            stream.close()
    return 2 * a.numel() * a.element_size() / max(seconds)


def host_adam_rate(numel: int = HOST_ADAM_NUMEL, compute_dtype: torch.dtype = torch.float32, repeat: int = 3) -> float:
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
