"""kernels/embedding.py: the embedding's weight gradient, against ATen's op."""
import pytest
import torch

from megacompile.kernels import outputs
from megacompile.kernels.embedding import embedding_backward

aten = torch.ops.aten


def _inputs(dtype, tokens=(3, 37), hidden=200, vocab=60, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab - 5, tokens, generator=g)      # the last five ids: no token has them
    ids.view(-1)[:9] = 7                                        # a run of one id across many rows
    return torch.randn(*tokens, hidden, generator=g).to(dtype), ids


@pytest.mark.parametrize("padding_idx", [-1, 7, 0])
def test_float32_is_atens_sum_bit_for_bit_with_padding_and_absent_ids_zero(padding_idx):
    grad, ids = _inputs(torch.float32)
    out = embedding_backward(grad, ids, 60, padding_idx)
    assert torch.equal(out, aten.embedding_dense_backward(grad, ids, 60, padding_idx, False))
    assert not out[55:].any()
    if padding_idx >= 0:
        assert not out[padding_idx].any()


def test_bfloat16_sums_in_float32_and_rounds_once():
    """ATen's GPU op sums in float32 too; its CPU op in bfloat16 rounds every addition."""
    grad, ids = _inputs(torch.bfloat16)
    out = embedding_backward(grad, ids, 60)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, aten.embedding_dense_backward(grad.float(), ids, 60, -1, False).to(torch.bfloat16))


def test_the_result_is_written_into_the_tensor_the_caller_gives_and_nothing_of_the_rows_is_allocated():
    grad, ids = _inputs(torch.float32, hidden=64)
    given = torch.full((60, 64), 9.0)
    with outputs.into([given]):
        out = embedding_backward(grad, ids, 60)
    assert out.data_ptr() == given.data_ptr()
    assert torch.equal(given, aten.embedding_dense_backward(grad, ids, 60, -1, False))    # zeroed first


def test_no_tokens_gives_zeros():
    out = embedding_backward(torch.empty(0, 8), torch.empty(0, dtype=torch.int64), 5)
    assert out.shape == (5, 8) and not out.any()
