import pytest
import torch

from megacompile.kernels.check import TOLERANCE, compare_autograd, lm_inputs, relative_error
from megacompile.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy
from megacompile.kernels.reference import fused_linear_cross_entropy_ref

# (tokens, hidden, vocab): a vocabulary above 4096 takes several sweep steps per row
SHAPES = [(67, 33, 257), (19, 16, 4099)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [None, 8, 1000])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_linear_cross_entropy_matches_reference(shape, chunk_size, dtype):
    h, w, labels = lm_inputs(dtype, {"lm": shape}, torch.Generator().manual_seed(0))
    fwd, bwd = compare_autograd(
        lambda h, w, y: fused_linear_cross_entropy(h, w, y, chunk_size=chunk_size),
        fused_linear_cross_entropy_ref, (h, w, labels), (0, 1),
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bias_and_batched_hidden_states(dtype):
    gen = torch.Generator().manual_seed(1)
    h, w, labels = lm_inputs(dtype, {"lm": (2 * 23, 33, 257)}, gen)
    bias = (0.1 * torch.randn(257, generator=gen)).to(dtype)
    h, labels = h.view(2, 23, 33), labels.view(2, 23)
    fwd, bwd = compare_autograd(
        lambda h, w, y, b: fused_linear_cross_entropy(h, w, y, b, chunk_size=16),
        lambda h, w, y, b: fused_linear_cross_entropy_ref(h, w, y, b), (h, w, labels, bias), (0, 1, 3),
    )
    assert fwd <= TOLERANCE[dtype] and bwd <= TOLERANCE[dtype], (fwd, bwd)


def test_gradient_of_a_scaled_loss_and_the_ignore_index():
    h, w, labels = lm_inputs(torch.float32, {"lm": (40, 16, 129)}, torch.Generator().manual_seed(2), 0.5)
    labels[labels == -100] = 7
    labels[::3] = 0  # a custom ignore_index
    h1, w1 = h.clone().requires_grad_(), w.clone().requires_grad_()
    h2, w2 = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss1 = fused_linear_cross_entropy(h1, w1, labels, chunk_size=16, ignore_index=0)
    loss2 = torch.nn.functional.cross_entropy(h2 @ w2.T, labels, ignore_index=0)
    (3.0 * loss1).backward()
    (3.0 * loss2).backward()
    assert relative_error(loss1, loss2) < 1e-6
    assert relative_error(h1.grad, h2.grad) < 1e-5 and relative_error(w1.grad, w2.grad) < 1e-5
    assert (h1.grad[::3] == 0).all()


def test_running_max_moves_across_vocabulary_tiles():
    # logits that grow along the vocabulary: every 4096-wide tile raises the running max
    h, w, labels = lm_inputs(torch.float32, {"lm": (9, 16, 9001)}, torch.Generator().manual_seed(3))
    bias = torch.linspace(-8.0, 8.0, 9001)
    fwd, bwd = compare_autograd(
        lambda h, w, y, b: fused_linear_cross_entropy(h, w, y, b), fused_linear_cross_entropy_ref,
        (h, w, labels, bias), (0, 1, 3),
    )
    assert fwd <= 1e-5 and bwd <= 1e-5, (fwd, bwd)


def test_frozen_head_and_evaluation_skip_gradients():
    h, w, labels = lm_inputs(torch.float32, {"lm": (40, 16, 129)}, torch.Generator().manual_seed(4))
    expected = fused_linear_cross_entropy_ref(h, w, labels)
    with torch.no_grad():
        assert relative_error(fused_linear_cross_entropy(h, w, labels, chunk_size=16), expected) < 1e-6
    h1 = h.clone().requires_grad_()
    fused_linear_cross_entropy(h1, w, labels, chunk_size=16).backward()  # w frozen: no dW
    h2 = h.clone().requires_grad_()
    fused_linear_cross_entropy_ref(h2, w, labels).backward()
    assert relative_error(h1.grad, h2.grad) < 1e-5 and w.grad is None
