"""engine.torch_optimizer.state_dict() / load_state_dict(): the host AdamW's moments and step
counts as torch.optim.AdamW keys them, so torch's resume idiom (torch.save of engine.state_dict()
and the optimizer's) goes on bit for bit; a dict the host AdamW cannot take is refused, nothing
changed; the handle takes no second param group."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.errors import CheckpointError, OptimizerInputError
from tests import models

OPT = dict(lr=1e-2, weight_decay=0.1)


def _engine(grad_accum: int = 1, seed: int = 0):
    torch.manual_seed(seed)
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", compute_dtype=torch.float32,
                               grad_accum=grad_accum, optimizer=megacompile.AdamW(**OPT))


def _ids(i: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(i))


def _step(engine, i: int) -> float:
    return engine.step(idx=_ids(i), targets=_ids(100 + i))


@pytest.mark.parametrize("built", [False, True], ids=["into a fresh engine", "after a step"])
def test_a_torch_style_resume_goes_on_bit_for_bit(tmp_path, built):
    straight = _engine()
    expected = [_step(straight, i) for i in range(5)]
    first = _engine()
    for i in range(3):
        _step(first, i)
    torch.save({"model": first.state_dict(), "optimizer": first.torch_optimizer.state_dict()}, tmp_path / "ck.pt")
    saved = torch.load(tmp_path / "ck.pt")
    resumed = _engine(seed=7)
    if built:
        _step(resumed, 9)           # host state built, moments and counters of another run
    resumed.load_state_dict(saved["model"])
    resumed.torch_optimizer.load_state_dict(saved["optimizer"])
    assert resumed.steps_done == 3
    assert [_step(resumed, i) for i in range(3, 5)] == expected[3:]
    for key, value in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_the_state_dict_is_keyed_as_torch_adamw_keys_it():
    engine = _engine()
    torch.manual_seed(0)
    eager = models.NanoGPT(vocab=96, d=32, layers=2)
    opt = torch.optim.AdamW(eager.parameters(), **OPT)
    assert engine.torch_optimizer.state_dict()["state"] == {}       # nothing stepped yet, as torch
    for i in range(2):
        _step(engine, i)
        _, loss = eager(_ids(i), _ids(100 + i))
        loss.backward()
        opt.step()
        opt.zero_grad()
    ours, theirs = engine.torch_optimizer.state_dict(), opt.state_dict()
    assert ours["param_groups"][0]["params"] == theirs["param_groups"][0]["params"]
    assert ours["state"].keys() == theirs["state"].keys()
    for i, entry in theirs["state"].items():
        assert ours["state"][i].keys() == entry.keys()
        assert float(ours["state"][i]["step"]) == float(entry["step"]) == 2.0
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours["state"][i][moment], entry[moment], rtol=1e-4, atol=1e-7)
    other = _engine(seed=3)           # and an eager optimizer's state_dict loads as this one's does
    other.torch_optimizer.load_state_dict(theirs)
    assert other.steps_done == 2


def test_a_dict_the_host_adamw_cannot_take_is_refused_and_nothing_changes():
    engine = _engine()
    _step(engine, 0)
    good = engine.torch_optimizer.state_dict()
    before = {k: v.clone() for k, v in good["state"][0].items()}
    two_groups = {**good, "param_groups": [good["param_groups"][0], {**good["param_groups"][0], "params": []}]}
    wrong_shape = {**good, "state": {**good["state"], 0: {**good["state"][0], "exp_avg": torch.zeros(3)}}}
    amsgrad = {**good, "param_groups": [{**good["param_groups"][0], "amsgrad": True}]}
    for saved, match in ((two_groups, "2 param groups.*no_decay=..., lr_ratios=..."),
                         (wrong_shape, "exp_avg of .* is shape \\(3,\\)"), (amsgrad, "amsgrad=True"),
                         ({"state": {}}, "'state' and 'param_groups'")):
        with pytest.raises(CheckpointError, match=match):
            engine.torch_optimizer.load_state_dict(saved)
    assert engine.steps_done == 1
    for k, v in engine.torch_optimizer.state_dict()["state"][0].items():
        assert torch.equal(v, before[k])


def test_between_the_micro_batches_of_a_step_it_names_save_checkpoint():
    engine = _engine(grad_accum=2)
    _step(engine, 0)
    with pytest.raises(CheckpointError, match="between the micro-batches.*engine.save_checkpoint"):
        engine.torch_optimizer.state_dict()


def test_add_param_group_is_refused_naming_no_decay_lr_ratios_and_requires_grad():
    engine = _engine()
    norms = [p for n, p in engine.model.named_parameters() if "ln" in n]
    with pytest.raises(OptimizerInputError, match=r"no_decay=.*lr_ratios=.*requires_grad_\(False\)"):
        engine.torch_optimizer.add_param_group({"params": norms, "lr": 0.0})
    assert len(engine.torch_optimizer.param_groups) == 1
