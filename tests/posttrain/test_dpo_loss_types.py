"""TRL's DPO loss types against their published formulas (the papers TRL's DPOTrainer docs cite),
written out here pair by pair in float64 Python on one fixed batch, to 1e-6: each loss, its
gradient, several of them summed with loss_weights, and the packed batch's token counts (IPO and
the sft term read them)."""
import math

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain import DPOLoss, dpo_loss
from megacompile.posttrain.dpo_losses import LOSS_TYPES, loss_types
from megacompile.posttrain.logprobs import IGNORE, token_logprobs

B, BETA, LS, TAU, GAMMA = 6, 0.3, 0.1, 0.05, 0.5


def sig(x):
    return 1 / (1 + math.exp(-x))


def logsig(x):
    return -math.log1p(math.exp(-x)) if x > 0 else x - math.log1p(math.exp(x))


def _batch():
    """Sequence log-probabilities of B pairs (policy and reference) and their completions' lengths;
    log-ratios of both signs and of sizes around 1 / beta, so every branch of the losses is taken."""
    g = torch.Generator().manual_seed(7)
    pc, pr, rc, rr = (torch.randn(B, generator=g, dtype=torch.float64) * 4 - 30 for _ in range(4))
    nc = torch.tensor([3.0, 9.0, 5.0, 12.0, 1.0, 7.0], dtype=torch.float64)
    nr = torch.tensor([8.0, 2.0, 5.0, 6.0, 11.0, 4.0], dtype=torch.float64)
    return pc.requires_grad_(), pr.requires_grad_(), rc, rr, nc, nr


def _f(x, divergence, alpha):
    """f-DPO's score of a log-ratio: f'(u) at u = e^x for the divergence (Wang et al., 2023, Table 1)."""
    if divergence == "forward_kl":              # f(u) = -log u: f'(u) = -1/u, shifted by 1 as TRL writes it
        return 1 - math.exp(-x)
    if divergence == "js_divergence":           # f'(u) = log(2u / (1 + u))
        return math.log(2 * math.exp(x) / (1 + math.exp(x)))
    if divergence == "alpha_divergence" and alpha != 1:     # f'(u) = (u^(a-1) - 1) / (a - 1); log u at a = 1
        return (math.exp(x) ** (alpha - 1) - 1) / (alpha - 1)
    return x


