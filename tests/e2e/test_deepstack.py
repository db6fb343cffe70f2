"""Qwen3-VL's deepstack: the mergers after some tower layers and the features they add after the
first decoder layers are folded into those layers' blocks (capture/deepstack.py).

Its parity with eager torch.optim.AdamW on rows of 0, 1 and 2 images (at twice the weights and at
the smallest budget, and with the tower frozen) is in test_vlm_families.py; here: the stages and
templates the fold gives, the interleaved 3D rotary tables its text model writes in place, the
MoE variant at parity, and planning its images from a config.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.capture import capture
from megacompile.capture.rope_positions import with_rope_positions
from tests.e2e.harness import clone
from tests.e2e.test_vlm import assert_parity
from tests.e2e.test_vlm_planning import CPU, measured_peak
from tests.vlm_families import (END_OF_IMAGE, IMAGE_TOKEN, SEQ, VIDEO_TOKEN, VISION_START, qwen3_5_vl, qwen3_vl,
                                qwen_batch)

MIXED = (0, 1, 2)


def test_each_merger_runs_in_its_tower_block_and_each_feature_is_added_in_its_decoder_block():
    model = qwen3_vl()
    inputs = with_rope_positions(model, (), qwen_batch(images=MIXED))
    captured = capture(model, (), inputs, device=torch.device("cpu"), compute_dtype=torch.float32)
    stages = {s.name: s for s in captured.stages}
    assert [(s.name, s.origin) for s in captured.stages if s.name.startswith("block.")] == [
        ("block.0", "model.visual.blocks.0"), ("block.1", "model.visual.blocks.1"),
        ("block.2", "model.language_model.layers.0"), ("block.3", "model.language_model.layers.1"),
        ("block.4", "model.language_model.layers.2")]
    assert list(stages)[3] == "bridge" and captured.towers == ("model.visual.blocks",)   # the mergers are no stack
    # each merger's parameters belong to the tower block it follows, and to no other stage
    for k in (0, 1):
        merger = {n for n in stages[f"block.{k}"].params if n.startswith("model.visual.deepstack_merger_list.")}
        assert merger == {n for n, _ in model.named_parameters()
                          if n.startswith(f"model.visual.deepstack_merger_list.{k}.")}
        assert len(stages[f"block.{k}"].template.outputs) == 2          # the hidden states, the merger's features
    assert not any(n.startswith("model.visual.deepstack_merger_list.") for s in captured.stages
                   if s.origin != "model.visual.blocks.0" and s.origin != "model.visual.blocks.1" for n in s.params)
    # the two tower blocks share a template, as do the two decoder blocks that add features; the third does not
    assert stages["block.0"].template is stages["block.1"].template
    assert stages["block.2"].template is stages["block.3"].template is not stages["block.4"].template
    assert "the work folded into it" in captured.template_notes["block.4"]
    # decoder blocks 0 and 1 read the image-token mask from the bridge, and their features from it
    # (split per image and joined there, transformers 5.24) or from the tower block whose merger
    # made them (handed on whole, 5.17)
    bridge = list(stages).index("bridge")
    for k, b in enumerate(("block.2", "block.3")):
        extra = stages[b].inputs[-2:]
        assert extra[0].stage == bridge and extra[1].stage in (bridge, list(stages).index(f"block.{k}"))
        assert [stages[b].template.acts[-k].requires_grad for k in (2, 1)] == [False, True]
    assert len(stages["block.4"].inputs) == len(stages["block.2"].inputs) - 2


def test_interleaved_rotary_tables_written_in_place_train_as_eagerly():
    """Qwen3-VL's text rotary interleaves its three position sections by writing into a slice of a
    view that nothing reads afterwards: those writes belong to the prologue. With the 3D positions
    of a batch with images, but no image, the step is eager's to the first gradients."""
    model = qwen3_vl()
    batches = []
    for seed in range(3):
        b = with_rope_positions(model, (), qwen_batch(seed=seed, images=MIXED))
        batches.append({"input_ids": b["input_ids"].masked_fill(b["input_ids"] == IMAGE_TOKEN, 5),
                        "labels": b["labels"], "position_ids": b["position_ids"]})
    assert any(not torch.equal(b["position_ids"][0], b["position_ids"][1]) for b in batches)
    assert_parity(model, batches, weights=2.0, then_smallest=False)


