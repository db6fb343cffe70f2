"""The message of a trace that failed: the error's own sentence, then what megacompile says of it,
each ended by one period."""
from __future__ import annotations

import torch.nn as nn

from megacompile.capture.top import _describe_trace_failure


def test_an_error_ending_in_a_period_is_not_given_another():
    text = _describe_trace_failure(nn.Linear(1, 1), ValueError("Expected input batch_size (64) to match (62)."))
    assert "to match (62). megacompile traces with fake tensors" in text
    assert ".." not in text


def test_an_error_without_a_period_is_given_one():
    text = _describe_trace_failure(nn.Linear(1, 1), RuntimeError("data-dependent branch"))
    assert "RuntimeError: data-dependent branch. megacompile traces" in text
