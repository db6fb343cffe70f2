"""Eager attention in megacompile::window_attention: GPT-OSS's attention sinks and Gemma 2's logit
softcapping on each path against transformers' own eager attention of those models, the sinks'
gradient kernel, the results where the caller laid them out, both decoders captured onto the
operator, and a span that model code reads as a tensor being the mask it stands for."""
from __future__ import annotations

import types

import pytest
import torch
import transformers
from transformers import masking_utils
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gpt_oss import modeling_gpt_oss

from megacompile.attention import reference, window
from megacompile.capture import capture
from megacompile.capture.attention_span import AttentionSpan
from megacompile.capture.hf_windows import span_attention, spans_without_mask
from megacompile.kernels import attention_sinks, outputs
from tests.families import FAMILIES, batch

B, HQ, HKV, S, D, W = 2, 4, 2, 37, 8, 5
SCALE = 0.3


def _inputs(dtype=torch.float32, seed=0):
    """q, k, v as transformers makes them ([B, S, H, D] projections viewed [B, H, S, D]), do, sinks."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).transpose(1, 2).to(dtype) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(B, HQ, S, D, generator=g).to(dtype), torch.randn(HQ, generator=g).to(dtype)


def _kept() -> torch.Tensor:
    """Row 0 padded on the left: its first 6 queries see no key, only their sink."""
    kept = torch.ones(B, S, dtype=torch.bool)
    kept[0, :6] = False
    return kept


def _eager(q, k, v, do, sinks, w, kept, dtype):
    """transformers' GPT-OSS eager attention on eager's additive mask; o and the gradients of q, k,
    v and the sinks."""
    q, k, v, sinks = (t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks))
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, sinks=sinks, training=False)
    i = torch.arange(S)
    seen = ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w))[None, None] & kept[:, None, None, :]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    o, _ = modeling_gpt_oss.eager_attention_forward(module, q, k, v, mask, scaling=SCALE)
    o = o.transpose(1, 2)
    return (o, *torch.autograd.grad(o, (q, k, v, sinks), do.to(dtype)))


def _ours(q, k, v, do, sinks, w, kept):
    q, k, v, sinks = (t.detach().requires_grad_() for t in (q, k, v, sinks))
    o, lse = torch.ops.megacompile.window_attention(q, k, v, SCALE, w, None, kept, sinks)
    assert lse.shape == (B, HQ, S) and torch.isfinite(lse).all()     # a row that sees no key has its sink
    return (o, *torch.autograd.grad(o, (q, k, v, sinks), do))


@pytest.mark.parametrize("path", ["host", "reference", "kernel"])
@pytest.mark.parametrize("w", [W, S])
def test_every_path_is_gpt_oss_eager_attention(monkeypatch, path, w):
    """The host path is transformers' GPT-OSS eager attention sum for sum (o and every gradient,
    the sinks' included); the GPU reference (float32) and the kernels (bf16, under the interpreter)
    are its float64 answer to their precision. A query that sees no key gets o = 0."""
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    if path != "host":
        monkeypatch.setattr(window, "_on_gpu", lambda x: True)
        monkeypatch.setattr(reference, "CHUNK", 4)
    q, k, v, do, sinks = _inputs(dtype)
    ours = _ours(q, k, v, do, sinks, w, _kept())
    assert (ours[0][0, :, :6] == 0).all()
    if path == "host":
        for got, want in zip(ours, _eager(q, k, v, do, sinks, w, _kept(), torch.float32)):
            assert torch.equal(got, want)
        return
    for got, want in zip(ours, _eager(q, k, v, do, sinks, w, _kept(), torch.float64)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=3e-2 if path == "kernel" else 2e-6)


CAP = 1.5     # small enough that tanh bends the test's scores


def _eager_softcapped(q, k, v, do, w, kept, dtype):
    """transformers' Gemma 2 eager attention (softcapping) on eager's additive mask."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    module = types.SimpleNamespace(num_key_value_groups=HQ // HKV, training=False)
    i = torch.arange(S)
    seen = ((i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w))[None, None] & kept[:, None, None, :]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, torch.finfo(dtype).min)
    o, _ = modeling_gemma2.eager_attention_forward(module, q, k, v, mask, scaling=SCALE, softcap=CAP)
    o = o.transpose(1, 2)
    return (o, *torch.autograd.grad(o, (q, k, v), do.to(dtype)))


