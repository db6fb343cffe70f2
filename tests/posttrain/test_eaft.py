"""Entropy-adaptive fine-tuning's loss (posttrain/eaft.py, LlamaFactory's use_eaft_loss): each
counted token's cross-entropy weighted by (the entropy of its 20 likeliest next tokens / 3) ** alpha,
worked out here in float64 from the sorted softmax, its gradient with the weight held constant, and
the objective's shift and eval-mode cross-entropy against a Hugging Face model's own."""
import pytest
import torch
import torch.nn.functional as F

from megacompile.posttrain import IGNORE, EAFTObjective, eaft_loss, eaft_weights


def _batch(seed: int = 0, B: int = 3, T: int = 7, V: int = 50):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 3
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = IGNORE
    labels[2, 5:] = IGNORE
    return logits, labels


def _weights(logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """The 20 largest logits' softmax among themselves, its entropy, / 3, to the power alpha (float64)."""
    top = logits.double().sort(dim=-1, descending=True).values[..., :20]
    p = F.softmax(top, dim=-1)
    return (-(p * p.log()).sum(-1) / 3.0) ** alpha


@pytest.mark.parametrize("alpha", [1.0, 0.5])
def test_the_loss_is_each_counted_tokens_cross_entropy_weighted_by_its_entropy(alpha):
    logits, labels = _batch()
    counted = labels != IGNORE
    logp = F.log_softmax(logits.double(), -1)[counted].gather(-1, labels[counted].unsqueeze(-1)).squeeze(-1)
    expected = (-logp * _weights(logits, alpha)[counted]).mean()
    assert eaft_loss(logits, labels, alpha).item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(eaft_weights(logits, alpha).double(), _weights(logits, alpha), rtol=1e-5, atol=1e-7)
    # a confident position weighs less than one spread over many tokens
    sharp, flat = torch.zeros(50), torch.zeros(50)
    sharp[0] = 20.0
    assert eaft_weights(sharp, alpha) < 1e-3 < eaft_weights(flat, alpha)
    # alpha 0, or eval: the plain cross-entropy of the same tokens
    plain = F.cross_entropy(logits.double().reshape(-1, 50), labels.reshape(-1), ignore_index=IGNORE).item()
    assert eaft_loss(logits, labels, 0.0).item() == pytest.approx(plain, rel=1e-6)
    assert eaft_loss(logits, labels, alpha, weighted=False).item() == pytest.approx(plain, rel=1e-6)


def test_the_gradient_is_the_cross_entropys_scaled_by_the_weight_held_constant():
    """d/dz of w.detach() * -log p is w (softmax(z) - onehot) / N; were the weight not held, the
    entropy's own gradient would be added."""
    logits, labels = _batch(1)
    logits.requires_grad_(True)
    eaft_loss(logits, labels, 1.0).backward()
    counted = labels != IGNORE
    soft = F.softmax(logits.detach().double(), -1)
    onehot = F.one_hot(labels.clamp(min=0), logits.shape[-1]).to(soft.dtype)
    w = _weights(logits.detach(), 1.0).unsqueeze(-1)
    expected = w * (soft - onehot) * counted.unsqueeze(-1) / counted.sum()
    torch.testing.assert_close(logits.grad.double(), expected, rtol=1e-5, atol=1e-8)


def test_the_objective_shifts_as_the_model_does_and_gives_its_cross_entropy_in_eval_mode():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :4] = IGNORE
    objective = EAFTObjective(model, 0.7)
    with torch.no_grad():
        logits = model(ids).logits
        assert objective(ids, labels).item() == pytest.approx(
            eaft_loss(logits[:, :-1], labels[:, 1:], 0.7).item(), rel=1e-6)
        objective.eval()
        assert objective(ids, labels).item() == pytest.approx(model(ids, labels=labels).loss.item(), rel=1e-6)
