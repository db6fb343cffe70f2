"""TRL's GRPO options against their formulas, written out element by element in float64 Python on a
fixed batch, to 1e-6: scale_rewards and nan-aware advantages, sequence-level importance sampling
(GSPO), two-sided clipping (delta), the high-entropy token mask (top_entropy_quantile), the
temperature in the training log-probabilities, and mask_truncated_completions."""
import math

import pytest
import torch

from megacompile.posttrain import GRPOLoss, GRPOObjective, group_advantages, grpo_loss
from megacompile.posttrain.entropy_mask import masked_quantile
from megacompile.posttrain.logprobs import IGNORE
from megacompile.posttrain.rollout import Completion
from megacompile.posttrain.rollout_batch import rollout_batch, truncated

NAN = float("nan")


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    if len(xs) < 2:
        return NAN
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _advantages(rewards, n, scale):
    """TRL's: the group's nan-aware mean, the group's or the batch's unbiased std over the scored
    rewards (NaN under two), + 1e-4; NaN -> 0."""
    out = []
    scored_all = [r for r in rewards if not math.isnan(r)]
    for g in range(0, len(rewards), n):
        group = rewards[g:g + n]
        scored = [r for r in group if not math.isnan(r)]
        mean = _mean(scored) if scored else NAN
        std = _std(scored) if scale == "group" else _std(scored_all)
        for r in group:
            a = r - mean
            if scale != "none":
                a = a / (std + 1e-4)
            out.append(0.0 if math.isnan(a) else a)
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none", True, False])
def test_advantages_are_nan_aware_under_each_scale(scale):
    rewards = [1.0, NAN, 0.0, 0.5,        # one unscored: left out of the mean and std
               NAN, NAN, NAN, NAN,         # none scored: every advantage 0
               2.0, NAN, NAN, NAN,         # one scored: no std (group scale: advantage 0)
               0.3, 0.3, 0.3, 0.9]
    name = {True: "group", False: "none"}.get(scale, scale)
    got = group_advantages(torch.tensor(rewards), 4, scale=scale).tolist()
    assert got == pytest.approx(_advantages(rewards, 4, name), rel=1e-6, abs=1e-9)
    assert got[4:8] == [0.0] * 4 and got[1] == 0.0
    assert not any(math.isnan(a) for a in got)


def _reference(logps, old, adv, mask, ref, eps, eps_high, beta, loss_type, max_len, level, delta, keep,
               corrected=False, sapo=(1.0, 1.05), weighed_at=None, vespo=(2.0, 3.0, 3.0, 2.0), sampled=None):
    """GRPO's loss, element by element: ratio per token or per sequence (exp of the mean log-ratio over
    the completion's tokens), the unclipped ratio capped at delta, the policy term on `keep` tokens;
    `corrected`: the KL term times the unclipped ratio (TRL's use_bias_correction_kl). cispo's weight
    and vespo's are constants: `weighed_at`, the log-probabilities they are taken at (by default
    `logps`); `sampled`, the sampler's correction, which vespo takes into its weight."""
    n, t = len(logps), len(logps[0])
    at = logps if weighed_at is None else weighed_at
    per = [[0.0] * t for _ in range(n)]
    for i in range(n):
        counted = [j for j in range(t) if mask[i][j]]
        seq_ratio = math.exp(sum(logps[i][j] - old[i][j] for j in counted) / max(1, len(counted)))
        seq_at = math.exp(sum(at[i][j] - old[i][j] for j in counted) / max(1, len(counted)))
        for j in range(t):
            r = seq_ratio if level == "sequence" else math.exp(logps[i][j] - old[i][j])
            if loss_type == "cispo":
                weight = min(seq_at if level == "sequence" else math.exp(at[i][j] - old[i][j]), eps_high)
                per[i][j] = -weight * adv[i] * logps[i][j] * keep[i][j]
            elif loss_type == "vespo":
                log_w = sum(min(max(at[i][m] - old[i][m], -20), 20) for m in counted)
                log_w += sum(min(max(math.log(x) if x > 0 else -math.inf, math.log(1e-8)), 20)
                             for x in (sampled[i] if sampled else []))
                log_w = min(max(log_w, math.log(1e-8)), 20)
                k, lam = vespo[:2] if adv[i] >= 0 else vespo[2:]
                phi = math.exp(lam + k * log_w - lam * math.exp(log_w))
                per[i][j] = -phi * adv[i] * logps[i][j] * keep[i][j]
            elif loss_type == "sapo":
                tau = sapo[0] if adv[i] > 0 else sapo[1]
                per[i][j] = -4 / tau / (1 + math.exp(-tau * (r - 1))) * adv[i] * keep[i][j]
            else:
                clipped = min(max(r, 1 - eps), 1 + eps_high)
                capped = r if delta is None else min(r, delta)
                per[i][j] = -min(capped * adv[i], clipped * adv[i]) * keep[i][j]
            if beta:
                d = ref[i][j] - logps[i][j]
                per[i][j] += beta * (math.exp(d) - d - 1) * (r if corrected else 1.0)
    counts = [sum(mask[i]) for i in range(n)]
    if loss_type in ("grpo", "sapo"):
        return sum(sum(per[i][j] * mask[i][j] for j in range(t)) / max(1, counts[i]) for i in range(n)) / n
    if loss_type == "luspo":
        return sum(sum(per[i][j] * mask[i][j] for j in range(t)) for i in range(n)) / n
    if loss_type == "dr_grpo":
        return sum(per[i][j] * mask[i][j] for i in range(n) for j in range(t)) / (n * max_len)
    return sum(per[i][j] * mask[i][j] for i in range(n) for j in range(t)) / sum(counts)


