"""The sampler's correction (TRL's vllm_importance_sampling_correction) against its formulas,
written out element by element in float64 Python: each mode's weights on a fixed batch (1e-6),
the tokens vLLM gave no log-probability weighing 1, and the log-probabilities of the completions
placed where rollout_batch puts their labels."""
import math

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain import sampled_logps, sampling_ratio
from megacompile.posttrain.rollout import Completion
from megacompile.posttrain.rollout_batch import rollout_batch
from megacompile.posttrain.sampling_correction import MODES

CAP = 1.5
# (clip_max, clip_min): TRL 1.16's bounds; the lower one, and an open upper one
BOUNDS = [(CAP, None), (CAP, 0.8), (None, 0.8)]


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g) * 2
    sampled = old + (torch.rand(3, 5, generator=g) - 0.5) * 1.6
    mask = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    sampled[2, 4] = math.nan                  # a stop token vLLM did not score
    return old, sampled, mask


def _expected(old, sampled, mask, mode, clip_max=CAP, clip_min=None):
    rows, cols = old.shape
    scored = [[bool(mask[r, t]) and not math.isnan(float(sampled[r, t])) for t in range(cols)] for r in range(rows)]
    diff = [[float(old[r, t]) - float(sampled[r, t]) if scored[r][t] else 0.0 for t in range(cols)]
            for r in range(rows)]
    out = []
    for r in range(rows):
        if mode.startswith("sequence"):
            weights = [math.exp(sum(diff[r]))] * cols
        else:
            weights = [math.exp(d) for d in diff[r]]
        high = math.inf if clip_max is None else clip_max
        low = -math.inf if clip_min is None else clip_min
        if mode.endswith("truncate"):
            weights = [max(min(w, high), low) for w in weights]
        else:
            weights = [0.0 if w > high or w < low else w for w in weights]
        out.append(weights)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("clip_max, clip_min", BOUNDS)
@pytest.mark.parametrize("mode", MODES)
def test_each_mode_weighs_the_tokens_as_its_formula(mode, clip_max, clip_min):
    old, sampled, mask = _batch()
    ratio, metrics = sampling_ratio(old, sampled, mask, mode, clip_max, clip_min)
    expected = _expected(old, sampled, mask, mode, clip_max, clip_min)
    assert ratio.shape == old.shape
    assert torch.allclose(ratio.double()[mask], expected[mask], rtol=1e-6, atol=0)
    gaps = [abs(float(old[r, t]) - float(sampled[r, t])) for r in range(3) for t in range(5)
            if mask[r, t] and not math.isnan(float(sampled[r, t]))]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(sum(gaps) / len(gaps), rel=1e-6)
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(max(gaps), rel=1e-6)
    seen = expected[:, 0] if mode.startswith("sequence") else expected[mask]
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(seen.mean().item(), rel=1e-6)
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(seen.max().item(), rel=1e-6)


def test_the_modes_differ_where_the_formulas_do():
    old, sampled, mask = _batch()
    weights = {m: sampling_ratio(old, sampled, mask, m, CAP)[0] for m in MODES}
    assert not torch.equal(weights["token_truncate"], weights["sequence_truncate"])
    assert (weights["token_mask"][mask] == 0).any() and (weights["token_truncate"][mask] == CAP).any()
    low = sampling_ratio(old, sampled, mask, "token_truncate", CAP, 0.8)[0]
    assert (low[mask] == 0.8).any() and not (weights["token_truncate"][mask] == 0.8).any()
    raw = sampling_ratio(old, sampled, mask, "token_truncate", 1e9)[0][mask]        # no bound reached
    assert (raw > CAP).any() and (raw < 0.8).any()
    open_above = sampling_ratio(old, sampled, mask, "token_mask", None, 0.8)[0][mask]
    assert torch.equal(open_above, torch.where(raw < 0.8, 0.0, raw))


def test_bad_modes_and_caps_are_refused():
    old, sampled, mask = _batch()
    with pytest.raises(ArgumentError, match="token_truncate, token_mask"):
        sampling_ratio(old, sampled, mask, "token", CAP)
    with pytest.raises(ArgumentError, match="positive number"):
        sampling_ratio(old, sampled, mask, "token_mask", 0)
    with pytest.raises(ArgumentError, match="both are null"):
        sampling_ratio(old, sampled, mask, "sequence_truncate", None, None)
    with pytest.raises(ArgumentError, match=r"clip_min \(2.0\) must be below"):
        sampling_ratio(old, sampled, mask, "token_mask", CAP, 2.0)


def test_the_samplers_log_probabilities_sit_at_their_label_positions():
    completions = [Completion(0, (7, 8), (4, 5), (-0.5, -1.5)), Completion(0, (7, 8), (6,), (-2.0,)),
                   Completion(1, (9,), (4, 5, 6, 3), (-0.1, -0.2, -0.3, None))]
    batch = rollout_batch(completions, torch.tensor([1.0, 0.0, 1.0, 1.0]), 1, width=4)
    got = sampled_logps(completions, 4)
    labelled = batch["labels"] != -100
    # where the labels hold the completion's tokens, the sampler's value for that token
    assert got[0].tolist() == [0.0, -0.5, -1.5, 0.0] and got[1].tolist() == [0.0, -2.0, 0.0, 0.0]
    assert got[2, :3].tolist() == pytest.approx([-0.1, -0.2, -0.3]) and math.isnan(got[2, 3])
    assert labelled.tolist() == (got != 0).tolist()
    assert sampled_logps([Completion(0, (1,), (2,))], 4) is None
