"""Vision-language models: a tiny LLaVA trains through megacompile as eagerly.

`engine.step(input_ids=..., pixel_values=..., labels=...)`: the vision tower and projector run
in the prologue, the image features are scattered over the image tokens' embeddings at static
shapes (capture/image_tokens.py), the Llama blocks stream. 3 steps agree with eager
torch.optim.AdamW in float32: losses to 1e-5, first-step gradients to 1e-5 (or twice the move a
one-ulp rounding of the weights makes in eager float32's own, where larger), weights to the noise floor,
below the weights' bytes and at the smallest budget the plan reports.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import (LR, BETAS, EPS, WD, assert_first_gradients, float64_noise, rounding_floor,
                                         weight_bytes)
from megacompile.arguments import InputLimits
from megacompile.capture import find_block_stack
from megacompile.errors import CaptureError
from tests.e2e.harness import assert_same_weights, clone
from tests.vlm import IMAGE_TOKEN, PATCHES, SEQ, batch, llava, vipllava

GiB = 2 ** 30
STEPS = 3


def eager(model, batches, first_moments: dict | None = None) -> list[float]:
    """torch.optim.AdamW over the batches, in place."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    names = {p: n for n, p in model.named_parameters()}
    losses = []
    for i, inputs in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = model(**inputs).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i == 0 and first_moments is not None:
            first_moments.update({names[p]: s["exp_avg"].clone() for p, s in opt.state.items()})
    return losses


def first_gradients(model, inputs) -> dict[str, torch.Tensor]:
    model(**inputs).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def through_megacompile(model, batches, budget_bytes: float, first_moments: dict):
    engine = megacompile.compile(model, hbm_budget=budget_bytes / GiB, device="cpu",
                                 optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                             kernel="torch"))
    losses, peaks = [], []
    for i, inputs in enumerate(batches):
        losses.append(engine.step(**inputs))
        peaks.append(engine.memory_stats()["device_peak_bytes"])
        if i == 0:
            engine.synchronize()
            # torch holds state for the parameters a step gave a gradient (not the tower's last norm)
            first_moments.update({n: engine.host.view("exp_avg", n).clone() for n in engine.host.slots
                                  if engine.state.adamw_step(n) > 0})
    engine.synchronize()
    return engine, losses, peaks


def assert_parity(model, batches, smallest_only: bool = False, weights: float = 0.9, then_smallest: bool = True,
                  block_path: str = "model.language_model.layers") -> None:
    """At `weights` times the weights' bytes (below them, the blocks stream), then (`then_smallest`)
    at the smallest budget the plan reports; `smallest_only`: at the smallest budget alone (read
    from a plan of the first batch)."""
    reference, eager_moments = clone(model), {}
    losses = eager(reference, batches, eager_moments)

    def in_float64(exact):
        for config in (getattr(exact, "config", None), getattr(getattr(exact, "config", None), "text_config", None)):
            if getattr(config, "_experts_implementation", None) == "grouped_mm":
                config._experts_implementation = "eager"     # torch's grouped GEMM takes no float64
        eager(exact, [{k: (v.double() if v.is_floating_point() else v) for k, v in b.items()} for b in batches])
    noise = float64_noise(in_float64, model, reference)
    floor = rounding_floor(lambda m: first_gradients(m, batches[0]), model)
    budget = weights * weight_bytes(model)
    if smallest_only:
        budget = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu").prepare(**batches[0]).minimum_budget_bytes
    for _ in range(1 if smallest_only or not then_smallest else 2):
        moments = {}
        engine, ours, peaks = through_megacompile(clone(model), batches, budget, moments)
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
        assert_first_gradients(moments, eager_moments, floor)
        assert_same_weights(engine, reference, noise=noise)
        assert max(peaks) <= budget
        assert engine.plan.captured.block_path == block_path
        budget = engine.plan.minimum_budget_bytes


def test_llava_trains_as_eagerly_below_the_weights_and_at_the_smallest_budget():
    model = llava()
    assert_parity(model, [batch(seed=i) for i in range(STEPS)])


