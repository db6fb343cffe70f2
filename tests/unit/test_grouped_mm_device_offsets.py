"""On a GPU the grouped matmul keeps the expert offsets on the device: neither torch._grouped_mm
(bf16, sm_90+) nor the Triton grouped GEMM (elsewhere) reads them on the host, forward or backward,
so an MoE layer queues its kernels without waiting. The GPU is stubbed: the cpu tensors take the
GPU paths (torch._grouped_mm has a cpu kernel; Triton runs on its interpreter), and any .tolist()
or .item() raises."""
from __future__ import annotations

import importlib

import pytest
import torch

from megacompile.capture.experts import static_experts

moe = importlib.import_module("megacompile.moe.grouped_mm")    # the module; the package exports the op by that name

COUNTS = (0, 24, 8, 0, 32)       # rows per expert: empty ones first, last and in between


def _host_read(self, *args, **kwargs):
    raise AssertionError(f"a host read of a {self.dtype} tensor {list(self.shape)} on the GPU path")


def _run(x, w, offs, dy):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = moe.grouped_mm(x, w, offs)
    y.backward(dy)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("dtype, capability, kernel", [
    (torch.bfloat16, (9, 0), "torch._grouped_mm"),
    (torch.bfloat16, (8, 0), "triton"),
    (torch.float32, (9, 0), "triton"),
])
def test_the_gpu_paths_never_read_the_offsets_on_the_host(monkeypatch, dtype, capability, kernel):
    g = torch.Generator().manual_seed(0)
    rows, k, n = sum(COUNTS), 16, 24
    x, w = torch.randn(rows, k, generator=g).to(dtype), torch.randn(len(COUNTS), k, n, generator=g).to(dtype)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    expected = [t.float() for t in _run(x, w, offs, dy)]          # the cpu path: host offsets

    calls = []
    grouped = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append("torch._grouped_mm") or grouped(*a, **kw))
    import megacompile.kernels.grouped_gemm as triton_kernels
    for name in ("grouped_gemm", "grouped_gemm_weight_grad"):
        real = getattr(triton_kernels, name)
        monkeypatch.setattr(triton_kernels, name, lambda *a, _real=real: calls.append("triton") or _real(*a))
    monkeypatch.setattr(moe, "_on_gpu", lambda t: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.Tensor, "tolist", _host_read)
    monkeypatch.setattr(torch.Tensor, "item", _host_read)
    got = _run(x, w, offs, dy)
    monkeypatch.undo()

    assert calls == [kernel] * 3                 # forward, then dx and dw in the backward
    tol = dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a.float(), b, **tol)


def test_the_cpu_path_reads_them(monkeypatch):
    """The guard above can see a host read: the cpu path makes one per call."""
    offs = torch.tensor([2, 4], dtype=torch.int32)
    monkeypatch.setattr(torch.Tensor, "tolist", _host_read)
    with pytest.raises(AssertionError, match="host read"):
        moe.grouped_mm(torch.randn(4, 8), torch.randn(2, 8, 8), offs)


def test_the_experts_forward_routes_on_the_device(monkeypatch):
    """Sorting, the offsets and the un-sort of a whole experts layer read nothing on the host."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    config = transformers.Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():       # the experts' weights start as torch.empty
            p.normal_(0, 0.2)
    x = torch.randn(1, 6, 16)
    with static_experts(block):
        expected = block(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        monkeypatch.setattr(moe, "_on_gpu", lambda t: True)
        monkeypatch.setattr(torch.Tensor, "tolist", _host_read)
        monkeypatch.setattr(torch.Tensor, "item", _host_read)
        got = block(x)
        got = got[0] if isinstance(got, tuple) else got
        monkeypatch.undo()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
