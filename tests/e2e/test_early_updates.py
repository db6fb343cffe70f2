"""compile(..., updates="as_gradients_land"): each owner's host AdamW update starts as soon as its
gradients have landed, beside the rest of the backward.

The same arithmetic as updates at commit, bit for bit; a non-finite step in which no update ran
yet is still skipped whole; one that fails after an update ran leaves the engine refusing to go
on until a checkpoint is loaded. Settings it cannot honour are refused."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

import megacompile
from megacompile.errors import ArgumentError, PartialStepError
from megacompile.ir.program import Op, grads
from megacompile.runtime.executor import Executor
from tests import models
from tests.e2e.atomic import (Poisoned, assert_bit_equal, assert_poisoned_step_skipped, assert_same_state, engine,
                              inputs, masters, snapshot)

LAND = "as_gradients_land"


class PoisonedEmbedding(Poisoned):
    """Poisoned whose NaN gradient (grad_poison=0) is the position embedding's: its owner, the
    prologue, lands its gradients last, after every block's update has run."""

    def forward(self, idx, targets, loss_scale, grad_poison):
        _, loss = self.gpt(idx, targets)
        w = self.gpt.transformer.wpe.weight
        return loss * loss_scale + 0.0 * torch.sqrt(grad_poison * w.abs().sum())


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Poisoned(layers=2, d=16)


def test_updates_as_gradients_land_train_exactly_as_at_commit():
    """Losses and every master after several steps, bit for bit, in bf16 compute with a frozen
    parameter (its owner keeps the others' runs)."""
    torch.manual_seed(0)
    base = models.NanoGPT(vocab=96, d=32, layers=3, heads=2)
    base.transformer.h[1].attn.qkv.weight.requires_grad_(False)
    runs = {}
    for updates in ("at_commit", LAND):
        e = megacompile.compile(copy.deepcopy(base), hbm_budget=1.0, device="cpu", compute_dtype=torch.bfloat16,
                                optimizer=megacompile.AdamW(lr=1e-2, weight_decay=0.1), updates=updates)
        losses = [e.step(idx=ids, targets=ids) for ids in (models.batch(96, 2, 16, seed=s) for s in range(4))]
        runs[updates] = (losses, masters(e), e.steps_done)
        e.close()
    assert runs["at_commit"][0] == runs[LAND][0]
    assert runs["at_commit"][2] == runs[LAND][2] == 4
    assert_bit_equal(runs["at_commit"][1], runs[LAND][1])


def test_each_update_is_placed_after_its_last_gradient_and_predicted_shorter():
    """In the plan every OPTIMIZER_STEP follows the WAIT of each gradient its owner takes; those the
    planner left where their gradients land stand before the last backward node (a gradient's WAIT
    comes after the next compute node) in landing order, and those it moved stand after the last
    gradient in forward order (planner/update_order.py); the cost model times the overlap."""
    # A shape whose host AdamW is about as long as its backward on the h100 profile (5 and 5 ms).
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 1024, "intermediate_size": 2752,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
              "max_position_embeddings": 1024, "tie_word_embeddings": True}
    at_commit = megacompile.plan(config, hbm_budget=0.3, hardware="h100", batch=4, seq=512)
    early = megacompile.plan(config, hbm_budget=0.3, hardware="h100", batch=4, seq=512, updates=LAND)
    nodes = early.program.nodes
    waited = {n.stage: i for i, n in enumerate(nodes) if n.op is Op.WAIT and grads(n.stage) in n.reads}
    steps = [(i, n) for i, n in enumerate(nodes) if n.op is Op.OPTIMIZER_STEP]
    from megacompile.capture.model_graph import owners
    contributors = owners(early.captured)[1]
    for i, n in steps:
        assert all(waited[c] < i for c in contributors[n.stage]), n
    last_backward = max(i for i, n in enumerate(nodes) if n.op is Op.BACKWARD)
    moved = early.program.facts.get("updates_in_forward_order", 0)
    kept, tail = steps[:len(steps) - moved], steps[len(steps) - moved:]
    assert sum(i < last_backward for i, _ in kept) == len(kept) - max(0, 2 - moved)
    assert [n.stage for _, n in kept] == sorted((n.stage for _, n in kept), reverse=True)
    assert [n.stage for _, n in tail] == sorted(n.stage for _, n in tail)
    assert all(i > max(waited.values()) for i, _ in tail)
    assert all(i > max(j for j, m in enumerate(at_commit.program.nodes) if m.op is Op.BACKWARD)
               for i, m in enumerate(at_commit.program.nodes) if m.op is Op.OPTIMIZER_STEP)
    assert early.prediction.step_s < 0.9 * at_commit.prediction.step_s