def _case(seed=3, n=6, t=5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(n, t, generator=g, dtype=torch.float64) - 2
    logps = (old + 0.4 * torch.randn(n, t, generator=g, dtype=torch.float64)).requires_grad_()
    ref = old + 0.1 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.5, -0.7, 0.3, -1.2, 0.9, -0.1], dtype=torch.float64)
    mask = torch.ones(n, t, dtype=torch.bool)
    mask[1, 3:] = False
    mask[4, 1:] = False
    return logps, old, ref, adv, mask


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("level,delta,beta,corrected", [("sequence", None, 0.0, False), ("token", 1.3, 0.04, False),
                                                        ("sequence", 1.1, 0.04, False), ("token", 1.3, 0.04, True),
                                                        ("sequence", None, 0.04, True)])
def test_sequence_level_weights_and_two_sided_clipping_match_the_formula(loss_type, level, delta, beta, corrected):
    logps, old, ref, adv, mask = _case()
    keep = torch.rand(6, 5, generator=torch.Generator().manual_seed(9)) > 0.3       # a token mask
    loss, _ = grpo_loss(logps, old, adv, mask, ref, 0.2, 0.28, beta, loss_type, 8, level, delta, keep,
                        bias_correction_kl=corrected)
    want = _reference(logps.tolist(), old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2, 0.28,
                      beta, loss_type, 8, level, delta, keep.long().tolist(), corrected)
    assert loss.item() == pytest.approx(want, rel=1e-6, abs=1e-12)
    loss.backward()
    # the gradient against central differences of the reference
    flat = logps.detach().tolist()
    for i, j in ((0, 0), (1, 2), (3, 4), (5, 1)):
        up = [row[:] for row in flat]
        down = [row[:] for row in flat]
        up[i][j] += 1e-6
        down[i][j] -= 1e-6
        numeric = (_reference(up, old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2, 0.28, beta,
                              loss_type, 8, level, delta, keep.long().tolist(), corrected)
                   - _reference(down, old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2, 0.28, beta,
                                loss_type, 8, level, delta, keep.long().tolist(), corrected)) / 2e-6
        assert logps.grad[i, j].item() == pytest.approx(numeric, rel=1e-4, abs=1e-7)


METRICS = {"cispo": {"cispo_clip_ratio"}, "sapo": set(), "vespo": {"vespo/phi_seq_mean"},
           "luspo": {"clip_ratio", "clip_ratio_low", "clip_ratio_high"}}


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo", "vespo"])
@pytest.mark.parametrize("level,beta,corrected", [("token", 0.0, False), ("sequence", 0.04, False),
                                                  ("token", 0.0, True)])
