"""Latent attention (DeepSeek: v's head dim narrower than q's and k's) in
megacompile::window_attention: torch's flash kernels do not take it, so SDPA runs its math path and
holds [B, Hq, S, S]; the operator takes it on every path, sum for sum with SDPA's math path on the
cpu, and a DeepSeek decoder is captured and planned with nothing of S x S."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import megacompile
from megacompile.attention import reference, window
from megacompile.capture import capture
from megacompile.cost.estimate import node_flops
from tests.families import FAMILIES, batch

B, HQ, HKV, S, D, DV, W = 2, 4, 2, 37, 24, 8, 5
SCALE = 0.3


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, S, h, D, generator=g).transpose(1, 2).to(dtype) for h in (HQ, HKV))
    v = torch.randn(B, S, HKV, DV, generator=g).transpose(1, 2).to(dtype)
    return q, k, v, torch.randn(B, HQ, S, DV, generator=g).to(dtype)


def _grads(f, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = f(q, k, v)
    return (o, *torch.autograd.grad(o, (q, k, v), do.to(o.dtype)))


def _kept():
    kept = torch.ones(B, S, dtype=torch.bool)
    kept[0, :5] = False
    return kept


def _sdpa(kept, dtype=None):
    """What transformers' SDPA path runs: no mask, is_causal and the key/value heads grouped by
    SDPA itself; a padding mask, the heads repeated as repeat_kv does and a [B, 1, S, S] boolean."""
    def run(q, k, v):
        q, k, v = (t.to(dtype or t.dtype) for t in (q, k, v))
        if kept is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
        k, v = (t.repeat_interleave(HQ // HKV, dim=1) for t in (k, v))
        mask = torch.ones(S, S, dtype=torch.bool).tril()[None, None] & kept[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=SCALE)
    return run


@pytest.mark.parametrize("padded", [False, True])
def test_on_the_cpu_it_is_sdpas_math_path_sum_for_sum(padded):
    q, k, v, do = _inputs()
    kept = _kept() if padded else None
    ours = _grads(lambda q, k, v: torch.ops.megacompile.window_attention(q, k, v, SCALE, S, None, kept)[0], q, k, v, do)
    assert ours[0].shape == (B, HQ, S, DV) and ours[3].shape == v.shape
    for got, want in zip(ours, _grads(_sdpa(kept), q, k, v, do)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", ["reference", "kernel"])
@pytest.mark.parametrize("w", [W, S])
def test_on_a_gpu_it_is_the_float64_answer(monkeypatch, path, w):
    """The float32 reference over query chunks, and the kernels in bf16 under the interpreter:
    v tiles of their own width, over a window or the whole causal band."""
    monkeypatch.setattr(window, "_on_gpu", lambda x: True)
    monkeypatch.setattr(reference, "CHUNK", 4)
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    q, k, v, do = _inputs(dtype)
    ours = _grads(lambda q, k, v: torch.ops.megacompile.window_attention(q, k, v, SCALE, w)[0], q, k, v, do)
    i = torch.arange(S)
    band = (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w)

    def exact(q, k, v):
        q, k, v = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
        return torch.softmax((q @ k.transpose(-1, -2) * SCALE).masked_fill(~band, float("-inf")), -1) @ v
    for got, want in zip(ours, _grads(exact, q, k, v, do)):
        torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=3e-2 if path == "kernel" else 2e-6)


def test_the_plan_counts_each_matmul_at_its_own_head_dim():
    q, k, v, _ = _inputs()
    graph = torch.fx.Graph()
    args = [graph.placeholder(n) for n in ("q", "k", "v")]
    for a, t in zip(args, (q, k, v)):
        a.meta["val"] = t
    node = graph.call_function(torch.ops.megacompile.window_attention.default, (*args, SCALE, S))
    pairs = S * (S + 1) / 2
    assert node_flops(node) == 2 * B * HQ * pairs * (D + DV)


def _square(template, seq):
    return [tuple(m.shape) for group in (template.acts, template.outputs, template.saved) for m in group
            if sum(d == seq for d in m.shape) >= 2]


def test_a_deepseek_decoder_is_captured_onto_the_operator():
    torch.manual_seed(0)
    ids = batch(t=24)
    captured = capture(FAMILIES["deepseek_v3"](), (), {"input_ids": ids, "labels": ids},
                       device=torch.device("cpu"), compute_dtype=torch.float32)
    blocks = [st.template for st in captured.stages if st.template.kind == "block"]
    assert blocks
    for template in blocks:
        assert not _square(template, 24)
        ops = [str(n.target) for n in template.forward.gm.graph.nodes if n.op == "call_function"]
        assert "megacompile.window_attention.default" in ops and "aten._safe_softmax.default" not in ops


def test_a_deepseek_plan_holds_nothing_of_s_by_s():
    """Planned for a GPU from a config (fake tensors): before, every block saved [1, 8, S, S]
    scores and probabilities of SDPA's math path."""
    config = dict(model_type="deepseek_v3", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                  kv_lora_rank=64, q_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
                  vocab_size=1000, max_position_embeddings=4096)
    plan = megacompile.plan(config, 80, batch=1, seq=1536, host_budget=64)
    for st in plan.captured.stages:
        assert not _square(st.template, 1536), st.template.kind
