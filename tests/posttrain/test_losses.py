"""The DPO, IPO and GRPO losses and their gradients against the papers' formulas, written out here
element by element in float64 Python, to 1e-6."""
import math

import pytest
import torch
import torch.nn.functional as F

from megacompile.errors import ArgumentError
from megacompile.posttrain import DPOLoss, GRPOLoss, dpo_loss, group_advantages, grpo_loss, sequence_logprobs
from megacompile.posttrain.logprobs import IGNORE, token_logprobs


def _sigmoid(x):
    return 1 / (1 + math.exp(-x))


def _pairs():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(5, generator=g, dtype=torch.float64) * 3 - 20).requires_grad_() for _ in range(4)]


@pytest.mark.parametrize("beta,ls", [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_loss_and_gradient_match_the_formula(beta, ls):
    """sigmoid: -log sigma(beta h); label_smoothing is not read by it (TRL reads it for robust,
    exo_pair and aot only)."""
    pc, pr, rc, rr = _pairs()
    losses, chosen_r, rejected_r = dpo_loss(pc, pr, rc, rr, beta, ls, "sigmoid")
    losses.sum().backward()
    for i in range(5):
        h = (pc[i].item() - rc[i].item()) - (pr[i].item() - rr[i].item())
        want = -math.log(_sigmoid(beta * h))
        dh = -beta * _sigmoid(-beta * h)
        assert losses[i].item() == pytest.approx(want, rel=1e-6, abs=1e-9)
        assert pc.grad[i].item() == pytest.approx(dh, rel=1e-6, abs=1e-9)
        assert pr.grad[i].item() == pytest.approx(-dh, rel=1e-6, abs=1e-9)
        assert rc.grad[i].item() == pytest.approx(-dh, rel=1e-6, abs=1e-9)
        assert chosen_r[i].item() == pytest.approx(beta * (pc[i].item() - rc[i].item()), rel=1e-9)
        assert rejected_r[i].item() == pytest.approx(beta * (pr[i].item() - rr[i].item()), rel=1e-9)


def test_sequence_logprobs_sum_the_counted_tokens_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 6), generator=g)
    labels[:, :2] = IGNORE                # the prompt
    labels[2, 4:] = IGNORE                # padding
    want = -F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE,
                            reduction="none").view(3, 6).sum(-1)
    assert torch.allclose(sequence_logprobs(logits, labels).double(), want, rtol=1e-6)
    _, mask = token_logprobs(logits, labels)
    assert mask.sum().item() == 3 * 4 - 2


def test_dpo_loss_of_a_packed_batch_pairs_the_halves():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 5, 7, generator=g)
    labels = torch.randint(0, 7, (4, 5), generator=g)
    ref = torch.randn(4, generator=g) - 8
    seq = sequence_logprobs(logits, labels)
    want = dpo_loss(seq[:2], seq[2:], ref[:2], ref[2:], 0.3)[0].mean()
    assert DPOLoss(beta=0.3)(logits, labels, ref).item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ArgumentError, match="3 rows"):
        DPOLoss()(logits[:3], labels[:3], ref[:3])


@pytest.mark.parametrize("bad", [dict(beta=0), dict(beta=True), dict(label_smoothing=0.5), dict(loss_type="kto"),
                                 dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]),
                                 dict(loss_type="exo_pair", label_smoothing=0.0)])
def test_dpo_settings_are_checked(bad):
    with pytest.raises(ArgumentError):
        DPOLoss(**bad)


def test_group_advantages_are_relative_to_the_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(rewards, 4)
    first = [1 - 0.25, -0.25, -0.25, -0.25]
    std = math.sqrt(sum(x * x for x in first) / 3)
    assert adv[:4].tolist() == pytest.approx([x / (std + 1e-4) for x in first], rel=1e-6)
    assert adv[4:].abs().max().item() == 0.0                                   # a group all alike teaches nothing
    assert group_advantages(rewards, 4, scale=False)[:4].tolist() == pytest.approx(first)
    with pytest.raises(ArgumentError, match="num_generations=3"):
        group_advantages(rewards, 3)