def _reference(kind, pc, pr, rc, rr, nc, nr, beta=BETA, ls=LS, divergence="reverse_kl", alpha=0.5):
    """The batch's loss (the mean over its pairs), from the formulas."""
    b = beta
    c = [_f(pc[i] - rc[i], divergence, alpha) for i in range(B)]
    r = [_f(pr[i] - rr[i], divergence, alpha) for i in range(B)]
    h = [c[i] - r[i] for i in range(B)]
    if kind == "sigmoid":                                   # DPO, Rafailov et al. eq. 7
        each = [-logsig(b * x) for x in h]
    elif kind == "hinge":                                   # SLiC / RSO: beta is the margin's reciprocal
        each = [max(0.0, 1 - b * x) for x in h]
    elif kind == "ipo":                                     # IPO eq. 17, log-ratios averaged over tokens
        each = [(c[i] / nc[i] - r[i] / nr[i] - 1 / (2 * b)) ** 2 for i in range(B)]
    elif kind == "sigmoid_norm":
        each = [-logsig(b * (c[i] / nc[i] - r[i] / nr[i])) for i in range(B)]
    elif kind == "exo_pair":                                # EXO eq. 16, K = 2: KL(q || p), p = (1 - eps, eps)
        each = [sig(b * x) * (logsig(b * x) - math.log(1 - ls)) + sig(-b * x) * (logsig(-b * x) - math.log(ls))
                for x in h]
    elif kind == "nca_pair":                                # NCA
        each = [-logsig(b * c[i]) - 0.5 * logsig(-b * c[i]) - 0.5 * logsig(-b * r[i]) for i in range(B)]
    elif kind == "robust":                                  # robust DPO (Chowdhury et al.), flip rate eps
        each = [(-(1 - ls) * logsig(b * x) + ls * logsig(-b * x)) / (1 - 2 * ls) for x in h]
    elif kind == "bco_pair":                                # BCO on pairs: chosen -> 1, rejected -> 0
        each = [-logsig(b * c[i]) - logsig(-b * r[i]) for i in range(B)]
    elif kind == "sppo_hard":                               # SPPO with P = 1 for the winner, 0 for the loser
        each = [(c[i] - 1 / (2 * b)) ** 2 + (r[i] + 1 / (2 * b)) ** 2 for i in range(B)]
    elif kind == "aot":                                     # AOT, paired: sorted quantiles of the log-ratios
        d = [x - y for x, y in zip(sorted(pc[i] - pr[i] for i in range(B)), sorted(rc[i] - rr[i] for i in range(B)))]
        each = [-(1 - ls) * logsig(b * x) - ls * logsig(-b * x) for x in d]
    elif kind == "aot_unpaired":                            # AOT, unpaired: chosen against rejected rewards
        d = [x - y for x, y in zip(sorted(c), sorted(r))]
        each = [-(1 - ls) * logsig(b * x) - ls * logsig(-b * x) for x in d]
    elif kind == "apo_zero":                                # APO eq. 7
        each = [1 - sig(b * c[i]) + sig(b * r[i]) for i in range(B)]
    elif kind == "apo_down":                                # APO eq. 8
        each = [sig(b * c[i]) + 1 - sig(b * h[i]) for i in range(B)]
    elif kind == "discopop":                                # DiscoPOP eq. 5, log-ratio modulated
        each = [-logsig(b * x) * (1 - sig(b * x / TAU)) + math.exp(-b * x) * sig(b * x / TAU) for x in h]
    elif kind == "sft":                                     # the chosen tokens' mean NLL (RPO's term)
        return -sum(pc) / sum(nc)
    elif kind == "simpo":                                   # SimPO eq. 6: per-token averages, a margin, no reference
        each = [-logsig(b * (pc[i] / nc[i] - pr[i] / nr[i]) - GAMMA) for i in range(B)]
    elif kind == "orpo":                                    # ORPO eq. 6-7: NLL + lambda x the odds ratio's loss
        def log_odds(a):
            return a - math.log1p(-math.exp(a))
        each = [-b * logsig(log_odds(pc[i] / nc[i]) - log_odds(pr[i] / nr[i])) for i in range(B)]
        return -sum(pc) / sum(nc) + sum(each) / B
    elif kind == "orpo_per_pair":                           # LlamaFactory's odds_ratio_loss on averaged logps
        def log_odds(a):
            return a - math.log1p(-math.exp(a))
        each = [-pc[i] / nc[i] - b * logsig(log_odds(pc[i] / nc[i]) - log_odds(pr[i] / nr[i])) for i in range(B)]
    else:
        raise AssertionError(kind)
    return sum(each) / B


def _pair_nll(pc, nc):
    """LlamaFactory's pref_ftx term: each pair's chosen NLL over its own tokens, then the batch's mean."""
    return sum(-pc[i] / nc[i] for i in range(B)) / B


def _numeric_gradient(kind, values, which, ls=LS):
    """d loss / d (policy chosen or rejected) by central differences on the float64 reference."""
    grads = []
    for i in range(B):
        up, down = [list(v) for v in values], [list(v) for v in values]
        up[which][i] += 1e-6
        down[which][i] -= 1e-6
        grads.append((_reference(kind, *up, ls=ls) - _reference(kind, *down, ls=ls)) / 2e-6)
    return grads


@pytest.mark.parametrize("kind", LOSS_TYPES)
def test_each_loss_type_is_its_formula(kind):
    pc, pr, rc, rr, nc, nr = _batch()
    losses, _, _ = dpo_loss(pc, pr, rc, rr, BETA, LS, kind, chosen_tokens=nc, rejected_tokens=nr, discopop_tau=TAU,
                            simpo_gamma=GAMMA)
    loss = losses.mean()
    loss.backward()
    values = [x.tolist() for x in (pc.detach(), pr.detach(), rc, rr, nc, nr)]
    assert loss.item() == pytest.approx(_reference(kind, *values), rel=1e-6, abs=1e-9)
    for which, tensor in ((0, pc), (1, pr)):
        want = _numeric_gradient(kind, values, which)
        got = tensor.grad.tolist() if tensor.grad is not None else [0.0] * B      # sft: no rejected term
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), kind


def test_several_loss_types_add_up_with_their_weights():
    """TRL's MPO: loss_type [sigmoid, bco_pair, sft] with loss_weights [0.8, 0.2, 1.0]."""
    pc, pr, rc, rr, nc, nr = _batch()
    values = [x.tolist() for x in (pc.detach(), pr.detach(), rc, rr, nc, nr)]
    kinds, weights = ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0]
    losses, _, _ = dpo_loss(pc, pr, rc, rr, BETA, LS, kinds, loss_weights=weights, chosen_tokens=nc, rejected_tokens=nr)
    want = sum(w * _reference(k, *values) for k, w in zip(kinds, weights))
    assert losses.mean().item() == pytest.approx(want, rel=1e-6)
    unweighted = dpo_loss(pc, pr, rc, rr, BETA, LS, kinds, chosen_tokens=nc, rejected_tokens=nr)[0].mean()
    assert unweighted.item() == pytest.approx(sum(_reference(k, *values) for k in kinds), rel=1e-6)