@pytest.mark.parametrize("path", ["host", "reference", "kernel"])
@pytest.mark.parametrize("w", [W, S])
def test_every_path_is_gemma2_eager_attention_with_softcapping(monkeypatch, path, w):
    """Right padding shorter than the window, so every query sees a key (eager gives a row that
    sees none the mean of all values in float32 and NaN in float64, the operator 0: such a row is
    padding and reaches no loss)."""
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    if path != "host":
        monkeypatch.setattr(window, "_on_gpu", lambda x: True)
        monkeypatch.setattr(reference, "CHUNK", 4)
    q, k, v, do, _ = _inputs(dtype)
    q = q * 4           # scores past the cap
    kept = torch.ones(B, S, dtype=torch.bool)
    kept[1, S - 3:] = False
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = torch.ops.megacompile.window_attention(q, k, v, SCALE, w, None, kept, None, CAP)
    ours = (o, *torch.autograd.grad(o, (q, k, v), do))
    if path == "host":
        for got, want in zip(ours, _eager_softcapped(q, k, v, do, w, kept, torch.float32)):
            assert torch.equal(got, want)
        return
    uncapped = torch.ops.megacompile.window_attention(q, k, v, SCALE, w, None, kept)[0]
    assert (uncapped - o).abs().max() > 0.1                                         # the cap matters here
    for got, want in zip(ours, _eager_softcapped(q, k, v, do, w, kept, torch.float64)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=5e-2 if path == "kernel" else 2e-6)


def test_the_sinks_gradient_kernel_sums_every_row_of_each_head(monkeypatch):
    """-sum over (b, i) of exp(sink - lse) * delta, over several row blocks and a remainder, lse at
    the strides the forward leaves it, in the sinks' dtype."""
    monkeypatch.setattr(attention_sinks, "BLOCK", 16)
    g = torch.Generator().manual_seed(1)
    lse = torch.randn(HQ, B, S, generator=g).transpose(0, 1)          # [B, Hq, S], not contiguous
    delta = torch.randn(B, HQ, S, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        sinks = torch.randn(HQ, generator=g).to(dtype)
        got = attention_sinks.attention_sinks_backward(sinks, lse, delta)
        want = -(torch.exp(sinks.double()[None, :, None] - lse.double()) * delta.double()).sum((0, 2))
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, rtol=1e-5 if dtype == torch.float32 else 8e-3, atol=1e-6)


@pytest.mark.parametrize("path", ["host", "reference", "kernel"])
def test_the_backward_makes_its_results_where_the_caller_laid_them_out(monkeypatch, path):
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    if path != "host":
        monkeypatch.setattr(window, "_on_gpu", lambda x: True)
    q, k, v, do, sinks = _inputs(dtype)
    o, lse = torch.ops.megacompile.window_attention(q, k, v, SCALE, W, None, None, sinks)
    flash, kv = (S * HQ * D, D, HQ * D, 1), (S * HKV * D, D, HKV * D, 1)
    slots = [torch.empty_strided(q.shape, flash, dtype=dtype), torch.empty_strided(k.shape, kv, dtype=dtype),
             torch.empty_strided(v.shape, kv, dtype=dtype), torch.empty(B, HQ, S), torch.empty(HQ, dtype=dtype)]
    with outputs.into(list(slots)):
        made = torch.ops.megacompile.window_attention_sinks_backward(do, q, k, v, o, lse, SCALE, W, None, None, sinks)
    assert [t.data_ptr() for t in made] == [t.data_ptr() for t in slots]


