"""Gemma 3, Idefics3 / SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 train with images through megacompile as
eagerly.

Gemma 3 scatters its pooled image features over the image tokens and attends bidirectionally
within each image (token_type_ids); Idefics3 and SmolVLM take pixel_values padded per row (an
all-zero image is padding), which capture encodes at static shapes (capture/padded_images.py);
Qwen2.5-VL's tower reads its images' grids, constants of the capture (capture/grid_constants.py),
and its 3D positions are computed before the step (capture/rope_positions.py; test_qwen_vl.py);
Qwen2-VL's (no windows), Qwen3-VL's and Qwen3.5's towers read them the same way. Each trains 3 steps
on batches whose rows hold 0, 1 and 2 images, against eager torch.optim.AdamW in float32: losses to 1e-5, first-step
gradients to 1e-5 or their rounding floor (acceptance/parity.py), weights to the noise floor, at twice the weights' bytes and at the smallest budget the plan reports (harness in
test_vlm.py): Qwen2.5-VL and Qwen3-VL in the default tier, the others in the slow one; with the
vision tower frozen, at twice the weights' bytes (`-m slow`).
"""
from __future__ import annotations

import inspect

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import rounding_floor
from megacompile.errors import CaptureError
from tests.e2e.harness import clone
from tests.e2e.test_vlm import STEPS, assert_parity, first_gradients
from tests.vlm_families import (FAMILIES, IDEFICS3_TOKENS, IMAGE_TOKEN, batch, idefics2, mllama, mllama_batch, model,
                                qwen3_5_vl)

BLOCKS = {"gemma3": "model.language_model.layers", "idefics3": "model.text_model.layers",
          "smolvlm": "model.text_model.layers", "qwen2_vl": "model.language_model.layers",
          "qwen2_5_vl": "model.language_model.layers",
          "qwen3_vl": "model.language_model.layers", "qwen3_5": "model.language_model.layers"}
TOWERS = {"gemma3": "model.vision_tower.", "idefics3": "model.vision_model.", "smolvlm": "model.vision_model.",
          "qwen2_vl": "model.visual.", "qwen2_5_vl": "model.visual.", "qwen3_vl": "model.visual.",
          "qwen3_5": "model.visual."}
MIXED = (0, 1, 2)     # images per row


