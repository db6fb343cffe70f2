"""What the tests of another trainer's checkpoint taken in share (test_sharded_checkpoint.py,
test_torchtune_checkpoint.py): the engine's host state against the tensors the trainer itself
gathered, and a refusal that leaves the engine as it was."""
from __future__ import annotations

import pytest
import torch


def assert_host_is(engine, expected: dict, ids: torch.Tensor) -> None:
    """After the import, every trained parameter's master and moments are `expected`'s to the bit
    (master/NAME, exp_avg/NAME, exp_avg_sq/NAME), and no other parameter trains."""
    engine.prepare(input_ids=ids, labels=ids)
    host = engine.host
    assert set(host.slots) == {k.partition("/")[2] for k in expected if k.startswith("master/")}
    for name in host.slots:
        for table in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(host.view(table, name), expected[f"{table}/{name}"]), (table, name)


def refused_untouched(engine, folder: str, error, match: str, **kwargs) -> None:
    """load_trainer_checkpoint(folder) refused with `error` matching `match`, the engine unchanged."""
    before = {n: t.clone() for n, t in engine.state_dict().items()}
    with pytest.raises(error, match=match):
        engine.load_trainer_checkpoint(folder, **kwargs)
    assert engine.state.steps_done == 0
    assert all(torch.equal(t, before[n]) for n, t in engine.state_dict().items())