def test_gpt_oss_is_captured_onto_the_operator_with_its_sinks():
    """Sliding-window layers and full ones alike: no [B, 1, S, S] mask reaches a block and none
    saves anything of S x S (eager attention saved its [B, Hq, S, S + 1] probabilities)."""
    torch.manual_seed(0)
    ids = batch(t=16)
    captured = capture(FAMILIES["gpt_oss"](), (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    windows = set()
    for stage in captured.stages:
        template = stage.template
        if template.kind != "block":
            continue
        assert not [m.shape for m in template.acts if len(m.shape) == 4]
        assert not [m.shape for m in template.saved if sum(d == 16 for d in m.shape) >= 2]
        nodes = [n for n in template.forward.gm.graph.nodes if "window_attention" in str(n.target)]
        assert len(nodes) == 1 and nodes[0].args[7] is not None      # the layer's sinks
        windows.add(nodes[0].args[4])
        backward = [str(n.target) for n in template.backward.gm.graph.nodes if n.op == "call_function"]
        assert "megacompile.window_attention_sinks_backward.default" in backward
    assert windows == {8, 16}                                           # sliding_window 8, and full
    assert "get_interface" not in vars(transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS)   # put back


def test_gemma2_is_captured_onto_the_operator_with_its_softcap():
    torch.manual_seed(0)
    ids = batch(t=16)
    model = FAMILIES["gemma2"]()
    captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    for stage in captured.stages:
        template = stage.template
        if template.kind == "block":
            assert not [m.shape for m in template.saved if sum(d == 16 for d in m.shape) >= 2]
            nodes = [n for n in template.forward.gm.graph.nodes if "window_attention" in str(n.target)]
            assert len(nodes) == 1 and nodes[0].args[8] == model.config.attn_logit_softcapping


def test_a_span_read_as_a_tensor_is_the_mask_it_stands_for():
    """Model code that adds the mask to its scores (BLOOM), slices it or reads its shape gets the
    mask transformers would have built: eager's additive one, or SDPA's boolean."""
    kept = _kept()
    band = masking_utils.sliding_window_causal_mask_function(W)
    common = dict(batch_size=B, q_length=S, kv_length=S, mask_function=band,
                  attention_mask=kept)
    eager = masking_utils.eager_mask(**common, dtype=torch.float32)
    sdpa = masking_utils.sdpa_mask(**common, allow_is_causal_skip=False)
    with spans_without_mask():
        span = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["eager"](**common, dtype=torch.float32)
        boolean = masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](**common)
    assert isinstance(span, AttentionSpan) and span.window == W and span.dtype == torch.float32
    scores = torch.randn(B, HQ, S, S)
    assert torch.equal(scores + span, scores + eager)
    assert torch.equal(span[:, :, :, :9], eager[:, :, :, :9]) and span.shape == eager.shape
    assert torch.equal(boolean.mask(), sdpa) and boolean.dtype == torch.bool


def test_eager_attention_takes_a_span_only_while_capturing():
    """A model's eager function, named as get_interface's default, records the operator for a span
    and gets the mask for what it computes itself (dropout); outside capture it is the model's."""
    calls = []

    def models_eager(module, q, k, v, mask, **kwargs):
        calls.append((mask, kwargs))
        return "eager", None

    interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
    q, k, v, _, sinks = _inputs()
    span = AttentionSpan(W, S, B, dtype=torch.float32)
    with span_attention():
        attention = interface.get_interface("eager", models_eager)
        out, weights = attention(torch.nn.Module(), q, k, v, span, scaling=SCALE, s_aux=sinks)
        assert out.shape == (B, S, HQ, D) and weights is None and not calls
        assert attention(torch.nn.Module(), q, k, v, span, dropout=0.1)[0] == "eager"
        assert torch.equal(calls[0][0], span.mask()) and calls[0][1] == {"dropout": 0.1}
    assert interface.get_interface("eager", models_eager) is models_eager


@pytest.mark.parametrize("extra", [{"softcap": 50.0}, {"s_aux": torch.zeros(4)}])
def test_an_sdpa_call_given_a_softcap_or_sinks_runs_transformers_own_sdpa(extra):
    """transformers' "sdpa" function does not apply a softcap or sinks (5.17 drops them, later
    releases raise on a softcap): routed onto the operator, such a call would compute what eager
    transformers does not. It runs the original with the mask; a model's eager function, which
    applies them, is routed."""
    from megacompile.capture.hf_windows import _span_attention
    calls = []

    def original(module, query, key, value, attention_mask, **kwargs):
        calls.append(attention_mask)
        return query.transpose(1, 2), None
    q = k = v = torch.randn(1, 4, 8, 8)
    span = AttentionSpan(8, 8, 1)
    module = torch.nn.Module()
    _span_attention(original)(module, q, k, v, span, scaling=0.25, **extra)
    assert len(calls) == 1 and isinstance(calls[0], torch.Tensor) and calls[0].shape[-2:] == (8, 8)
    out, _ = _span_attention(original, eager=True)(module, q, k, v, span, scaling=0.25, **extra)
    assert len(calls) == 1 and out.shape == (1, 8, 4, 8)


def test_gemma2_under_sdpa_is_refused_as_transformers_refuses_it():
    model = FAMILIES["gemma2"]()
    model.config._attn_implementation = "sdpa"
    ids = batch(t=16)
    if "does not support `softcap`" not in _eager_error(model, ids):
        pytest.skip("this transformers release drops the softcap under sdpa instead of refusing it")
    with pytest.raises(Exception, match="does not support `softcap`"):
        capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"), compute_dtype=torch.float32)


def _eager_error(model, ids) -> str:
    try:
        model(input_ids=ids, labels=ids)
    except ValueError as e:
        return str(e)
    return ""