@pytest.mark.slow    # LLaVA's parity at every budget stays in the default tier
def test_a_row_without_an_image_trains_as_eagerly():
    """pixel_values hold one image per image in the batch, not per row: a text-only row beside one
    with an image."""
    assert_parity(llava(), [batch(seed=i, images=(True, False)) for i in range(STEPS)], smallest_only=True)


def test_frozen_vision_tower_trains_projector_and_language_model_as_eagerly():
    model = llava()
    tower = {n for n, p in model.named_parameters() if n.startswith("model.vision_tower.")}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in tower)
    assert_parity(model, [batch(seed=i) for i in range(STEPS)], smallest_only=True)


def test_image_token_count_mismatch_is_refused_before_anything_runs():
    model = llava()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    good = batch()
    ids = good["input_ids"]
    extra = ids.clone()
    extra[0, (ids[0] != IMAGE_TOKEN).nonzero()[0]] = IMAGE_TOKEN      # one image token too many
    missing = batch(images=(True, False))                               # one image, tokens for none
    missing["input_ids"] = missing["input_ids"].masked_fill(missing["input_ids"] == IMAGE_TOKEN, 5)
    for bad, found in ((dict(good, input_ids=extra), 2 * PATCHES + 1), (missing, 0)):
        with pytest.raises(megacompile.InputMismatchError,
                           match=rf"input_ids hold {found} image tokens \(id {IMAGE_TOKEN}\), but the step's "
                                 rf"pixel_values give {bad['pixel_values'].shape[0] * PATCHES} image features"):
            engine.step(**bad)
        assert engine.steps_done == 0 and engine.micro_batches == 0
        for n, t in engine.state_dict().items():
            assert torch.equal(t, before[n]), n
    assert engine.step(**good) == pytest.approx(llava()(**good).loss.item(), rel=1e-5)   # nothing was left half done
    with pytest.raises(megacompile.InputMismatchError, match="image tokens"):
        engine(**dict(good, input_ids=extra))                           # the forward checks it too


def test_the_position_limit_is_the_text_models():
    """LLaVA's only learned position table is its vision tower's (16 patches and a class token):
    no limit on the tokens, which the Llama side places by rotary positions."""
    limits = InputLimits(llava())
    assert limits.vocab == 128 and limits.max_seq is None
    assert SEQ > 17


def test_the_blocks_are_the_language_models_even_under_a_larger_vision_tower():
    """The stack beside the token embedding is the one streamed; a larger vision tower's layers
    run inline in the prologue, and the step is still the eager one."""
    model = llava(tower_width=128)
    tower = sum(p.numel() for p in model.model.vision_tower.encoder.layers.parameters())
    assert tower > sum(p.numel() for p in model.model.language_model.layers.parameters())
    assert find_block_stack(model).path == "model.language_model.layers"
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    assert engine.step(**batch()) == pytest.approx(model(**batch()).loss.item(), rel=1e-5)


def test_other_families_are_refused_with_images_and_train_on_text():
    """A vision-language family not held to parity with images yet is refused with them, by name;
    without pixel_values it is a decoder like any other."""
    model = vipllava()
    with pytest.raises(CaptureError, match=r"VipLlavaModel \('model'\) merges image features in a way megacompile "
                                           r"does not train yet"):
        megacompile.compile(clone(model), hbm_budget=1.0, device="cpu").step(**batch())
    text = batch()
    del text["pixel_values"]
    text["input_ids"] = text["input_ids"].masked_fill(text["input_ids"] == IMAGE_TOKEN, 5)
    for m in (model, llava()):
        engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
        assert engine.step(**text) == pytest.approx(m(**text).loss.item(), rel=1e-5)


def test_planning_a_vision_language_model_without_images_plans_its_text_path():
    """Without images_per_row plan() makes token batches: the model, or its config alone, plans
    without images (planning with them: tests/e2e/test_vlm_planning.py)."""
    with torch.device("meta"):
        model = llava()
    for planned in (model, model.config):
        plan = megacompile.plan(planned, batch=2, seq=SEQ, hbm_budget=1.0)
        assert plan.captured.block_path == "model.language_model.layers" and not plan.captured.image_tokens
