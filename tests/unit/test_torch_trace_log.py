"""torch's structured trace stays off in the tests unless TORCH_TRACE asks for it (conftest.py):
pytest's capture handlers on its non-propagating logger would switch it on in every test."""
from __future__ import annotations

import logging
import os

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode


@pytest.mark.skipif(bool(os.environ.get("TORCH_TRACE")), reason="the trace was asked for")
def test_faking_a_tensor_writes_no_trace_record_into_the_captured_log(caplog):
    caplog.set_level(logging.DEBUG)
    with FakeTensorMode() as mode:
        mode.from_tensor(torch.ones(2, 3))      # a capture describes each tensor it fakes this way
    assert not [r for r in caplog.records if r.name == "torch.__trace"]