def test_cispo_sapo_luspo_and_vespo_match_their_formulas_and_their_weights_carry_no_gradient(loss_type, level, beta,
                                                                                            corrected):
    logps, old, ref, adv, mask = _case()
    keep = torch.rand(6, 5, generator=torch.Generator().manual_seed(9)) > 0.3
    sampled = 0.6 + torch.rand(6, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    high = 1.3 if loss_type == "cispo" else 0.28             # CISPO's cap on the weight itself
    shape = (2.5, 1.5, 3.5, 2.2)
    loss, metrics = grpo_loss(logps, old, adv, mask, ref, 0.2, high, beta, loss_type, 8, level, None, keep,
                              sampled if corrected else None, sapo_temperatures=(0.9, 1.2), vespo=shape)
    # the sampler's correction: a factor of the policy term, or (vespo) inside its weight
    factor = keep.double() * (sampled if corrected and loss_type != "vespo" else 1.0)
    args = (old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2, high, beta, loss_type, 8, level,
            None, factor.tolist())
    more = dict(sapo=(0.9, 1.2), vespo=shape, sampled=sampled.tolist() if corrected else None)
    base = logps.detach().tolist()
    assert loss.item() == pytest.approx(_reference(base, *args, **more), rel=1e-6, abs=1e-12)
    assert set(metrics) == METRICS[loss_type] | ({"kl"} if beta else set())
    loss.backward()
    for i, j in ((0, 0), (1, 2), (3, 4), (5, 1)):
        up = [row[:] for row in base]
        down = [row[:] for row in base]
        up[i][j] += 1e-6
        down[i][j] -= 1e-6
        numeric = (_reference(up, *args, weighed_at=base, **more)
                   - _reference(down, *args, weighed_at=base, **more)) / 2e-6
        assert logps.grad[i, j].item() == pytest.approx(numeric, rel=1e-4, abs=1e-7)
    if loss_type == "cispo":      # the weight differs from the ratio where it is capped
        assert 0 < metrics["cispo_clip_ratio"].item() < 1


def test_the_delta_cap_and_the_sequence_ratio_change_the_loss():
    """Guards: each option moves the loss on this batch (a no-op option would pass the formula test
    only if the formula ignored it too)."""
    logps, old, ref, adv, mask = _case()
    base = grpo_loss(logps, old, adv, mask)[0].item()
    assert grpo_loss(logps, old, adv, mask, delta=1.05)[0].item() != pytest.approx(base, rel=1e-6)
    assert grpo_loss(logps, old, adv, mask, importance_sampling_level="sequence")[0].item() != pytest.approx(base)
    kl = grpo_loss(logps, old, adv, mask, ref, beta=0.04)[0].item()
    assert grpo_loss(logps, old, adv, mask, ref, beta=0.04, bias_correction_kl=True)[0].item() != pytest.approx(kl)


@pytest.mark.parametrize("q", [0.0, 0.2, 0.37, 0.5, 1.0])
def test_the_masked_quantile_is_torch_quantile_of_the_counted_values(q):
    g = torch.Generator().manual_seed(5)
    values = torch.rand(7, 13, generator=g, dtype=torch.float64) * 5
    mask = torch.rand(7, 13, generator=g) > 0.4
    want = torch.quantile(values[mask], q).item()
    assert masked_quantile(values, mask, q).item() == pytest.approx(want, rel=1e-12)
    assert masked_quantile(values, torch.zeros_like(mask), q).item() == math.inf


def _log_softmax(row):
    m = max(row)
    z = m + math.log(sum(math.exp(x - m) for x in row))
    return [x - z for x in row]


@pytest.mark.parametrize("temperature,quantile", [(0.7, 1.0), (1.0, 0.3), (1.6, 0.5)])
def test_the_loss_reads_logits_at_the_temperature_and_keeps_the_high_entropy_tokens(temperature, quantile):
    """From logits: log-probabilities of logits / temperature (TRL's), entropies of the same
    distribution, the policy term on the tokens at or above the (1 - q) entropy quantile."""
    g = torch.Generator().manual_seed(11)
    n, t, v = 4, 6, 9
    logits = torch.randn(n, t, v, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, v, (n, t), generator=g)
    labels[:, :2] = IGNORE
    labels[2, 4:] = IGNORE
    old = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3 - 2.5
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3], dtype=torch.float64)
    loss = GRPOLoss(loss_type="dapo", temperature=temperature, top_entropy_quantile=quantile)
    got = loss(logits, labels, old, adv).item()
    logps, entropy, mask = [[0.0] * t for _ in range(n)], [], [[0] * t for _ in range(n)]
    for i in range(n):
        for j in range(t):
            lp = _log_softmax([x / temperature for x in logits[i, j].tolist()])
            if labels[i, j] != IGNORE:
                logps[i][j], mask[i][j] = lp[labels[i, j]], 1
                entropy.append((-sum(math.exp(x) * x for x in lp), i, j))
    ordered = sorted(e for e, _, _ in entropy)
    pos = (1 - quantile) * (len(ordered) - 1)
    threshold = ordered[math.floor(pos)] + (ordered[math.ceil(pos)] - ordered[math.floor(pos)]) * (pos - math.floor(pos))
    keep = [[0] * t for _ in range(n)]
    for e, i, j in entropy:
        keep[i][j] = int(e >= threshold)
    want = _reference(logps, old.tolist(), adv.tolist(), mask, None, 0.2, 0.2, 0.0, "dapo", None, "token", None, keep)
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12)
    if quantile < 1.0:
        assert 0 < sum(map(sum, keep)) < sum(map(sum, mask))      # the mask kept some tokens, not all
    # the objective's forward-only pass (old policy, reference) reads the same temperature
    class Fixed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids):
            return logits + self.w
    forward = GRPOObjective(Fixed(), loss)(torch.zeros(n, t, dtype=torch.long), labels)
    assert forward[0, 2].item() == pytest.approx(logps[0][2], rel=1e-6)      # fp32 log-probabilities