def test_ipo_averages_the_log_ratios_over_each_completion_s_tokens():
    """A packed batch: the token counts are the completion's labels (IGNORE on prompt and padding);
    IPO's loss changes with them at equal sequence log-probabilities, the sigmoid loss does not."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 9, 11, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 11, (4, 9), generator=g)
    labels[:, :3] = IGNORE
    labels[0, 5:] = IGNORE                                  # chosen 0: 2 tokens; rejected 0 (row 2): 6
    labels[3, 8:] = IGNORE                                  # rejected 1 (row 3): 5 tokens; chosen 1: 6
    ref = torch.randn(4, generator=g, dtype=torch.float64) - 15
    logps, _ = token_logprobs(logits, labels)
    seq = logps.sum(-1).tolist()
    counts = [2.0, 6.0, 6.0, 5.0]
    want = sum(((seq[i] - ref[i].item()) / counts[i] - (seq[i + 2] - ref[i + 2].item()) / counts[i + 2]
                - 1 / (2 * 0.1)) ** 2 for i in range(2)) / 2
    assert DPOLoss(beta=0.1, loss_type="ipo")(logits, labels, ref).item() == pytest.approx(want, rel=1e-9)
    summed = sum(((seq[i] - ref[i].item()) - (seq[i + 2] - ref[i + 2].item()) - 5.0) ** 2 for i in range(2)) / 2
    assert abs(want - summed) > 1.0                          # the sum over tokens is another loss


def test_trl_s_old_names_and_the_checks():
    assert loss_types("aot_pair") == ("aot_unpaired",)      # TRL renamed it; the formula is the same
    assert loss_types(["sigmoid", "sft"]) == ("sigmoid", "sft")
    with pytest.raises(ArgumentError, match="names a loss twice"):
        loss_types(["sigmoid", "sigmoid"])
    pc, pr, rc, rr, _, _ = _batch()
    with pytest.raises(ArgumentError, match="ipo needs the completions' token counts"):
        dpo_loss(pc, pr, rc, rr, BETA, 0.0, "ipo")
    assert DPOLoss(loss_type=["sigmoid"]).loss_type == "sigmoid"
    assert DPOLoss(loss_type="robust", label_smoothing=0.2).reads_label_smoothing
    assert not DPOLoss(loss_type="sigmoid", label_smoothing=0.2).reads_label_smoothing


@pytest.mark.parametrize("kind", ["simpo", "orpo", "orpo_per_pair"])
def test_simpo_and_orpo_read_the_policy_alone(kind):
    pc, pr, rc, rr, nc, nr = _batch()
    given = dpo_loss(pc, pr, rc, rr, BETA, LS, kind, chosen_tokens=nc, rejected_tokens=nr)[0]
    moved = dpo_loss(pc, pr, rc + 5, rr - 3, BETA, LS, kind, chosen_tokens=nc, rejected_tokens=nr)[0]
    assert torch.equal(given, moved)
    assert not DPOLoss(loss_type=kind).needs_reference
    assert DPOLoss(loss_type=[kind, "sigmoid"]).needs_reference


def test_pref_ftx_adds_each_pairs_chosen_nll_per_token_as_llamafactory_does():
    """LlamaFactory's DPO trainer adds pref_ftx x -log pi(y+) / n+ to each pair's loss; TRL's
    rpo_alpha (the sft type) divides the batch's chosen log-probability by all its chosen tokens.
    They differ where the chosen answers differ in length, as here, and are the same where not."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 9, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (4, 9), generator=g)
    labels[:, :3] = IGNORE
    labels[0, 5:] = IGNORE                                  # chosen 0: 2 tokens, chosen 1: 6
    ref = torch.randn(4, generator=g, dtype=torch.float64) - 15
    logps, mask = token_logprobs(logits, labels)
    seq, n = logps.sum(-1), mask.sum(-1).double()
    sigmoid = DPOLoss(beta=BETA)(logits, labels, ref)
    with_ftx = DPOLoss(beta=BETA, ftx=0.5)(logits, labels, ref)
    want = sigmoid + 0.5 * (-seq[0] / n[0] - seq[1] / n[1]) / 2
    assert with_ftx.item() == pytest.approx(want.item(), rel=1e-12)
    grad, = torch.autograd.grad(with_ftx, logits, retain_graph=True)
    want_grad, = torch.autograd.grad(want, logits)
    assert torch.allclose(grad, want_grad, rtol=1e-6, atol=1e-7)      # the log-softmax backward: float32
    rpo = DPOLoss(beta=BETA, loss_type=("sigmoid", "sft"), loss_weights=(1.0, 0.5))(logits, labels, ref)
    assert abs(rpo.item() - with_ftx.item()) > 1e-3         # TRL's average is another loss
    with pytest.raises(ArgumentError, match="pref_ftx .* must be a number >= 0"):
        DPOLoss(ftx=-1.0)


