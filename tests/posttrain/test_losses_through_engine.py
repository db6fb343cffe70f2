"""Each DPO loss type and each GRPO option through the engine, the policy streamed at its smallest
budget: one forward-only pass returns every variant's loss on a fixed batch, each held to its
formula (tests/posttrain/test_dpo_loss_types.py's and test_grpo_options.py's references, in
float64 over the eager policy's log-probabilities) to 1e-6. The training path of the same losses
(a step against eager AdamW) is test_parity.py's."""
import copy

import pytest
import torch
from torch import nn

from megacompile import compile, minimum_budget
from megacompile.posttrain import DPOLoss, GRPOLoss, group_advantages, token_logprobs
from megacompile.posttrain.dpo import logits_of
from megacompile.posttrain.dpo_losses import LOSS_TYPES
from megacompile.posttrain.entropy_mask import high_entropy_mask, token_entropies
from tests.posttrain import test_dpo_loss_types as dpo_formulas
from tests.posttrain import test_grpo_options as grpo_formulas
from tests.posttrain.test_parity import _completions, _policy

BETA, LS, TAU = dpo_formulas.BETA, dpo_formulas.LS, dpo_formulas.TAU
PAIRS = dpo_formulas.B          # the formulas' batch: 6 pairs
SMOOTHED = ("exo_pair", "robust", "aot", "aot_unpaired")       # the loss types that read label_smoothing
# (loss_type, importance_sampling_level, delta, top_entropy_quantile, temperature, beta, epsilon_high,
#  sampler's correction, token_count): each option on its own, then several at once
GRPO_CASES = [(t, "token", None, 1.0, 1.0, 0.0, None, False, False) for t in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
    ("grpo", "sequence", None, 1.0, 1.0, 0.0, None, False, False),
    ("dapo", "token", 1.15, 1.0, 1.0, 0.0, None, False, False),
    ("bnpo", "token", None, 0.5, 1.0, 0.0, None, False, False),
    ("grpo", "token", None, 1.0, 0.7, 0.0, None, False, False),
    ("dr_grpo", "token", None, 1.0, 1.0, 0.04, None, False, False),
    ("dapo", "token", None, 1.0, 1.0, 0.0, 0.28, False, False),
    ("dapo", "token", None, 1.0, 1.0, 0.0, None, True, False),
    ("dapo", "token", None, 1.0, 1.0, 0.0, None, False, True),
    ("dapo", "sequence", 1.3, 0.4, 0.8, 0.04, 0.28, True, True),
    ("cispo", "token", None, 1.0, 1.0, 0.0, 1.3, False, True),
    ("sapo", "token", None, 1.0, 0.7, 0.04, None, True, False),
    ("luspo", "sequence", None, 1.0, 1.0, 0.0, None, False, False),
    ("vespo", "token", None, 1.0, 1.0, 0.0, None, True, True),
]


class EachLoss(nn.Module):
    """The policy and several losses over its logits, their values stacked (forward only), or
    summed (`total`: a training step's scalar, which the smallest budget is found for)."""

    def __init__(self, policy: nn.Module, losses: list, total: bool = False):
        super().__init__()
        self.policy, self.losses, self.total = policy, losses, total

    def forward(self, input_ids, labels, **inputs):
        logits = logits_of(self.policy(input_ids))
        each = torch.stack([loss(logits, labels, **inputs) for loss in self.losses])
        return each.sum() if self.total else each


def _through_engine(module: EachLoss, inputs: dict) -> torch.Tensor:
    """The stacked losses from the engine's forward-only pass at the smallest budget of the step."""
    smallest = minimum_budget(EachLoss(copy.deepcopy(module.policy), module.losses, total=True),
                              compute_dtype=torch.float32, hardware="cpu", inputs=inputs)
    engine = compile(module, hbm_budget=smallest, device="cpu", compute_dtype=torch.float32)
    out = torch.as_tensor(engine(**inputs)).double()
    engine.close()
    return out


