"""No block holds an S x S attention mask: capture traces Hugging Face decoders onto SDPA with
is_causal when the model is called without a mask, onto megacompile::window_attention with the
keys each query may see as numbers for sliding windows, packed documents and padding
(capture/hf_masks.py, capture/hf_windows.py)."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.capture import capture
from tests import models

B, S = 16, 4096
# Llama-2-13B's block shapes: the hidden size (5120) differs from S, so a tensor with two
# dimensions of length S can only be attention scores or a mask.
LLAMA_13B = dict(model_type="llama", hidden_size=5120, intermediate_size=13824, num_attention_heads=40,
                 num_key_value_heads=40, num_hidden_layers=2, vocab_size=32000, max_position_embeddings=S)


def _square(shape: tuple[int, ...], s: int) -> bool:
    return sum(d == s for d in shape) >= 2


def _block(plan_or_captured):
    """The block as captured, whichever variant a plan runs."""
    captured = getattr(plan_or_captured, "captured", plan_or_captured)
    template = next(st.template for st in captured.stages if st.template.kind == "block")
    return template.full or template


@pytest.mark.parametrize("fuse", [False, True])
def test_a_llama_block_at_16x4096_saves_and_reads_no_square_tensor(fuse):
    plan = megacompile.plan(LLAMA_13B, 80, batch=B, seq=S, fuse=fuse)
    block = _block(plan)
    for variant in (block, block.selective):
        square = [m.shape for m in variant.saved if _square(m.shape, S)]
        assert not square, f"the block saves {square}"
    side = [m.shape for m in block.acts if _square(m.shape, S)]
    assert not side, f"the block reads {side} from the prologue"
    prologue = next(st.template for st in plan.captured.stages if st.template.kind == "prologue")
    assert not [m.shape for m in prologue.outputs if _square(m.shape, S)]


def _attention_ops(template) -> list:
    return [n for n in template.forward.gm.graph.nodes
            if n.op == "call_function" and "scaled_dot_product" in str(n.target)]


def test_without_a_mask_a_hf_block_attends_with_is_causal():
    model = models.hf_llama(layers=2)
    ids = torch.zeros(2, 24, dtype=torch.long)
    captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    block = _block(captured)
    ops = _attention_ops(block)
    assert ops and all(n.kwargs.get("is_causal", n.args[4] if len(n.args) > 4 else False) for n in ops)
    assert all(len(m.shape) < 4 for m in block.acts)


def test_a_padding_mask_reaches_every_block_as_the_keys_it_keeps():
    """A [B, S] attention_mask: each block reads it as a bool [B, S] and attends with
    megacompile::window_attention (capture/hf_windows.py), no [B, 1, S, S] anywhere."""
    model = models.hf_llama(layers=2)
    ids = torch.zeros(2, 24, dtype=torch.long)
    mask = torch.ones(2, 24, dtype=torch.long)
    captured = capture(model, (), {"input_ids": ids, "attention_mask": mask, "labels": ids},
                       device=torch.device("cpu"), compute_dtype=torch.float32)
    block = _block(captured)
    assert any(m.shape == (2, 24) and m.dtype == torch.bool for m in block.acts)
    assert not [m.shape for m in block.acts if _square(m.shape, 24)]
    for variant in (block, block.selective):
        assert not [m.shape for m in variant.saved if _square(m.shape, 24)]
    ops = {str(n.target) for n in block.forward.gm.graph.nodes if n.op == "call_function"}
    assert "megacompile.window_attention.default" in ops


def test_a_callers_position_ids_give_the_blocks_document_starts_not_a_mask():
    """They may pack several sequences in a row, which only their values tell: each block reads
    the first token of each token's document ([B, S], capture/hf_windows.py), not [B, 1, S, S]."""
    model = models.hf_llama(layers=2)
    ids = torch.zeros(2, 24, dtype=torch.long)
    positions = torch.arange(24).repeat(2, 1)
    captured = capture(model, (), {"input_ids": ids, "position_ids": positions, "labels": ids},
                       device=torch.device("cpu"), compute_dtype=torch.float32)
    block = _block(captured)
    assert not [m.shape for m in block.acts if _square(m.shape, 24)]
    assert any(m.shape == (2, 24) and m.dtype == torch.int32 for m in block.acts)
    ops = {str(n.target) for n in block.forward.gm.graph.nodes if n.op == "call_function"}
    assert "megacompile.window_attention.default" in ops


def test_a_packed_mask_is_read_as_every_transformers_release_composes_it():
    """Later releases read the band at the tokens' positions (remap_positions_for_packed_sequence);
    transformers 5.17 has no remap and and-s the band, a sliding one composed with and_masks too,
    with the same-sequence mask directly. Either way: the band and the sequence index."""
    from megacompile.capture.hf_windows import _packed, _Parts
    index = torch.tensor([[0, 0, 1, 1]])
    causal = lambda b, h, q, k: k <= q                                     # noqa: E731
    same = _Parts("packed", lambda b, h, q, k: index[b, q] == index[b, k], (index,))
    later = _Parts("and", None, (_Parts("remap", None, (causal, torch.arange(4)[None])), same))
    band, seen = _packed(later)
    assert band is causal and seen is index
    sliding = _Parts("and", None, (lambda b, h, q, k: q - k < 2, causal))
    band, seen = _packed(_Parts("and", None, (sliding, same)))           # 5.17
    assert band is sliding and seen is index
    assert _packed(_Parts("and", None, (same, same))) is None
    assert _packed(_Parts("and", None, (causal, causal))) is None