@pytest.mark.long    # 20-25 s
def test_qwen3_vl_moe_trains_with_images_as_eagerly():
    assert_parity(qwen3_vl(moe=True), [qwen_batch(seed=i, images=MIXED) for i in range(3)], weights=2.0)


def plans_images_as_measured(model, family: str, seed: int):
    """A config of `model` planned with one 64 px image a row (16-pixel patches: 4 x 4 patches, 4
    image tokens after the merge): the family's inputs, the planned peak the one measured on a batch
    of that layout, and a step of it eager's loss."""
    rows, side, tokens = 2, 4, 4
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VIDEO_TOKEN, (rows, SEQ), generator=g)
    start = 3 + 2 * seed          # the image somewhere else in each test
    ids[:, start], ids[:, start + 1:start + 1 + tokens], ids[:, start + 1 + tokens] = VISION_START, IMAGE_TOKEN, \
        END_OF_IMAGE
    batch = {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
             "pixel_values": torch.randn(rows * side * side, 3 * 2 * 16 * 16, generator=g),
             "mm_token_type_ids": (ids == IMAGE_TOKEN).int(), "image_grid_thw": torch.tensor([[1, side, side]] * rows)}
    plan = megacompile.plan(model.config.to_dict(), hbm_budget=1.0, batch=rows, seq=SEQ, images_per_row=1,
                            image_size=64, **CPU)
    assert plan.vision.images.family == family and plan.vision.images.tokens_per_image == tokens
    assert plan.captured.grids[0].values == ((1, side, side),) * rows
    assert measured_peak(clone(model), batch, 1.0) == plan.predicted_peak_bytes
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    assert engine.step(**batch) == pytest.approx(model(**batch).loss.item(), rel=1e-5, abs=0)


def test_qwen3_vl_plans_its_images_from_a_config_and_measures_the_planned_peak():
    plans_images_as_measured(qwen3_vl(patch=16), "qwen3_vl", seed=0)


@pytest.mark.slow     # Qwen3-VL's above is the default tier's
def test_qwen3_5_plans_its_images_from_a_config_and_measures_the_planned_peak():
    """Qwen3.5: Qwen3-VL's tower without deepstack and its inputs, before the hybrid decoder."""
    plans_images_as_measured(qwen3_5_vl(patch=16), "qwen3_5", seed=1)


def test_planning_logs_one_block_of_each_kind_of_folded_work(monkeypatch):
    """Planning traces one block of each group its modules tell apart and gives the others its
    fingerprint (capture/top.py). In Qwen3-VL's decoder the first layers add features and the
    rest do not: the first plain layer is logged once for the plain ones, which then share its
    fingerprint and template."""
    import megacompile.capture.top as top
    model = qwen3_vl(layers=6, patch=16)
    logged = []
    record = top.record

    def counted(block, *args, **kwargs):
        logged.append(block)
        return record(block, *args, **kwargs)
    monkeypatch.setattr(top, "record", counted)
    args = dict(hbm_budget=1.0, batch=2, seq=SEQ, images_per_row=1, image_size=64, **CPU)
    plan = megacompile.plan(model.config.to_dict(), **args)
    # (the plan's own model, on the meta device) the two layers that add features, the first plain
    # one, the last (sampled); and the two tower layers, each with a merger
    decoder = sorted(b.self_attn.layer_idx for b in logged if hasattr(b, "self_attn"))
    assert decoder == [0, 1, 2, 5] and len(logged) == len(decoder) + 2
    templates = [s.template for s in plan.captured.stages if s.origin.startswith("model.language_model.layers.")]
    assert templates[0] is templates[1] and all(t is templates[2] for t in templates[3:])
    assert templates[2] is not templates[0] and len(templates[0].acts) == len(templates[2].acts) + 2
