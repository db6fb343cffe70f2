"""TrainingState's transitions, on a state with no engine: where the weights are after each, and
the counters as a checkpoint writes and reads them (state_dict / load_state_dict)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megacompile.errors import MegacompileError
from megacompile.optim import AdamW
from megacompile.state import Counters, TrainingState


class _Load:
    """A pending load: records the host state it was applied to."""

    def __init__(self):
        self.applied_to = []

    def apply(self, host, model=None) -> None:
        self.applied_to.append(host)


class _Host:
    """What host_built and wait_updates touch of a host state."""

    def __init__(self):
        self.missed, self.loaded_module = {}, None

    def load_module(self, model) -> None:
        self.loaded_module = model

    def wait_updates(self) -> None:
        pass


def _state(meta: bool = False) -> TrainingState:
    with torch.device("meta" if meta else "cpu"):
        model = nn.Linear(2, 2)
    return TrainingState(model, AdamW(), compute_dtype=torch.float32, grad_accum=2)


def test_a_model_with_weights_holds_them_until_the_host_state_takes_them():
    state = _state()
    assert (state.where, state.materialized) == ("module", True)
    host = _Host()
    state.host_built(host)
    assert (state.where, state.host, host.loaded_module) == ("host", host, state.model)
    assert host.missed is state.missed_steps      # the host state counts into the state's own dict


def test_weights_arriving_before_the_host_state_wait_for_it_and_after_it_go_straight_in():
    state, load = _state(meta=True), _Load()
    assert (state.where, state.materialized) == ("missing", False)
    state.weights_arrive(load, source_dir="/models/x")
    assert (state.where, state.pending_load, state.materialized, state.source_dir) == ("pending", load, True, "/models/x")
    host = _Host()
    state.host_built(host)
    assert (state.where, state.pending_load, load.applied_to) == ("host", None, [host])
    again = _Load()
    state.weights_arrive(again)
    assert (again.applied_to, state.pending_load) == ([host], None)


def test_parts_stand_pending_and_complete_the_weights_only_when_told():
    state, parts = _state(meta=True), _Load()
    state.parts_loaded(parts, complete=False)
    assert (state.where, state.weight_parts, state.materialized) == ("pending", parts, False)
    state.parts_loaded(parts, complete=True)
    assert state.materialized
    assert state.counters.loads == 2


def test_restore_applies_weights_counters_and_learning_rate_and_supersedes_parts():
    state = _state(meta=True)
    state.parts_loaded(_Load(), complete=False)
    missed = state.missed_steps
    load = _Load()
    state.restore(load, {"steps_done": 7, "micro_batches": 14, "missed_steps": {"weight": 2}},
                  param_group={"lr": 0.5})
    run = state.run_id
    assert (state.where, state.pending_load, state.weight_parts, state.materialized) == ("pending", load, None, True)
    assert (state.steps_done, state.micro_batches, state.skipped_steps, state.adamw_step("weight")) == (7, 14, 0, 5)
    assert state.missed_steps is missed and state.torch_optimizer.param_groups[0]["lr"] == 0.5
    state.restore(_Load(), {"run_id": "saved-run"})
    assert (state.run_id, state.steps_done) == ("saved-run", 7) and run != "saved-run"


def test_steps_commit_and_skip_through_the_counters():
    state = _state()
    state.micro_batches_committed(1, step_ends=False)
    state.micro_batches_committed(1, step_ends=True)
    state.micro_batches_committed(1, step_ends=False)
    state.step_skipped(1)
    assert (state.steps_done, state.micro_batches, state.skipped_steps) == (1, 2, 1)
    assert state.step_context()["step"] == 2


def test_counters_round_trip_and_refuse_what_they_do_not_hold():
    counters = Counters()
    counters.committed(3, step_ends=True)
    counters.missed_steps["w"] = 1
    saved = counters.state_dict()
    saved["missed_steps"]["w"] = 9        # a copy: the counters' own dict is not the checkpoint's
    other = Counters()
    other.load_state_dict(counters.state_dict())
    assert other.state_dict() == counters.state_dict() and counters.missed_steps == {"w": 1}
    with pytest.raises(MegacompileError, match="loads"):
        other.load_state_dict({"loads": 3})


def test_the_fields_are_read_only_outside_the_state():
    state = _state()
    for field in ("host", "pending_load", "weight_parts", "materialized", "source_dir", "steps_done",
                  "micro_batches", "skipped_steps", "run_id"):
        with pytest.raises(AttributeError):
            setattr(state, field, None)