def test_truncated_completions_leave_the_loss_but_keep_their_rewards():
    eos, pad = 2, 0
    completions = [Completion(0, (5, 6), (7, 2)), Completion(0, (5, 6), (7, 8, 9)), Completion(1, (4,), (3, 3, 3)),
                   Completion(1, (4,), (9, 0))]
    masked = truncated(completions, eos, pad)
    assert masked == [False, True, True, False]             # ends with neither eos nor pad: cut by the length
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0])
    batch = rollout_batch(completions, rewards, 2, width=5, masked=masked)
    assert (batch["labels"][1] == IGNORE).all() and (batch["labels"][2] == IGNORE).all()
    assert batch["labels"][0].tolist() == [-100, 7, 2, -100, -100]
    assert batch["advantages"].tolist() == pytest.approx(group_advantages(rewards, 2).tolist())


@pytest.mark.parametrize("coef,quantile", [(0.05, 1.0), (-0.2, 0.5)])
def test_the_entropy_bonus_subtracts_coef_times_the_counted_tokens_mean_entropy_with_its_gradient(coef, quantile):
    """TRL's entropy_coef: the loss less coef x the mean entropy over the tokens the policy term counts
    (the entropy mask's, when top_entropy_quantile < 1), differentiated through the entropy."""
    g = torch.Generator().manual_seed(13)
    n, t, v = 4, 6, 9
    logits = (torch.randn(n, t, v, generator=g, dtype=torch.float64) * 2).requires_grad_()
    labels = torch.randint(0, v, (n, t), generator=g)
    labels[:, :2] = IGNORE
    old = torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3 - 2.5
    adv = torch.tensor([1.0, -0.5, 0.8, -1.3], dtype=torch.float64)
    plain = GRPOLoss(loss_type="grpo", temperature=0.8, top_entropy_quantile=quantile)
    bonus = GRPOLoss(loss_type="grpo", temperature=0.8, top_entropy_quantile=quantile, entropy_coef=coef)
    got = bonus(logits, labels, old, adv)
    # the same bonus written out: the entropy of softmax(logits / 0.8) per token, its mean over the counted
    scaled = logits / 0.8
    entropy = -(scaled.softmax(-1) * scaled.log_softmax(-1)).sum(-1)
    counted = labels != IGNORE
    if quantile < 1.0:
        threshold = torch.quantile(entropy.detach()[counted], 1 - quantile)
        counted = counted & (entropy.detach() >= threshold)
        assert 0 < counted.sum() < (labels != IGNORE).sum()
    want = plain(logits, labels, old, adv) - coef * entropy[counted].mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-9, abs=1e-12)
    grad, = torch.autograd.grad(got, logits)
    expected, = torch.autograd.grad(want, logits)
    torch.testing.assert_close(grad, expected, rtol=1e-7, atol=1e-10)
    unbonused, = torch.autograd.grad(plain(logits, labels, old, adv), logits)
    assert not torch.allclose(grad, unbonused)          # the bonus has a gradient of its own


