"""Dynamic fine-tuning's loss (posttrain/dft.py): the probability-weighted cross-entropy and its
gradient, worked out here from the softmax in float64 (the loss is taken in float32), and the objective's shift and eval-mode loss against a
Hugging Face model's own cross-entropy."""
import pytest
import torch
import torch.nn.functional as F

from megacompile.posttrain import IGNORE, DFTObjective, dft_loss


def _batch(seed: int = 0, B: int = 3, T: int = 7, V: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g) * 2
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, :3] = IGNORE
    labels[2, 5:] = IGNORE
    return logits, labels


def test_the_loss_is_each_counted_tokens_cross_entropy_weighted_by_its_probability():
    logits, labels = _batch()
    counted = labels != IGNORE
    logp = F.log_softmax(logits.double(), -1)[counted].gather(-1, labels[counted].unsqueeze(-1)).squeeze(-1)
    expected = (-logp.exp() * logp).mean()
    assert dft_loss(logits, labels).item() == pytest.approx(expected.item(), rel=1e-6)
    # unweighted: the cross-entropy of the same tokens
    assert dft_loss(logits, labels, weighted=False).item() == pytest.approx(
        F.cross_entropy(logits.double().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                        ignore_index=IGNORE).item(), rel=1e-6)


def test_the_gradient_is_the_cross_entropys_scaled_by_the_tokens_probability():
    """d/dz of -p.detach() log p is p (softmax(z) - onehot) / N: the weight is held constant. Were
    it not detached, the gradient would be (1 + log p) p (softmax - onehot) / N."""
    logits, labels = _batch(1)
    logits.requires_grad_(True)
    dft_loss(logits, labels).backward()
    counted = labels != IGNORE
    soft = F.softmax(logits.detach().double(), -1)
    onehot = F.one_hot(labels.clamp(min=0), logits.shape[-1]).to(soft.dtype)
    p = (soft * onehot).sum(-1, keepdim=True)
    expected = p * (soft - onehot) * counted.unsqueeze(-1) / counted.sum()
    torch.testing.assert_close(logits.grad.double(), expected, rtol=1e-5, atol=1e-8)


def _hf_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


def test_the_objective_shifts_as_the_model_does_and_gives_its_cross_entropy_in_eval_mode():
    model = _hf_model()
    ids = torch.randint(0, 40, (2, 9), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :4] = IGNORE                  # the prompt
    labels[1, 7:] = IGNORE                  # padding
    objective = DFTObjective(model)
    with torch.no_grad():
        logits = model(ids).logits
        assert objective(ids, labels).item() == pytest.approx(
            dft_loss(logits[:, :-1], labels[:, 1:]).item(), rel=1e-6)
        objective.eval()
        assert objective(ids, labels).item() == pytest.approx(model(ids, labels=labels).loss.item(), rel=1e-6)
    # other inputs reach the model: positions restarting mid-row change its logits and the loss
    objective.train()
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]] * 2)
    with torch.no_grad():
        assert objective(ids, labels, position_ids=positions).item() == pytest.approx(
            dft_loss(model(ids, position_ids=positions).logits[:, :-1], labels[:, 1:]).item(), rel=1e-6)
        assert objective(ids, labels, position_ids=positions).item() != pytest.approx(objective(ids, labels).item())


def test_a_shifted_models_labels_are_taken_as_they_are():
    from megacompile.models.llama import LlamaConfig, TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=32, dim=32, layers=1, heads=4, kv_heads=2, ffn=64))
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert DFTObjective(model, shifted=True)(ids, targets).item() == pytest.approx(
            dft_loss(model(ids), targets).item(), rel=1e-6)
        assert DFTObjective(model, shifted=True).eval()(ids, targets).item() == pytest.approx(
            model(ids, targets).item(), rel=1e-6)