def test_a_non_finite_gradient_before_any_update_skips_the_whole_step(model):
    """ln_f's gradient lands first: its update refuses, and so does every later one."""
    ours, reference = engine(copy.deepcopy(model), updates=LAND), engine(copy.deepcopy(model))
    for e in (ours, reference):
        e.step(**inputs(0))
    before = assert_poisoned_step_skipped(ours, 1)
    with pytest.warns(RuntimeWarning, match="skipped"):
        ours.step(**inputs(2, loss_scale=float("nan")))
    assert_same_state(before, snapshot(ours), grads=False)
    for e in (ours, reference):
        e.step(**inputs(3))
    assert ours.steps_done == reference.steps_done == 2
    assert_bit_equal(masters(ours), masters(reference))


def test_a_step_that_fails_after_an_update_ran_stops_the_engine_until_a_load(tmp_path):
    torch.manual_seed(0)
    e = engine(PoisonedEmbedding(layers=2, d=16), updates=LAND)
    e.step(**inputs(0))
    checkpoint = str(tmp_path / "whole")
    e.save_checkpoint(checkpoint)
    expected = snapshot(e)
    with pytest.raises(PartialStepError, match=r"step 2 failed \(1 gradients hold inf or NaN .*wpe.*\) after 3 of "
                                               r"its 4 owners' host updates had run"):
        e.step(**inputs(1, grad_poison=0.0))
    record = e.last_step      # the step that failed, not the one before it
    assert record.step == 2 and record.partial and not record.updated and "3 of its 4 owners" in record.reason
    for refused, call in (("step()", lambda: e.step(**inputs(2))),
                          ("save_checkpoint()", lambda: e.save_checkpoint(str(tmp_path / "partial"))),
                          ("save_pretrained()", lambda: e.save_pretrained(str(tmp_path / "export"))),
                          ("state_dict()", e.state_dict)):
        with pytest.raises(PartialStepError, match=rf"{refused.replace('(', '[(]').replace(')', '[)]')} refused: "
                                                   r"step 2 failed .* the model's own parameters .* load_checkpoint"
                           ) as raised:
            call()
        assert "compile the model again" not in str(raised.value)
    assert not (tmp_path / "partial").exists() and not (tmp_path / "export").exists()
    e.load_checkpoint(checkpoint)
    assert_same_state(expected, snapshot(e), grads=False)
    e.step(**inputs(2))
    assert e.steps_done == 2


def test_an_exception_after_an_update_ran_says_so(model, tmp_path, monkeypatch):
    """The prologue's backward is the step's last: by then every block's update has started."""
    e = engine(copy.deepcopy(model), updates=LAND)
    e.step(**inputs(0))
    e.save_checkpoint(str(tmp_path / "whole"))
    backward = Executor._backward

    def failing(self, node):
        if node.stage == 0:
            raise RuntimeError("injected")
        return backward(self, node)
    monkeypatch.setattr(Executor, "_backward", failing)
    with pytest.raises(RuntimeError, match="injected") as raised:
        e.step(**inputs(1))
    assert any("load_checkpoint" in note for note in raised.value.__notes__)
    assert e.last_step.partial and e.last_step.step == 2 and "RuntimeError: injected" in e.last_step.reason
    monkeypatch.setattr(Executor, "_backward", backward)
    with pytest.raises(PartialStepError, match="RuntimeError: injected"):
        e.step(**inputs(1))
    e.load_checkpoint(str(tmp_path / "whole"))
    e.step(**inputs(1))


@pytest.mark.parametrize("kw,words", [
    ({"updates": "eager"}, "updates says when each owner's host AdamW update starts"),
    ({"updates": LAND, "grad_accum": 2}, "needs grad_accum=1"),
    ({"updates": LAND, "clip": True}, "cannot clip gradients"),
])
def test_settings_updates_cannot_honour_are_refused(model, kw, words):
    with pytest.raises(ArgumentError, match=words):
        engine(copy.deepcopy(model), **kw)


def test_plan_refuses_clipping_with_updates_as_gradients_land():
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ArgumentError, match="cannot clip gradients"):
            megacompile.plan(config, hbm_budget=1, batch=1, seq=64, updates=LAND,
                             optimizer=megacompile.AdamW(max_grad_norm=1.0))