def _grpo_reference(logps, old, adv, mask, ref, eps, eps_high, beta, loss_type, max_len):
    """Loss and d loss / d logps, element by element."""
    n, t = len(logps), len(logps[0])
    per = [[0.0] * t for _ in range(n)]
    dper = [[0.0] * t for _ in range(n)]
    for i in range(n):
        for j in range(t):
            r = math.exp(logps[i][j] - old[i][j])
            rc = min(max(r, 1 - eps), 1 + eps_high)
            a = adv[i]
            if r * a <= rc * a:
                per[i][j], dper[i][j] = -r * a, -r * a
            else:
                per[i][j], dper[i][j] = -rc * a, 0.0
            if beta:
                d = ref[i][j] - logps[i][j]
                per[i][j] += beta * (math.exp(d) - d - 1)
                dper[i][j] += beta * (1 - math.exp(d))
    counts = [sum(mask[i]) for i in range(n)]
    if loss_type == "grpo":
        w = [[mask[i][j] / counts[i] / n for j in range(t)] for i in range(n)]
    elif loss_type == "dr_grpo":
        w = [[mask[i][j] / (n * max_len) for j in range(t)] for i in range(n)]
    else:
        w = [[mask[i][j] / sum(counts) for j in range(t)] for i in range(n)]
    loss = sum(per[i][j] * w[i][j] for i in range(n) for j in range(t))
    grad = [[dper[i][j] * w[i][j] for j in range(t)] for i in range(n)]
    return loss, grad


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,eps_high", [(0.0, None), (0.04, 0.28)])
def test_grpo_loss_and_gradient_match_the_formula(loss_type, beta, eps_high):
    g = torch.Generator().manual_seed(3)
    n, t = 6, 5
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    logps = (old + 0.4 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_()  # ratios both sides of the clip
    ref = old + 0.1 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.9, -0.1], dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 1:] = False
    loss, metrics = grpo_loss(logps, old, adv, mask, ref, 0.2, eps_high, beta, loss_type, max_completion_length=8)
    loss.backward()
    want, grad = _grpo_reference(logps.tolist(), old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2,
                                 0.2 if eps_high is None else eps_high, beta, loss_type, 8)
    assert loss.item() == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert torch.allclose(logps.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-6, atol=1e-12)
    assert 0 < metrics["clip_ratio"].item() < 1       # the case has clipped and unclipped tokens
    assert ("kl" in metrics) == (beta != 0)


def test_grpo_settings_are_checked():
    for bad in (dict(epsilon=0), dict(beta=-1), dict(loss_type="ppo"), dict(epsilon_high=0)):
        with pytest.raises(ArgumentError):
            GRPOLoss(**bad)
    with pytest.raises(ArgumentError, match="ref_logps"):
        grpo_loss(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), beta=0.1)


def test_reference_free_rewards_are_per_token():
    """TRL's CPO and ORPO trainers and LlamaFactory log beta x each completion's log-probability
    per token when the loss reads the policy alone; with a reference, beta x the log-ratio of sums."""
    from megacompile.posttrain import preference_metrics
    policy, tokens = torch.tensor([-6.0, -9.0, -8.0, -3.0]), torch.tensor([2.0, 3.0, 4.0, 1.0])
    per_token = preference_metrics(policy, torch.zeros(4), 0.5, tokens)
    assert per_token["rewards_chosen"] == 0.5 * (-3.0 + -3.0) / 2
    assert per_token["rewards_rejected"] == 0.5 * (-2.0 + -3.0) / 2
    assert per_token["preference_accuracy"] == 0.0 and per_token["reward_margin"] == -0.25
    summed = preference_metrics(policy, torch.zeros(4), 0.5)
    assert summed["rewards_chosen"] == 0.5 * (-6.0 + -9.0) / 2 and summed["preference_accuracy"] == 0.5
