"""A step whose inputs leave trained parameters without a gradient: a LLaVA batch without
pixel_values runs neither the vision tower nor the projector.

torch.optim.AdamW skips a parameter whose .grad is None (no moment decay, no weight decay, no
step count); the host update steps every parameter the host state holds, so such a step is
refused before it runs, naming the parameters, and the engine is left as it was. Frozen, the
vision side is no longer trained and text-only steps train as eagerly.
"""
from __future__ import annotations

import re

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import BETAS, EPS, LR, WD, float64_noise
from tests.e2e.harness import assert_same_weights, clone
from tests.e2e.test_vlm import eager
from tests.vlm import IMAGE_TOKEN, batch, llava

VISION = ("model.vision_tower.", "model.multi_modal_projector.")


def text_only(seed: int) -> dict[str, torch.Tensor]:
    """A batch of the same shape with no image: no pixel_values, no image tokens."""
    b = batch(seed=seed)
    del b["pixel_values"]
    b["input_ids"] = b["input_ids"].masked_fill(b["input_ids"] == IMAGE_TOKEN, 5)
    b["labels"] = b["input_ids"].clone()
    return b


def engine_for(model, **kwargs):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", retrace=True,
                               optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                           kernel="torch"), **kwargs)


def snapshot(engine) -> dict[str, torch.Tensor]:
    engine.synchronize()
    state = {n: t.clone() for n, t in engine.state_dict().items()}
    state |= {f"exp_avg:{n}": engine.host.view("exp_avg", n).clone() for n in engine.host.slots}
    return state


def assert_unchanged(engine, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(engine)
    assert after.keys() == before.keys()
    for n, t in after.items():
        assert torch.equal(t, before[n]), n


def test_a_text_only_step_after_an_image_step_is_refused_and_leaves_nothing_half_done():
    """Images, then text only (refused: it would step the vision tower on a stale gradient, where
    torch skips it), then images again: the run goes on as eager AdamW over the image steps."""
    model = llava()
    engine = engine_for(clone(model))
    images = [batch(seed=0), batch(seed=2), batch(seed=3)]
    losses = [engine.step(**images[0])]
    before = snapshot(engine)
    with pytest.raises(megacompile.InputMismatchError,
                       match=r"does not reach 41 trainable parameters \(model\.vision_tower\.embeddings\."
                             r"patch_embedding\.weight, .* and 35 more\).*Freeze them .*pixel_values") as e:
        engine.step(**text_only(1))
    missing = [n for n, _ in model.named_parameters() if n.startswith(VISION) and "post_layernorm" not in n]
    named = re.search(r"parameters \((.*) and 35 more\)", str(e.value)).group(1).split(", ")
    assert len(missing) == 41 and len(named) == 6 and set(named) <= set(missing)
    assert engine.steps_done == 1 and engine.micro_batches == 1
    assert_unchanged(engine, before)
    losses += [engine.step(**b) for b in images[1:]]
    reference = clone(model)
    expected = eager(reference, images)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    noise = float64_noise(lambda exact: eager(exact, [{k: (v.double() if v.is_floating_point() else v)
                                                       for k, v in b.items()} for b in images]),
                          model, reference)
    assert_same_weights(engine, reference, noise=noise)


def test_an_image_step_after_a_text_only_first_step_is_refused():
    """The host state holds what the first step's program reaches; the vision side it did not
    reach has no masters to train."""
    model = llava()
    engine = engine_for(clone(model))
    engine.step(**text_only(0))
    before = snapshot(engine)
    with pytest.raises(megacompile.InputMismatchError,
                       match=r"reaches 41 trainable parameters \(model\.multi_modal_projector\..*that the first "
                             r"step's inputs did not reach"):
        engine.step(**batch(seed=1))
    assert engine.steps_done == 1
    assert_unchanged(engine, before)


def test_a_text_only_micro_batch_is_refused_and_the_committed_ones_stay():
    """With gradient accumulation every micro-batch must reach the trained parameters; the
    refused one leaves the step's committed micro-batches as they were."""
    engine = engine_for(clone(llava()), grad_accum=2)
    engine.step(**batch(seed=0))
    before = snapshot(engine)
    with pytest.raises(megacompile.InputMismatchError, match="does not reach 41 trainable parameters"):
        engine.step(**text_only(1))
    assert engine.steps_done == 0 and engine.micro_batches == 1
    assert_unchanged(engine, before)
    engine.step(**batch(seed=1))
    assert engine.steps_done == 1


def test_with_the_vision_side_frozen_text_only_steps_train_as_eagerly():
    """The fix the refusal names: frozen, the tower and projector are constants; images, text
    only, images agree with eager AdamW in losses (1e-5) and weights (the noise floor)."""
    model = llava()
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(VISION))
    batches = [batch(seed=0), text_only(1), batch(seed=2)]
    reference = clone(model)
    expected = eager(reference, batches)
    engine = engine_for(clone(model))
    losses = [engine.step(**b) for b in batches]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0)
    noise = float64_noise(lambda exact: eager(exact, [{k: (v.double() if v.is_floating_point() else v)
                                                       for k, v in b.items()} for b in batches]),
                          model, reference)
    assert_same_weights(engine, reference, noise=noise)