@pytest.mark.parametrize("kind, names", [("orpo", ("nll_loss", "log_odds_ratio", "log_odds_chosen")),
                                         ("orpo_per_pair", ("sft_loss", "odds_ratio_loss"))])
def test_orpos_terms_are_logged_by_their_trainers_names_and_make_its_loss(kind, names):
    from megacompile.posttrain import orpo_metrics
    pc, pr, rc, rr, nc, nr = _batch()
    loss = dpo_loss(pc, pr, rc, rr, BETA, LS, kind, chosen_tokens=nc, rejected_tokens=nr)[0].mean().item()
    metrics = orpo_metrics(kind, pc.detach(), pr.detach(), nc, nr)
    assert tuple(metrics) == names
    # TRL: nll_loss - beta x log_odds_ratio; LlamaFactory: sft_loss + beta x odds_ratio_loss
    terms = (metrics["nll_loss"] - BETA * metrics["log_odds_ratio"] if kind == "orpo"
             else metrics["sft_loss"] + BETA * metrics["odds_ratio_loss"])
    assert terms == pytest.approx(loss, rel=1e-6)
    if kind == "orpo":
        chosen, rejected = [_reference_avg(p, n) for p, n in ((pc, nc), (pr, nr))]
        odds = [(c - r) - (math.log1p(-math.exp(c)) - math.log1p(-math.exp(r))) for c, r in zip(chosen, rejected)]
        assert metrics["log_odds_chosen"] == pytest.approx(sum(odds) / len(odds), rel=1e-6)


def _reference_avg(policy, tokens):
    return [p / max(n, 1) for p, n in zip(policy.tolist(), tokens.tolist())]


@pytest.mark.parametrize("divergence,alpha", [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3),
                                              ("alpha_divergence", 1.0)])
@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "robust", "discopop"])
def test_f_dpo_maps_each_log_ratio_through_the_divergence_with_its_gradient(kind, divergence, alpha):
    pc, pr, rc, rr, nc, nr = _batch()
    rc, rr = pc.detach() + torch.linspace(-1.0, 1.5, B, dtype=torch.float64), pr.detach() - 0.7   # ratios near 1
    loss = DPOLoss(beta=BETA, label_smoothing=LS if kind == "robust" else 0.0, loss_type=kind, discopop_tau=TAU,
                   f_divergence_type=divergence, f_alpha_divergence_coef=alpha)
    tokens = torch.cat([nc, nr])
    got = loss.pairs(torch.cat([pc, pr]), torch.cat([rc, rr]), tokens).mean()
    values = [x.tolist() for x in (pc.detach(), pr.detach(), rc, rr, nc, nr)]
    ls = LS if kind == "robust" else 0.0
    want = _reference(kind, *values, ls=ls, divergence=divergence, alpha=alpha)
    assert got.item() == pytest.approx(want, rel=1e-6, abs=1e-9)
    plain = _reference(kind, *values, ls=ls)
    assert (got.item() == pytest.approx(plain, rel=1e-9)) == (divergence == "alpha_divergence" and alpha == 1.0)
    got.backward()
    for which, tensor in ((0, pc), (1, pr)):
        for i in (0, 3):
            up, down = [list(v) for v in values], [list(v) for v in values]
            up[which][i] += 1e-6
            down[which][i] -= 1e-6
            numeric = (_reference(kind, *up, ls=ls, divergence=divergence, alpha=alpha)
                       - _reference(kind, *down, ls=ls, divergence=divergence, alpha=alpha)) / 2e-6
            assert tensor.grad[i].item() == pytest.approx(numeric, rel=1e-4, abs=1e-8)


