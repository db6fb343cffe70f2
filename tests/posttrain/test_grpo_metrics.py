"""What a GRPO run logs of a rollout batch's completions, as TRL logs it: lengths, the share cut at
max_completion_length and the lengths of those that ended, and the share of groups whose rewards
are all alike (no advantage to learn from)."""
import math

import pytest
import torch

from megacompile.posttrain import nanstd
from megacompile.train.stages.rollout_metrics import COMPLETION_METRICS, completion_metrics


def test_lengths_the_clipped_share_and_the_groups_without_spread():
    lengths = torch.tensor([3.0, 8.0, 5.0, 8.0, 2.0, 8.0])
    truncated = torch.tensor([False, True, False, True, False, True])
    rewards = torch.tensor([1.0, 1.0, 0.5, 0.0, math.nan, 0.2])       # groups of two: alike, apart, one scored
    got = completion_metrics(lengths, truncated, nanstd(rewards.view(-1, 2), dim=1).repeat_interleave(2))
    assert set(got) == set(COMPLETION_METRICS)
    assert got["completions/mean_length"] == pytest.approx(34 / 6)
    assert (got["completions/min_length"], got["completions/max_length"]) == (2.0, 8.0)
    assert got["completions/clipped_ratio"] == 0.5
    assert got["completions/mean_terminated_length"] == pytest.approx(10 / 3)
    assert (got["completions/min_terminated_length"], got["completions/max_terminated_length"]) == (2.0, 5.0)
    # one group of three alike; a group with one scored reward has no spread to measure (NaN), as in TRL
    assert got["frac_reward_zero_std"] == pytest.approx(1 / 3)


def test_a_batch_cut_everywhere_has_no_terminated_lengths():
    got = completion_metrics(torch.tensor([4.0, 4.0]), torch.tensor([True, True]), torch.tensor([0.7, 0.7]))
    assert got["completions/clipped_ratio"] == 1.0 and got["completions/mean_terminated_length"] == 0.0
    assert got["frac_reward_zero_std"] == 0.0