def test_the_disk_tier_is_refused_with_updates_as_gradients_land(model, tmp_path):
    with pytest.raises(ArgumentError, match="not built for the disk tier"):
        engine(copy.deepcopy(model), updates=LAND, nvme_dir=str(tmp_path))


def test_a_norm_measured_only_is_recorded_and_changes_nothing():
    """max_grad_norm=math.inf measures the global norm (its scale is 1): the updates need not wait
    for it, and each step's record holds the same norm as at commit."""
    import math
    torch.manual_seed(0)
    base = models.NanoGPT(vocab=96, d=32, layers=2, heads=2)
    runs = {}
    for updates in ("at_commit", LAND):
        e = megacompile.compile(copy.deepcopy(base), hbm_budget=1.0, device="cpu", updates=updates,
                                optimizer=megacompile.AdamW(lr=1e-2, max_grad_norm=math.inf))
        norms = []
        for s in range(3):
            ids = models.batch(96, 2, 16, seed=s)
            e.step(idx=ids, targets=ids)
            norms.append(e.last_step.grad_norm)
        runs[updates] = (norms, masters(e))
        e.close()
    assert runs[LAND][0] == runs["at_commit"][0] and all(n > 0 for n in runs[LAND][0])
    assert_bit_equal(runs["at_commit"][1], runs[LAND][1])


@pytest.mark.slow      # about 6 s on two cores
def test_an_exception_at_any_node_changes_nothing_before_the_first_update_and_stops_the_engine_after(
        model, tmp_path, monkeypatch):
    """Every node of the step fails in turn: up to the first OPTIMIZER_STEP (which starts nothing when
    it fails itself) the state is as it was and a retry is exact; after it, the step's updates ran
    (the failed walk waits for them), so the engine refuses to go on until the checkpoint is loaded,
    and the step taken after the load is the uninjected one."""
    from tests.e2e.test_exception_sweep import Injected
    e = engine(copy.deepcopy(model), updates=LAND)
    e.step(**inputs(0))
    checkpoint = str(tmp_path / "before")
    e.save_checkpoint(checkpoint)
    clean = inputs(99)
    before = snapshot(e)
    e.step(**clean)
    expected = snapshot(e)
    e.load_checkpoint(checkpoint)
    nodes = e._compile((), clean, train=True).plan.program.nodes
    first_update = min(i for i, n in enumerate(nodes) if n.op is Op.OPTIMIZER_STEP)
    injected = Injected()
    for op in Op:
        monkeypatch.setattr(Executor, "_" + op.value, injected.wrap(getattr(Executor, "_" + op.value)))
    for at in range(len(nodes)):
        injected.arm(at, RuntimeError)
        with pytest.raises(RuntimeError, match="injected"):
            e.step(**clean)
        if at <= first_update:
            assert e.state.partial_step is None, at
            assert_same_state(before, snapshot(e), grads=False)
        else:
            assert "RuntimeError: injected" in e.state.partial_step, at
            with pytest.raises(PartialStepError):
                e.step(**clean)
            e.load_checkpoint(checkpoint)
            assert_same_state(before, snapshot(e), grads=False)
        e.step(**clean)
        assert_same_state(expected, snapshot(e))
        e.load_checkpoint(checkpoint)


def test_data_parallelism_is_refused_with_updates_as_gradients_land():
    """The check every door runs (compile() with a process group, plan(..., ranks=))."""
    from megacompile import Settings
    Settings(updates=LAND).check_updates(clip=False, ranks=1)
    with pytest.raises(ArgumentError, match="not built for data parallelism"):
        Settings(updates=LAND).check_updates(clip=False, ranks=2)
    Settings().check_updates(clip=True, ranks=2)        # at commit: anything goes


def test_a_step_refused_before_its_walk_began_is_not_taken_for_a_partial_one(model, monkeypatch):
    """The last step's updates all ran; a failure before this step's walk (its program's check)
    must not be read as this step's updates having run."""
    from megacompile.engine import step as step_module
    e = engine(copy.deepcopy(model), updates=LAND)
    e.step(**inputs(0))
    before = snapshot(e)
    enter = step_module.enter_program

    def refused(*args, **kwargs):
        raise RuntimeError("refused before the walk")
    monkeypatch.setattr(step_module, "enter_program", refused)
    with pytest.raises(RuntimeError, match="refused before the walk"):
        e.step(**inputs(1))
    assert e.state.partial_step is None
    assert_same_state(before, snapshot(e), grads=False)
    monkeypatch.setattr(step_module, "enter_program", enter)
    e.step(**inputs(1))
    assert e.steps_done == 2