def test_f_dpo_is_refused_for_the_losses_whose_log_z_does_not_cancel():
    with pytest.raises(ArgumentError, match="f_divergence_type js_divergence applies to loss types sigmoid, .*not to "
                                            "nca_pair, apo_zero"):
        DPOLoss(loss_type=["sigmoid", "nca_pair", "apo_zero"], f_divergence_type="js_divergence")
    with pytest.raises(ArgumentError, match="f_divergence_type must be one of reverse_kl, forward_kl"):
        DPOLoss(f_divergence_type="chi2")


def test_wpo_weighs_each_pair_by_its_completions_likelihood_against_the_peakedness_of_each_step():
    """TRL's use_weighting: w = exp(mean over the completion's tokens of log p(y_t) - log sum_v p(v)^2),
    each pair's loss times w+ w-, the weights constants of the step."""
    from megacompile.posttrain.dpo import wpo_weights
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(4, 5, 7, generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    labels = torch.randint(0, 7, (4, 5), generator=g)
    labels[:, :2] = IGNORE
    labels[1, 4] = IGNORE
    ref = torch.tensor([-6.0, -5.5, -7.0, -6.2], dtype=torch.float64)
    logps, mask = token_logprobs(logits, labels)
    w = []
    for row in range(4):
        terms = []
        for t in range(5):
            if labels[row, t] != IGNORE:
                p = torch.softmax(logits[row, t].detach(), -1).tolist()
                terms.append(math.log(p[labels[row, t]]) - math.log(sum(x * x for x in p)))
        w.append(math.exp(sum(terms) / len(terms)))
    weights = wpo_weights(logits, logps, mask)
    # the log-probabilities are token_logprobs' fp32 ones
    assert weights.tolist() == pytest.approx([w[0] * w[2], w[1] * w[3]], rel=1e-6)
    assert not weights.requires_grad
    weighted = DPOLoss(beta=BETA, use_weighting=True)(logits, labels, ref)
    plain = DPOLoss(beta=BETA).pairs(logps.sum(-1), ref, mask.sum(-1).double())
    assert weighted.item() == pytest.approx((plain * weights).mean().item(), rel=1e-12)
    grad, = torch.autograd.grad(weighted, logits)
    expected, = torch.autograd.grad((plain * weights.detach()).mean(), logits)
    torch.testing.assert_close(grad, expected)
    with pytest.raises(ArgumentError, match="aot and aot_unpaired sort the pairs"):
        DPOLoss(loss_type="aot", use_weighting=True)


def test_ld_dpo_weighs_the_tokens_past_the_shorter_completion_in_the_policy_and_the_reference():
    """TRL's ld_alpha: log pi(y) = the sum over y's first min(n+, n-) tokens + ld_alpha x the rest,
    for the policy (the loss) and for the reference (DPOObjective's forward-only pass) alike."""
    from megacompile.posttrain import DPOObjective
    logps = torch.tensor([[0.0, -1.0, -2.0, -3.0, 0.0, 0.0],      # chosen: 3 tokens
                          [-1.0, -1.0, -1.0, -1.0, -1.0, 0.0]],    # rejected: 5 tokens, 2 past the shared 3
                         dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    loss = DPOLoss(beta=BETA, ld_alpha=0.25)
    assert loss.sequences(logps, mask).tolist() == [-6.0, -3.0 + 0.25 * -2.0]
    assert DPOLoss(beta=BETA).sequences(logps, mask).tolist() == [-6.0, -5.0]

    class Fixed(torch.nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.logits, self.w = logits, torch.nn.Parameter(torch.zeros(()))

        def forward(self, ids):
            return self.logits + self.w
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 6, 5, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 5, (2, 6), generator=g).masked_fill(~mask, IGNORE)
    per_token, counted = token_logprobs(logits, labels)
    ref = DPOObjective(Fixed(logits), loss)(torch.zeros(2, 6, dtype=torch.long), labels)
    assert torch.allclose(ref, loss.sequences(per_token, counted))
    ref = ref - torch.tensor([0.3, -0.4], dtype=torch.float64)
    want = dpo_loss(*loss.sequences(per_token, counted).chunk(2), *ref.chunk(2), BETA)[0].mean()
    assert loss(logits, labels, ref).item() == pytest.approx(want.item(), rel=1e-12)
    for bad, words in [(dict(loss_type="sft"), "sft read their plain negative log-likelihood"),
                       (dict(ftx=0.5), "pref_ftx read"), (dict(ld_alpha=1.5), r"in \[0, 1\]")]:
        with pytest.raises(ArgumentError, match=words):
            DPOLoss(**{"ld_alpha": 0.5, **bad})
