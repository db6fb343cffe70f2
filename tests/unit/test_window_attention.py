"""Sliding-window attention with no mask tensor (megacompile/attention/window.py,
capture/hf_windows.py): each path of the operator against eager PyTorch's masked SDPA, results
made where the caller laid them out, the window read from the model's own mask function, and a
captured sliding-window decoder holding nothing of S x S."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import masking_utils

import megacompile
from megacompile.attention import reference, window
from megacompile.capture import capture
from megacompile.capture.hf_windows import AttentionSpan, _span_attention, window_of
from megacompile.cost.estimate import is_attention, node_flops
from megacompile.cost.reserve import window_scratch
from megacompile.kernels import outputs
from tests.families import FAMILIES, batch

B, HQ, HKV, S, D, W = 2, 4, 2, 37, 8, 5
SCALE = 0.3


def _inputs(dtype=torch.float32, seed=0):
    """q, k, v as transformers makes them: [B, S, H, D] projections viewed [B, H, S, D]."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g).transpose(1, 2).to(dtype) for h in (HQ, HKV, HKV))
    return q, k, v, torch.randn(B, HQ, S, D, generator=g).to(dtype)


def _band(seq: int, w: int) -> torch.Tensor:
    i = torch.arange(seq)
    return (i[:, None] - i[None, :] >= 0) & (i[:, None] - i[None, :] < w)


def _eager(q, k, v, do, dtype=None):
    """What transformers' SDPA path computes for a sliding-window layer: the key/value heads
    repeated, a [B, 1, S, S] boolean mask; its output and gradients."""
    q, k, v = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k, v))
    groups = HQ // HKV
    kr = k[:, :, None].expand(B, HKV, groups, S, D).reshape(B, HQ, S, D)
    vr = v[:, :, None].expand(B, HKV, groups, S, D).reshape(B, HQ, S, D)
    o = F.scaled_dot_product_attention(q, kr, vr, attn_mask=_band(S, W).expand(B, 1, S, S), scale=SCALE)
    return (o, *torch.autograd.grad(o, (q, k, v), do.to(o.dtype)))


def _ours(q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = torch.ops.megacompile.window_attention(q, k, v, SCALE, W)
    assert lse.shape == (B, HQ, S) and lse.dtype == torch.float32
    return (o, *torch.autograd.grad(o, (q, k, v), do))


def test_on_the_cpu_it_is_eagers_masked_sdpa_sum_for_sum():
    q, k, v, do = _inputs()
    for ours, eager in zip(_ours(q, k, v, do), _eager(q, k, v, do)):
        assert torch.equal(ours, eager)


def test_the_gpu_reference_over_query_chunks_is_the_float64_answer(monkeypatch):
    """float32 (or heads past 256) on a GPU: chunks of query rows, each against the keys it sees;
    chunks shorter than the window and not dividing S, so rows see keys of the chunk before."""
    monkeypatch.setattr(reference, "CHUNK", 4)
    q, k, v, do = _inputs()
    expected = _eager(q, k, v, do, torch.float64)
    o, lse = reference.forward_reference(q, k, v, SCALE, W)
    dq, dk, dv, delta = reference.backward_reference(do, q, k, v, o, lse, SCALE, W)
    for ours, want in zip((o, dq, dk, dv), expected):
        torch.testing.assert_close(ours.double(), want, rtol=0, atol=2e-6)
    torch.testing.assert_close(delta.double(), (do.double() * expected[0]).sum(-1), rtol=0, atol=2e-6)


def test_half_precision_on_a_gpu_runs_the_windowed_kernels(monkeypatch):
    """The GPU dispatch, run on the host under the Triton interpreter with the device stubbed."""
    monkeypatch.setattr(window, "_on_gpu", lambda x: True)
    called = []
    from megacompile.kernels import attention as kernels
    forward = kernels.attention_forward
    monkeypatch.setattr(kernels, "attention_forward", lambda *a, **kw: called.append(kw) or forward(*a, **kw))
    q, k, v, do = _inputs(torch.bfloat16)
    assert window.uses_kernel(q) and not window.uses_kernel(q.float())
    ours = _ours(q, k, v, do)
    assert called == [{"window": W, "starts": None, "kept": None, "sinks": None, "softcap": 0.0}]
    for got, want in zip(ours, _eager(q, k, v, do, torch.float64)):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-2)


