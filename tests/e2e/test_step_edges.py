"""The edges of a step: a checkpoint between micro-batches, buffers a forward writes, a closed
engine, two threads on one engine, and load_state_dict that checks everything before writing."""
from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn as nn

import megacompile
from megacompile.runtime.executor import Executor
from tests import models
from tests.e2e.atomic import assert_bit_equal, assert_same_state, masters, snapshot


def _ids(seed=0):
    return models.batch(96, 2, 16, seed=seed)


def _engine(model, **kw):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2), **kw)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=32, layers=2, heads=2)


def test_a_checkpoint_between_micro_batches_resumes_exactly(gpt, tmp_path):
    straight, saved = _engine(copy.deepcopy(gpt), grad_accum=2), _engine(copy.deepcopy(gpt), grad_accum=2)
    for e in (straight, saved):
        for seed in range(3):                  # step 1, then half of step 2
            e.step(idx=_ids(seed), targets=_ids(seed))
    path = str(tmp_path / "mid.pt")
    saved.save_checkpoint(path)
    straight.step(idx=_ids(3), targets=_ids(3))
    resumed = _engine(copy.deepcopy(gpt), grad_accum=2)
    resumed.prepare(idx=_ids(), targets=_ids())
    resumed.load_checkpoint(path)
    resumed.step(idx=_ids(3), targets=_ids(3))
    assert resumed.steps_done == straight.steps_done == 2
    assert_bit_equal(masters(resumed), masters(straight))
    other = _engine(copy.deepcopy(gpt), grad_accum=3)
    other.prepare(idx=_ids(), targets=_ids())
    before = snapshot(other)
    with pytest.raises(megacompile.MegacompileError, match="grad_accum=2"):
        other.load_checkpoint(path)
    assert_same_state(before, snapshot(other))


class _NormBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin, self.bn = nn.Linear(d, d), nn.BatchNorm1d(d)

    def forward(self, x):                       # x: (N, d)
        return x + self.bn(self.lin(x))


class _NormNet(nn.Module):
    def __init__(self, d=16, stem_norm=False):
        super().__init__()
        self.emb = nn.Embedding(10, d)
        self.stem = nn.BatchNorm1d(d) if stem_norm else nn.Identity()
        self.h = nn.ModuleList([_NormBlock(d) for _ in range(2)])
        self.head = nn.Linear(d, 10)

    def forward(self, idx, targets):
        x = self.stem(self.emb(idx))
        for block in self.h:
            x = block(x)
        return nn.functional.cross_entropy(self.head(x), targets)


@pytest.mark.parametrize("where,buffer", [("block", "bn.num_batches_tracked"), ("block-no-count", "bn.running_mean"),
                                          ("stem", "stem.num_batches_tracked")])
def test_a_forward_that_updates_buffers_is_refused_at_capture(where, buffer):
    model = _NormNet(stem_norm=where == "stem")
    if where == "block-no-count":
        for block in model.h:
            block.bn.num_batches_tracked = None
    if where == "stem":
        for block in model.h:
            block.bn.eval()
    idx = torch.randint(0, 10, (8,), generator=torch.Generator().manual_seed(0))
    engine = _engine(model)
    with pytest.raises(megacompile.CaptureError, match=buffer.replace(".", r"\.")):
        engine.step(idx, idx)
    if where != "stem":   # (a norm outside the blocks does not capture even in eval(): not this test's matter)
        model.eval()                              # running statistics only read: trains
        assert isinstance(_engine(model).step(idx, idx), float)


def _in_thread(fn, timeout=30.0):
    result = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the call hung"
    return result


def test_step_after_close_is_a_clear_error(gpt):
    engine = _engine(copy.deepcopy(gpt))
    engine.step(idx=_ids(), targets=_ids())
    engine.close()
    for call in (lambda: engine.step(idx=_ids(), targets=_ids()), lambda: engine(idx=_ids())):
        result = _in_thread(call)
        assert isinstance(result.get("error"), megacompile.MegacompileError)
        assert "closed" in str(result["error"])
    engine.close()                                 # twice is harmless
    assert engine.state_dict()                     # the trained weights stay readable


def test_two_threads_on_one_engine_get_a_clear_error_and_nothing_leaks(gpt, monkeypatch):
    engine = _engine(copy.deepcopy(gpt))
    engine.step(idx=_ids(), targets=_ids())
    inside, release = threading.Event(), threading.Event()
    original = Executor._input

    def held_input(self, node):
        inside.set()
        release.wait(10)
        return original(self, node)
    monkeypatch.setattr(Executor, "_input", held_input)
    first = {}
    t = threading.Thread(target=lambda: first.update(loss=engine.step(idx=_ids(1), targets=_ids(1))))
    t.start()
    assert inside.wait(10)
    try:
        with pytest.raises(megacompile.MegacompileError, match="another call runs"):
            engine.step(idx=_ids(2), targets=_ids(2))
    finally:
        release.set()
        t.join(30)
    monkeypatch.setattr(Executor, "_input", original)
    assert "loss" in first and engine.steps_done == 2
    assert engine.backend.memory.live_bytes == 0
    engine.step(idx=_ids(3), targets=_ids(3))
    assert engine.steps_done == 3


@pytest.mark.parametrize("bad", ["meta", "int64", "nan", "shape"])
def test_load_state_dict_checks_everything_before_writing(gpt, bad):
    engine = _engine(copy.deepcopy(gpt))
    engine.step(idx=_ids(), targets=_ids())
    before = snapshot(engine)
    state = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in engine.state_dict().items()}
    last = list(state)[-1]                         # everything before it would be written first
    if bad == "meta":
        state[last] = torch.empty_like(state[last], device="meta")
    elif bad == "int64":
        state[last] = torch.ones_like(state[last], dtype=torch.int64)
    elif bad == "nan":
        state[last] = torch.full_like(state[last], float("nan"))
    else:
        state[last] = state[last][..., :1]
    with pytest.raises(megacompile.MegacompileError, match="nothing was loaded") as info:
        engine.load_state_dict(state)
    assert last in str(info.value) or "lm_head" in str(info.value) or "wte" in str(info.value)
    assert_same_state(before, snapshot(engine))
