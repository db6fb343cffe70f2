"""What the calibration measures on: the host AdamW over 1 GiB of parameter state, attention at a
training shape, the links both ways at once. The GPU paths run here on a stubbed torch.cuda, with
the cpu standing in for the device and small sizes passed in."""
from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import torch

import megacompile.calibrate.cpu as cpu
import megacompile.calibrate.gpu as gpu
from megacompile.optim import fused_adamw

SMALL = gpu.GpuSizes(matmul=64, copy_bytes=2**16, attention=(1, 2, 64, 16), host_adam_numel=2**16,
                     host_bw_bytes=2**20, repeat=2)


def test_the_host_adamw_is_calibrated_on_a_gibibyte_of_state():
    state_bytes = 4 * 4        # float32 master, gradient, exp_avg, exp_avg_sq per parameter
    assert cpu.HOST_ADAM_NUMEL * state_bytes >= 2**30
    assert gpu.GpuSizes().host_adam_numel == cpu.HOST_ADAM_NUMEL
    assert gpu.GpuSizes().attention == (4, 32, 4096, 128)


def test_a_gpus_host_bandwidth_is_timed_past_a_servers_cache(monkeypatch):
    """The cpu profile times its bandwidth over 32 MiB, as the simulated device's tensors are; a GPU's
    host over 1 GiB, which no last-level cache holds, as the host state a step updates."""
    assert gpu.GpuSizes().host_bw_bytes >= 2**30 and cpu.CPU_BW_BYTES == 32 * 2**20
    timed = []
    mul = torch.Tensor.mul_

    def seen(t, *args):
        timed.append(t.numel() * t.element_size())
        return mul(t, *args)
    monkeypatch.setattr(torch.Tensor, "mul_", seen)
    monkeypatch.setattr(cpu, "host_adam_rate", lambda numel, **kw: 1e9)
    cpu.measure(host_adam_numel=2**16, bandwidth_bytes=2**22)
    assert set(timed) == {2**22}
    timed.clear()
    cpu.measure(host_adam_numel=2**16)
    assert set(timed) == {cpu.CPU_BW_BYTES}


def test_the_host_adamw_rate_runs_on_the_size_it_is_given(monkeypatch):
    sizes = []
    update = fused_adamw.adamw_update_

    def counted(master, *args, **kwargs):
        sizes.append(master.numel())
        return update(master, *args, **kwargs)
    monkeypatch.setattr(fused_adamw, "adamw_update_", counted)
    assert cpu.host_adam_rate(3 * 2**16, repeat=2) > 0
    assert sizes == [3 * 2**16] * 3          # a warm-up, then the timed updates


def test_the_cpu_profile_passes_its_adamw_size_down(monkeypatch):
    asked = []
    monkeypatch.setattr(cpu, "host_adam_rate", lambda numel, **kw: asked.append(numel) or 1e9)
    profile = cpu.measure(host_adam_numel=2**16)
    assert asked == [2**16] and profile.host_adam_params_per_s == 1e9
    assert profile.h2d_bw == profile.d2h_bw > 0 and profile.attention_efficiency == 1.0


class _Log:
    """What the stubbed torch.cuda saw, in order."""
    def __init__(self):
        self.calls: list[tuple] = []
        self.current = "default"