@pytest.mark.parametrize("path", ["host", "reference", "kernel"])
def test_every_path_makes_its_results_where_the_caller_laid_them_out(monkeypatch, path):
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    if path != "host":
        monkeypatch.setattr(window, "_on_gpu", lambda x: True)
    q, k, v, do = _inputs(dtype)
    flash = (S * HQ * D, D, HQ * D, 1)
    slots = [torch.empty_strided(q.shape, flash, dtype=dtype), torch.empty(B, HQ, S)]
    with outputs.into(list(slots)):
        o, lse = torch.ops.megacompile.window_attention(q, k, v, SCALE, W)
    assert o.data_ptr() == slots[0].data_ptr() and lse.data_ptr() == slots[1].data_ptr()
    kv = (S * HKV * D, D, HKV * D, 1)
    grads = [torch.empty_strided(q.shape, flash, dtype=dtype), torch.empty_strided(k.shape, kv, dtype=dtype),
             torch.empty_strided(v.shape, kv, dtype=dtype), torch.empty(B, HQ, S)]
    with outputs.into(list(grads)):
        made = torch.ops.megacompile.window_attention_backward(do, q, k, v, o, lse, SCALE, W)
    assert [t.data_ptr() for t in made] == [t.data_ptr() for t in grads]


def test_the_window_is_read_from_the_models_own_mask_function():
    sliding = masking_utils.sliding_window_causal_mask_function(6)
    assert window_of(sliding, 2, 40) == 6
    assert window_of(sliding, 2, 6) is None                      # it holds the whole sequence: plain causal
    assert window_of(masking_utils.causal_mask_function, 2, 40) is None
    # Not a band: chunked attention, a bidirectional image span laid over it, one that reads traced values.
    chunked = masking_utils.and_masks(masking_utils.causal_mask_function, lambda b, h, q, kv: kv // 8 == q // 8)
    assert window_of(chunked, 2, 40) is None
    image = masking_utils.or_masks(sliding, lambda b, h, q, kv: (q >= 10) & (q < 14) & (kv >= 10) & (kv < 14))
    assert window_of(image, 2, 40) is None
    per_row = masking_utils.and_masks(sliding, lambda b, h, q, kv: b == 0)
    assert window_of(per_row, 2, 40) is None

    def unreadable(b, h, q, kv):
        raise RuntimeError("reads a tensor it cannot")
    assert window_of(unreadable, 2, 40) is None


def test_what_the_operator_does_not_compute_gets_the_mask_the_window_stands_for():
    seen = {}

    def transformers_sdpa(module, q, k, v, mask, **kwargs):
        seen.update(mask=mask, **kwargs)
        return "transformers", None

    attention = _span_attention(transformers_sdpa)
    q, k, v, _ = _inputs()
    module = torch.nn.Module()
    mask = AttentionSpan(W, S, B)
    out, _ = attention(module, q, k, v, mask, scaling=SCALE)
    assert out.shape == (B, S, HQ, D) and out.is_contiguous() and not seen
    for kwargs in ({"dropout": 0.1}, {"softcap": -1.0}, {"s_aux": torch.zeros(HQ + 1)}, {"is_causal": False}):
        seen.clear()
        assert attention(module, q, k, v, mask, **kwargs)[0] == "transformers"
        assert torch.equal(seen["mask"], _band(S, W).expand(B, 1, S, S)), kwargs
    # Another mask (a tensor, or None) goes through untouched.
    for other in (None, torch.ones(B, 1, S, S, dtype=torch.bool)):
        seen.clear()
        attention(module, q, k, v, other)
        assert seen["mask"] is other


def _capture(name, seq=16):
    torch.manual_seed(0)
    ids = batch(t=seq)
    return capture(FAMILIES[name](), (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)


def test_a_sliding_window_decoder_is_captured_onto_the_operator():
    captured = _capture("qwen2_sliding")        # window 8 over 16 tokens in layers 2 and 3
    blocks = {id(st.template): st.template for st in captured.stages if st.template.kind == "block"}

    def ops(block):
        return {str(n.target) for g in (block.forward, block.backward) for n in g.gm.graph.nodes
                if n.op == "call_function"}
    full, sliding = sorted(blocks.values(), key=lambda b: "megacompile.window_attention.default" in ops(b))
    assert {"megacompile.window_attention.default", "megacompile.window_attention_backward.default"} <= ops(sliding)
    assert not any("scaled_dot_product" in op for op in ops(sliding))
    assert any("scaled_dot_product" in op for op in ops(full))     # the full-attention layers: is_causal
    for block in (full, sliding):
        assert not [m.shape for m in block.acts if len(m.shape) == 4 and m.shape[-1] == m.shape[-2] == 16]
    block = sliding
    node = next(n for n in block.forward.gm.graph.nodes if "window_attention" in str(n.target))
    assert is_attention(node)
    batch_size, heads, seq, dim = node.args[0].meta["val"].shape
    assert node_flops(node) == 4 * batch_size * heads * (16 * 8 - 8 * 7 / 2) * dim
    assert window_scratch(node) > 0              # float32 on a GPU: the reference's heads and scores
    # The transformers interfaces are theirs again after the capture.
    assert masking_utils.ALL_MASK_ATTENTION_FUNCTIONS["sdpa"] is masking_utils.sdpa_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    assert transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


MISTRAL = dict(model_type="mistral", hidden_size=1024, intermediate_size=2816, num_attention_heads=8,
               num_key_value_heads=2, num_hidden_layers=2, vocab_size=32000, max_position_embeddings=32768,
               sliding_window=1024)


def test_a_mistral_block_at_8x8192_holds_nothing_of_s_by_s():
    """The mask the window stood for was a [8, 1, 8192, 8192] boolean in the prologue (512 MiB)
    and an additive one in every block (1 GiB in bf16)."""
    seq = 8192
    plan = megacompile.plan(MISTRAL, 80, batch=8, seq=seq)
    for st in plan.captured.stages:
        t = st.template
        square = [m.shape for group in (t.acts, t.outputs, t.saved) for m in group
                  if sum(d == seq for d in m.shape) >= 2]
        assert not square, (t.kind, square)


def test_the_reserve_counts_the_reference_scratch_only_where_the_kernels_do_not_run():
    def scratch(dtype, dim, backward):
        q, k = torch.empty(2, 8, 4096, dim, dtype=dtype), torch.empty(2, 2, 4096, dim, dtype=dtype)
        return reference.reference_scratch_bytes(q, k, 1024, backward)
    assert scratch(torch.bfloat16, 128, True) == scratch(torch.float16, 256, False) == 0
    heads = 2 * 8 * 4096 * 128 * 4              # float32 [B, Hq, S, D]
    chunk = 2 * 8 * 256 * (256 + 1023) * 4      # a chunk's scores
    assert scratch(torch.float32, 128, False) == 2 * heads + 3 * chunk
    assert scratch(torch.float32, 128, True) == 4 * heads + 3 * chunk
    assert scratch(torch.bfloat16, 512, False) > 0


def _documents_mask(starts: torch.Tensor, w: int) -> torch.Tensor:
    keys = torch.arange(S)
    return _band(S, w)[None, None] & (keys[None, None, None, :] >= starts[:, None, :, None])


@pytest.mark.parametrize("path", ["host", "reference", "kernel"])
@pytest.mark.parametrize("w", [W, S])
@pytest.mark.parametrize("kind", ["documents", "padding"])
def test_packed_documents_and_padding_on_every_path_are_eagers_mask(monkeypatch, path, w, kind):
    """Documents: each query sees its own document's keys alone (a one-token document, boundaries
    inside tiles). Padding: row 0 padded on the left (its first queries see no key: o = 0 and no
    gradient, as eager's), row 1 on the right. Within a window or not (w = S: plain causal)."""
    from megacompile.kernels.reference import document_starts
    starts = document_starts([[1, 9, 1, S - 11], [20, S - 20]]) if kind == "documents" else None
    kept = None
    if kind == "padding":
        kept = torch.ones(B, S, dtype=torch.bool)
        kept[0, :7], kept[1, S - 9:] = False, False
    dtype = torch.bfloat16 if path == "kernel" else torch.float32
    if path != "host":
        monkeypatch.setattr(window, "_on_gpu", lambda x: True)
        monkeypatch.setattr(reference, "CHUNK", 4)
    q, k, v, do = _inputs(dtype)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o, _ = torch.ops.megacompile.window_attention(q, k, v, SCALE, w, starts, kept)
    ours = (o, *torch.autograd.grad(o, (q, k, v), do))
    groups = HQ // HKV
    eager_dtype = torch.float32 if path == "host" else torch.float64
    qe, ke, ve = (t.detach().to(eager_dtype).requires_grad_() for t in (q, k, v))
    kr = ke[:, :, None].expand(B, HKV, groups, S, D).reshape(B, HQ, S, D)
    vr = ve[:, :, None].expand(B, HKV, groups, S, D).reshape(B, HQ, S, D)
    if starts is not None:
        mask = _documents_mask(starts, w)
    else:
        mask = _band(S, w)[None, None] & kept[:, None, None, :]
    oe = F.scaled_dot_product_attention(qe, kr, vr, attn_mask=mask, scale=SCALE)
    eager = (oe, *torch.autograd.grad(oe, (qe, ke, ve), do.to(eager_dtype)))
    if kind == "padding":
        assert (ours[0][0, :, :7] == 0).all() and (ours[1][0, :, :7] == 0).all()    # no key seen: o = 0, dq = 0
    for got, want in zip(ours, eager):
        if path == "host":
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.double(), want.double(), rtol=0, atol=2e-2 if path == "kernel" else 2e-6)


def test_document_starts_follow_transformers_sequence_index():
    from megacompile.capture.hf_windows import document_starts
    positions = torch.tensor([[0, 1, 2, 0, 0, 1, 5, 6], [3, 4, 5, 6, 7, 8, 9, 10]])
    from transformers.masking_utils import find_packed_sequence_indices
    index = find_packed_sequence_indices(positions)
    if index is None:      # one sequence per row everywhere: transformers answers None
        index = torch.zeros_like(positions)
    # A new sequence wherever the positions do not go up by one: 0 1 2 | 0 | 0 1 | 5 6.
    assert document_starts(index).tolist() == [[0, 0, 0, 3, 4, 4, 6, 6], [0] * 8]


def test_operands_the_operator_cannot_read_are_named():
    from megacompile.errors import CaptureError
    q, k, v, _ = _inputs()
    for bad in (dict(window=0), dict(starts=torch.zeros(B, S + 1, dtype=torch.int32)),
                dict(starts=torch.zeros(B, S)), dict(kept=torch.ones(B, S, dtype=torch.long))):
        args = dict(window=W, starts=None, kept=None) | bad
        with pytest.raises(CaptureError, match="window_attention takes") as refused:
            torch.ops.megacompile.window_attention(q, k, v, SCALE, args["window"], args["starts"], args["kept"])
        assert f"window {args['window']}" in str(refused.value)