def test_gdpo_normalises_each_reward_function_in_its_group_then_the_weighted_sum_over_the_batch():
    """TRL's multi_objective_aggregation normalize_then_sum, element by element: per function and
    group, (r - mean) / (std + 1e-4) over the scored rewards; the weighted nansum; then over the
    whole batch the same; a completion no function scored gets 0."""
    from megacompile.posttrain import decoupled_advantages
    per = [[1.0, 0.0], [0.0, NAN], [1.0, 1.0],           # group 0: function 2 scored twice
           [0.2, 5.0], [0.4, 3.0], [NAN, NAN],           # group 1: the last unscored
           [0.0, 2.0], [0.0, 2.0], [0.0, 4.0]]           # group 2: function 1 all alike
    weights = [1.0, 0.5]
    n, k = 3, 2
    summed = []
    for i, row in enumerate(per):
        g = i // n * n
        total, scored = 0.0, False
        for j in range(k):
            column = [per[m][j] for m in range(g, g + n) if not math.isnan(per[m][j])]
            if math.isnan(row[j]) or len(column) < 2:
                continue
            scored = True
            total += weights[j] * (row[j] - _mean(column)) / (_std(column) + 1e-4)
        summed.append(total if scored or not all(math.isnan(x) for x in row) else NAN)
    kept = [s for s in summed if not math.isnan(s)]
    want = [0.0 if math.isnan(s) else (s - _mean(kept)) / (_std(kept) + 1e-4) for s in summed]
    got = decoupled_advantages(torch.tensor(per), weights, n)
    assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert got[5].item() == 0.0
    # not the sum-then-normalise advantages of the same rewards
    weighted = torch.nansum(torch.tensor(per) * torch.tensor(weights), dim=1)
    assert not torch.allclose(got, group_advantages(weighted, n))


@pytest.mark.parametrize("sampler", ["old", "vllm"])
def test_the_off_policy_mask_drops_the_drifted_completions_of_negative_advantage(sampler):
    """TRL's off_policy_mask_threshold (DeepSeek-V3.2): a completion with A < 0 whose mean over its
    tokens of sampler log-probability - policy log-probability exceeds the threshold leaves the policy
    term (the KL term stays); the sampler's are vLLM's where given (NaN: no evidence), else old_logps."""
    logps, old, ref, adv, mask = _case()
    sampled = old + 0.3 * torch.randn(6, 5, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    sampled[2, 1] = NAN
    given = sampled if sampler == "vllm" else None
    source = sampled if sampler == "vllm" else old
    drift = []
    for i in range(6):
        counted = [j for j in range(5) if mask[i, j]]
        terms = [0.0 if math.isnan(source[i, j].item()) else source[i, j].item() - logps[i, j].item() for j in counted]
        drift.append(sum(terms) / len(counted))
    threshold = sorted(drift)[2] + 1e-9          # about half the completions drift beyond it
    keep = [[1.0 if adv[i] >= 0 or drift[i] <= threshold else 0.0] * 5 for i in range(6)]
    assert 0 < sum(k[0] for k in keep) < 6
    loss, _ = grpo_loss(logps, old, adv, mask, ref, 0.2, 0.28, 0.04, "grpo", 8, "token", None,
                        off_policy_threshold=threshold, sampling_logps=given)
    want = _reference(logps.tolist(), old.tolist(), adv.tolist(), mask.long().tolist(), ref.tolist(), 0.2, 0.28,
                      0.04, "grpo", 8, "token", None, keep)
    assert loss.item() == pytest.approx(want, rel=1e-6, abs=1e-12)
    assert loss.item() != pytest.approx(grpo_loss(logps, old, adv, mask, ref, 0.2, 0.28, 0.04, "grpo", 8)[0].item())