def _stub_cuda(monkeypatch, log: _Log) -> None:
    class Event:
        def __init__(self, enable_timing=False):
            self.at = None

        def record(self, stream=None):
            self.at = time.perf_counter()
            log.calls.append(("record", stream.name if stream is not None else log.current, self))

        def synchronize(self):
            log.calls.append(("event sync", self))

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3 + 1e-3      # ms, never zero

    class Stream:
        count = 0

        def __init__(self, device=None):
            Stream.count += 1
            self.name = f"stream{Stream.count}"

        def wait_event(self, event):
            log.calls.append(("wait", self.name, event))

    @contextmanager
    def stream(s):
        before, log.current = log.current, s.name
        try:
            yield
        finally:
            log.current = before

    class Properties:
        total_memory = 80 * 2**30
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.calls.append(("sync",)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Stub GPU")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: Properties())


def test_the_links_are_timed_both_ways_at_once(monkeypatch):
    log = _Log()
    _stub_cuda(monkeypatch, log)
    copies = []
    real_copy = torch.Tensor.copy_

    def copy(dst, src, non_blocking=False):
        copies.append(log.current)
        return real_copy(dst, src, non_blocking=non_blocking)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    h2d, d2h = gpu.link_bandwidths(torch.device("cpu"), 2**12, repeat=3)
    assert h2d > 0 and d2h > 0
    timed = copies[2:]                                  # after one warm-up copy each way
    assert timed == ["stream1", "stream2"] * 3          # issued in turn, each on its own stream
    kinds = [c[0] for c in log.calls]
    start = kinds.index("record")
    # one start both streams wait on, no synchronisation until both ends are recorded
    assert kinds[start:start + 3] == ["record", "wait", "wait"]
    assert kinds[start + 3:start + 5] == ["record", "record"]
    assert {c[1] for c in log.calls[start + 3:start + 5]} == {"stream1", "stream2"}
    assert "sync" not in kinds[start:] and kinds[start + 5:] == ["event sync", "event sync"]


def test_the_gpu_profile_through_a_stubbed_cuda(monkeypatch):
    log = _Log()
    _stub_cuda(monkeypatch, log)
    adam_sizes = []
    rate = cpu.host_adam_rate
    monkeypatch.setattr(cpu, "host_adam_rate", lambda numel, **kw: adam_sizes.append(numel) or rate(numel, **kw))
    monkeypatch.setattr(gpu, "host_adam_rate", lambda numel, **kw: adam_sizes.append((numel, kw)) or 5e8)
    attention = []
    measured = gpu.attention_flops_per_s
    monkeypatch.setattr(gpu, "attention_flops_per_s", lambda *a: attention.append(measured(*a)) or attention[-1])
    bandwidth = []
    measure = cpu.measure
    monkeypatch.setattr(gpu, "measure", lambda **kw: bandwidth.append(kw["bandwidth_bytes"]) or measure(**kw))
    profile = gpu.measure_gpu(torch.device("cpu"), SMALL)
    assert bandwidth == [SMALL.host_bw_bytes]
    assert profile.name == "Stub GPU (measured)" and profile.device_bytes == 80 * 2**30
    assert adam_sizes == [SMALL.host_adam_numel, (SMALL.host_adam_numel, {"compute_dtype": torch.bfloat16})]
    assert profile.host_adam_params_per_s == 5e8
    assert attention and profile.attention_efficiency == pytest.approx(attention[0] / profile.peak_bf16)
    assert profile.fused_attention_efficiency is not None and profile.fused_attention_efficiency > 0
    assert min(profile.peak_bf16, profile.peak_fp32, profile.device_bw, profile.h2d_bw, profile.d2h_bw) > 0
    assert profile.matmul_efficiency == profile.memory_efficiency == 1.0


def test_attention_is_counted_as_the_cost_model_counts_it(monkeypatch):
    """Forward and backward at the causal share of torch's formulas (cost/estimate.py prices the
    op with the same count), spelled out for one shape so a change to either shows."""
    monkeypatch.setattr(gpu, "gpu_seconds", lambda fn, device, repeat: fn() or 1.0)
    b, h, s, d = 1, 2, 64, 16
    flops = gpu.attention_flops_per_s(torch.device("cpu"), (b, h, s, d), 1, torch.Generator().manual_seed(0))
    forward = 4 * b * h * s * s * d               # QK^T and PV
    backward = 2.5 * forward                      # five matmuls of that size
    assert flops == pytest.approx(0.5 * (forward + backward))


def test_the_attention_kernel_is_counted_as_the_cost_model_counts_it(monkeypatch):
    """Forward as torch counts it, backward at the seven matmuls the kernel runs, the causal share."""
    monkeypatch.setattr(gpu, "gpu_seconds", lambda fn, device, repeat: fn() or 1.0)
    b, h, s, d = 1, 2, 64, 16
    flops = gpu.fused_attention_flops_per_s(torch.device("cpu"), (b, h, s, d), 1, torch.Generator().manual_seed(0))
    forward = 4 * b * h * s * s * d
    assert flops == pytest.approx(0.5 * (forward + 3.5 * forward))


def test_an_attention_kernel_that_fails_on_the_device_leaves_torchs_price(monkeypatch):
    def fails(fn, device, repeat):
        raise RuntimeError("out of resource: shared memory")
    monkeypatch.setattr(gpu, "gpu_seconds", fails)
    with pytest.warns(RuntimeWarning, match="prices it as torch's attention"):
        assert gpu.fused_attention_flops_per_s(torch.device("cpu"), (1, 2, 16, 16), 1,
                                               torch.Generator().manual_seed(0)) is None