@pytest.mark.parametrize("family", [f if f == "qwen2_5_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in FAMILIES])
def test_trains_with_0_1_and_2_images_per_row_as_eagerly(family):
    batches = [batch(family, seed=i, images=MIXED) for i in range(STEPS)]
    assert_parity(model(family), batches, weights=2.0, block_path=BLOCKS[family])


@pytest.mark.slow   # 15-40 s a family; LLaVA's frozen tower is in the default tier (test_vlm.py)
@pytest.mark.parametrize("family", FAMILIES)
def test_frozen_vision_tower_trains_the_rest_as_eagerly(family):
    m = model(family)
    frozen = [p for n, p in m.named_parameters() if n.startswith(TOWERS[family])]
    assert frozen
    for p in frozen:
        p.requires_grad_(False)
    assert_parity(m, [batch(family, seed=i, images=MIXED) for i in range(STEPS)], weights=2.0, then_smallest=False,
                  block_path=BLOCKS[family])


def test_gemma3_image_tokens_attend_both_ways():
    """token_type_ids make attention bidirectional within an image: the logits depend on them, and
    megacompile's forward gives eager's with them."""
    m, b = model("gemma3"), batch("gemma3", images=MIXED)
    causal = dict(b, token_type_ids=torch.zeros_like(b["token_type_ids"]))
    with torch.no_grad():
        both_ways, one_way = m(**b).logits, m(**causal).logits
    scale = both_ways.abs().max()
    assert (both_ways - one_way).abs().max() > 1e-3 * scale
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    assert (engine(**b).logits - both_ways).abs().max() <= 1e-5 * scale


def refused_eagerly(m, inputs) -> None:
    """Eager transformers refuses the inputs where it counts the image tokens against the features:
    the releases whose Idefics3 and SmolVLM forward takes precomputed features (5.24) do; 5.17's
    place what features they have over what image tokens there are, unchecked, SmolVLM's its one
    all-zero image's over none (megacompile refuses all of these, whatever the release)."""
    try:
        m(**inputs)
    except Exception:  # noqa: BLE001 - refused, as the test expects
        return
    assert "mm_encoder_outputs" not in inspect.signature(type(m.model).forward).parameters, \
        "eager transformers took image tokens that do not match the features"


@pytest.mark.parametrize("family", ["idefics3", "smolvlm"])
def test_image_tokens_that_do_not_match_the_real_images_are_refused(family):
    """The features a step's padded pixel_values give are counted from its images that are not
    all zeros: a padding image made real, or one image's tokens dropped, is refused before anything
    runs, as eager transformers refuses it (refused_eagerly)."""
    m = model(family)
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    good = batch(family, images=MIXED)
    extra = dict(good, pixel_values=good["pixel_values"].clone())
    extra["pixel_values"][1, 1] = 1.0                                   # row 1's padding image is now an image
    dropped = dict(good, input_ids=good["input_ids"].clone())
    dropped["input_ids"][2][dropped["input_ids"][2] == IMAGE_TOKEN] = 5  # row 2's images lose their tokens
    for bad, tokens, images in ((extra, 3, 4), (dropped, 1, 3)):
        refused_eagerly(m, bad)
        with pytest.raises(megacompile.InputMismatchError,
                           match=rf"input_ids hold {tokens * IDEFICS3_TOKENS} image tokens \(id {IMAGE_TOKEN}\), "
                                 rf"but the step's pixel_values give {images * IDEFICS3_TOKENS} image features "
                                 rf"\({images} images encoded, {IDEFICS3_TOKENS} each"):
            engine.step(**bad)
        assert engine.steps_done == 0
    assert engine.step(**good) == pytest.approx(m(**good).loss.item(), rel=1e-5)


@pytest.mark.parametrize("family, message", [("idefics3", "hold only padding"),
                                             pytest.param("smolvlm", r"\(1 images encoded", marks=pytest.mark.slow)])
def test_a_batch_of_padding_images_alone_is_refused(family, message):
    """pixel_values holding no real image: eager Idefics3 cannot encode an empty batch of images
    and SmolVLM encodes one all-zero image that no image token takes; both are refused before
    anything runs, and the same rows train as text without pixel_values (the vision side frozen:
    a text step gives it no gradient, which the engine refuses for trained parameters)."""
    m, b = model(family), batch(family, images=(0, 0))
    for name, p in m.named_parameters():
        if "vision_model" in name or "connector" in name:
            p.requires_grad_(False)
    refused_eagerly(m, b)
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.InputMismatchError, match=message):
        engine.step(**b)
    assert engine.steps_done == 0
    text = {k: v for k, v in b.items() if not k.startswith("pixel_")}
    assert engine.step(**text) == pytest.approx(m(**text).loss.item(), rel=1e-5)


def test_idefics2_is_refused_with_images_before_its_encoder_reads_them():
    """Idefics2 pads its images as Idefics3 does but is not held to parity: refused by name, where
    eager transformers drops the padding images (a shape read from values)."""
    with pytest.raises(CaptureError, match=r"Idefics2Model \('model'\) merges image features in a way megacompile "
                                           r"does not train yet"):
        megacompile.compile(idefics2(), hbm_budget=1.0, device="cpu").step(**batch("idefics3", images=MIXED))


def test_cross_attention_models_are_refused_with_images_and_train_on_text():
    """Mllama's decoder reads the image features in its cross-attention layers: a gradient to
    several streamed blocks from one value, which the chain does not carry. Refused by name before
    its vision model runs, the weights untouched; without images it trains as a decoder."""
    m, b = mllama(), mllama_batch()
    m(**b)   # eager trains it
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    with pytest.raises(CaptureError, match=r"MllamaModel \('model'\) reads its image features in cross-attention "
                                           r"layers, which megacompile does not train yet"):
        engine.step(**b)
    assert engine.steps_done == 0
    text = {"input_ids": b["input_ids"].masked_fill(b["input_ids"] == IMAGE_TOKEN, 5), "labels": b["labels"]}
    assert engine.step(**text) == pytest.approx(m(**text).loss.item(), rel=1e-5, abs=0)


@pytest.mark.long   # 10-20 s
def test_qwen3_5_moe_trains_with_images_as_eagerly():
    """Qwen3.5-MoE: Qwen3.5's tower and merge before a hybrid decoder with routed experts."""
    batches = [batch("qwen3_5", seed=i, images=MIXED) for i in range(STEPS)]
    assert_parity(qwen3_5_vl(moe=True), batches, weights=4.0)


def test_the_decay_gradients_of_a_gated_delta_net_are_defined_only_to_their_rounding_floor():
    """Why the first-step gradients of Qwen3.5's gated delta-net are held to their rounding floor:
    in the tiny model with 0, 1 and 2 images a row, the gradient of layer 2's A_log sums terms that
    cancel to 1e-5 of the step's largest gradient, and rounding every weight by one float32 ulp moves
    eager float32's own gradient there by more than 1e-4 of its largest entry (1e-5 is FP32_RTOL);
    a well-conditioned tensor (a matmul weight) moves by far less than 1e-5."""
    m, b = qwen3_5_vl(), batch("qwen3_5", seed=0, images=MIXED)
    floor = rounding_floor(lambda x: first_gradients(x, b), m)
    assert floor["model.language_model.layers.2.linear_attn.A_log"] > 1e-4
    assert floor["model.language_model.layers.2.mlp.down_proj.weight"] < 1e-6