@pytest.mark.slow    # every loss type; their formulas stay in the default tier
def test_each_dpo_loss_type_through_the_engine_is_its_formula():
    policy = _policy()
    ids, labels = _completions(2 * PAIRS, 21)                  # chosen rows first, then the rejected
    with torch.no_grad():
        logits = policy(ids)
        logps, mask = token_logprobs(logits, labels)
    ref = logps.sum(-1) - torch.linspace(-1.5, 2.0, 2 * PAIRS)    # a reference on both sides of the policy
    # then LlamaFactory's pref_ftx, f-DPO, WPO's weights (which read the logits beside the log-probabilities)
    # and LD-DPO's reweighed log-probabilities
    more = [DPOLoss(beta=BETA, loss_type="sigmoid", ftx=0.7),
            DPOLoss(beta=BETA, loss_type="ipo", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
            DPOLoss(beta=BETA, loss_type="sigmoid", use_weighting=True),
            DPOLoss(beta=BETA, loss_type="sigmoid_norm", ld_alpha=0.4)]
    losses = [DPOLoss(beta=BETA, label_smoothing=LS if k in SMOOTHED else 0.0, loss_type=k, discopop_tau=TAU)
              for k in LOSS_TYPES] + more
    got = _through_engine(EachLoss(copy.deepcopy(policy), losses),
                          {"input_ids": ids, "labels": labels, "ref_logps": ref})
    seq, tokens = logps.double().sum(-1), mask.double().sum(-1)
    pc, pr, rc, rr = seq[:PAIRS], seq[PAIRS:], ref.double()[:PAIRS], ref.double()[PAIRS:]
    for kind, value in zip(LOSS_TYPES, got.tolist()):
        ls = LS if kind in SMOOTHED else 0.0
        want = float(dpo_formulas._reference(kind, pc, pr, rc, rr, tokens[:PAIRS], tokens[PAIRS:], BETA, ls))
        assert value == pytest.approx(want, rel=1e-6, abs=1e-9), kind
    want = float(dpo_formulas._reference("sigmoid", pc, pr, rc, rr, tokens[:PAIRS], tokens[PAIRS:], BETA, 0.0)
                 + 0.7 * dpo_formulas._pair_nll(pc, tokens[:PAIRS]))
    assert got[-4].item() == pytest.approx(want, rel=1e-6, abs=1e-9)
    for loss, value in zip(more[1:], got[-3:].tolist()):       # eager, in float64
        assert value == pytest.approx(loss(logits.double(), labels, ref.double()).item(), rel=1e-6, abs=1e-9)


@pytest.mark.slow    # every option; their formulas stay in the default tier
def test_each_grpo_option_through_the_engine_is_its_formula():
    policy = _policy()
    ids, labels = _completions(6, 31)
    with torch.no_grad():
        logits = policy(ids)
        old, mask = token_logprobs(logits, labels)
    old = old - 0.04 * torch.arange(old.shape[1])              # a sampling policy off the trained one
    ref = old + 0.05
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.4, 2.0, -1.0, 0.5]), 3)
    sampling_ratio = 0.5 + torch.rand(old.shape, generator=torch.Generator().manual_seed(2))
    token_count = torch.tensor(float(mask.sum()) * 1.7)         # a rollout batch larger than this micro-batch
    losses = [GRPOLoss(epsilon_high=hi, beta=b, loss_type=t, max_completion_length=9, temperature=temp,
                       importance_sampling_level=level, delta=delta, top_entropy_quantile=q)
              for t, level, delta, q, temp, b, hi, _, _ in GRPO_CASES]
    inputs = {"input_ids": ids, "labels": labels, "old_logps": old, "advantages": advantages, "ref_logps": ref}
    wrapped = [_Inputs(loss, corrected, counted) for loss, (*_, corrected, counted) in zip(losses, GRPO_CASES)]
    # TRL's entropy bonus reads the logits beside the log-probabilities: its own eager value
    bonus = GRPOLoss(loss_type="dapo", temperature=0.8, top_entropy_quantile=0.5, entropy_coef=0.1)
    got = _through_engine(EachLoss(copy.deepcopy(policy), wrapped + [_Inputs(bonus, False, False)]),
                          {**inputs, "sampling_ratio": sampling_ratio, "token_count": token_count})
    want = bonus(logits.double(), labels, old.double(), advantages.double()).item()
    assert got[-1].item() == pytest.approx(want, rel=1e-6, abs=1e-6)
    for case, loss, value in zip(GRPO_CASES, losses, got.tolist()):
        t, level, delta, q, temp, b, hi, corrected, counted = case
        scaled = logits.double() / temp
        logps, _ = token_logprobs(scaled, labels)
        keep = torch.ones_like(logps)
        if q < 1.0:
            keep = high_entropy_mask(token_entropies(scaled), mask, q).double()
        if corrected and t != "vespo":      # vespo takes the correction into its weight
            keep = keep * sampling_ratio.double()
        want = grpo_formulas._reference(logps.tolist(), old.double().tolist(), advantages.double().tolist(),
                                        mask.long().tolist(), ref.double().tolist(), 0.2, 0.2 if hi is None else hi,
                                        b, t, 9, level, delta, keep.tolist(),
                                        sampled=sampling_ratio.double().tolist() if corrected else None)
        if counted and t in ("dapo", "cispo", "vespo"):
            want = want * float(mask.sum()) / float(token_count)
        # the loss sums terms of the advantages' scale (about 1) that cancel to a few hundredths: 1e-6
        # of the terms' scale (the engine's float32 logits against eager's differ by rounding)
        assert value == pytest.approx(want, rel=1e-6, abs=1e-6), case


class _Inputs:
    """A GRPO loss that reads the sampler's correction and the token count only where its case does."""

    def __init__(self, loss: GRPOLoss, corrected: bool, counted: bool):
        self.loss, self.corrected, self.counted = loss, corrected, counted

    def __call__(self, logits, labels, old_logps, advantages, ref_logps, sampling_ratio, token_count):
        return self.loss(logits, labels, old_logps, advantages, ref_logps if self.loss.beta else None,
                         sampling_ratio if self.corrected else None, token_count if self.counted else None)
