"""Qwen2.5-VL: image grids as constants of the capture, 3D positions computed before the step.

Its parity with eager torch.optim.AdamW on rows of 0, 1 and 2 images is in test_vlm_families.py;
here: a batch with other grids is captured anew and trains as eagerly (or, with retrace=False, is
refused), a capture never runs on grids other than its own, the 3D positions are the model's, and
what it cannot place (token types that disagree with the grids, videos without their tokens) is
refused before anything runs; videos: test_vlm_videos.py.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from tests.e2e.harness import clone
from tests.e2e.test_vlm import eager
from tests.vlm_families import IMAGE_TOKEN, QWEN_GRIDS, qwen2_5_vl, qwen_batch

MIXED = (0, 1, 2)
OTHER_GRIDS = ((1, 4, 4), (1, 4, 2))    # the second image size turned: the same shapes, other grids


def test_a_batch_with_other_grids_is_captured_anew_and_trains_as_eagerly(monkeypatch):
    """A second batch whose inputs have the first's shapes but other grids (an image of 2 x 4
    patches turned 4 x 2): a capture of its own, and both steps are the eager ones; the device peak
    is the predicted one. A later capture logs again only the blocks called otherwise than before
    (capture.top.blocks_logged_before): none for the turned image, whose windows are the same; the
    tower's, not the language model's, for a third batch of other image sizes."""
    import megacompile.capture.top as top
    batches = [qwen_batch(seed=0, images=MIXED), qwen_batch(seed=1, images=MIXED, grids=OTHER_GRIDS),
               qwen_batch(seed=2, images=MIXED, grids=((1, 4, 4),))]
    assert {k: v.shape for k, v in batches[0].items()} == {k: v.shape for k, v in batches[1].items()}
    assert not torch.equal(batches[0]["image_grid_thw"], batches[1]["image_grid_thw"])
    model = qwen2_5_vl()
    losses = eager(clone(model), batches)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    logged, record = [], top.record
    monkeypatch.setattr(top, "record", lambda block, *a, **k: logged.append(block) or record(block, *a, **k))
    tower, text = list(engine.model.model.visual.blocks), list(engine.model.model.language_model.layers)
    for inputs, loss, relogged in zip(batches, losses, (tower + text, [], tower)):
        logged.clear()
        assert engine.step(**inputs) == pytest.approx(loss, rel=1e-5, abs=0)
        assert [g.values for g in engine.plan.captured.grids] == [tuple(map(tuple, inputs["image_grid_thw"].tolist()))]
        assert engine.memory_stats()["device_peak_bytes"] == engine.plan.predicted_peak_bytes
        assert logged == relogged


def test_windows_of_uneven_lengths_train_as_eagerly_with_one_attention_call_per_length():
    """Windows of 16 x 16 pixels over images of 24 x 40 and 16 x 16 (windows of 16, 8 and 4
    patches, lengths that lie apart): the capture's windowed tower layer calls attention once per
    window length (capture/vision_chunks.py), its full-attention layer once per image size, and two
    steps are the eager ones."""
    grids = ((1, 6, 10), (1, 4, 4), (1, 6, 10))
    batches = [qwen_batch(seed=s, images=(1, 1, 1), grids=grids) for s in (0, 1)]
    model = qwen2_5_vl(window=16)
    losses = eager(clone(model), batches)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    for inputs, loss in zip(batches, losses):
        assert engine.step(**inputs) == pytest.approx(loss, rel=1e-5, abs=0)
    stages = {s.name: s for s in engine.plan.captured.stages}

    def attention_calls(stage) -> int:
        return sum("scaled_dot_product" in str(n.target) for n in stage.template.forward.body)
    assert [stages["block.0"].origin, stages["block.1"].origin] == ["model.visual.blocks.0", "model.visual.blocks.1"]
    assert attention_calls(stages["block.0"]) == 3        # 13 windows of 16, 8 and 4 patches
    assert attention_calls(stages["block.1"]) == 2        # 3 images of 60 and 16 patches


def test_grids_that_keep_changing_warn_with_the_fix_for_images(monkeypatch):
    """A retrace's warning names images when the inputs carry grids: resize them to a few sizes."""
    import warnings

    from megacompile.errors import RetraceWarning
    from megacompile.planner import cache
    monkeypatch.setattr(cache, "FIRST_WARNING", 2)
    engine = megacompile.compile(qwen2_5_vl(), hbm_budget=1.0, device="cpu")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for inputs in (qwen_batch(seed=0, images=MIXED), qwen_batch(seed=1, images=MIXED, grids=OTHER_GRIDS)):
                engine.step(**inputs)
    finally:
        engine.close()
    (said,) = [str(w.message) for w in caught if issubclass(w.category, RetraceWarning)]
    assert "image_grid_thw [(1, 4, 4), (1, 4, 2)" in said and "resize the images beforehand to a few sizes" in said


def test_other_grids_are_refused_without_retrace_and_a_capture_checks_its_own():
    """At the smallest budget (the device peak the predicted one), with retrace=False."""
    model = qwen2_5_vl()
    first, swapped = qwen_batch(images=MIXED), qwen_batch(seed=1, images=MIXED, grids=OTHER_GRIDS)
    smallest = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu").prepare(**first).minimum_budget_bytes
    engine = megacompile.compile(clone(model), hbm_budget=smallest / 2 ** 30, device="cpu", retrace=False)
    assert engine.step(**first) == pytest.approx(model(**first).loss.item(), rel=1e-5)
    assert engine.memory_stats()["device_peak_bytes"] == engine.plan.predicted_peak_bytes
    with pytest.raises(megacompile.InputMismatchError,
                       match=r"image_grid_thw \[\(1, 4, 4\), \(1, 4, 2\), \(1, 4, 4\)\], but the plan was built for "
                             r".*image_grid_thw \[\(1, 4, 4\), \(1, 2, 4\), \(1, 4, 4\)\]"):
        engine.step(**swapped)
    assert engine.steps_done == 1
    # the capture's own guard, whatever found it: its grids or nothing
    inputs = engine._inputs((), {**swapped, "position_ids": torch.zeros(3, 3, 48, dtype=torch.long)})
    with pytest.raises(megacompile.InputMismatchError,
                       match=r"image_grid_thw is \[\(1, 4, 4\), \(1, 4, 2\), \(1, 4, 4\)\], but this capture of "
                             r"Qwen2_5_VLModel at 'model' was made for \[\(1, 4, 4\), \(1, 2, 4\), \(1, 4, 4\)\]"):
        engine.plan.captured.check_inputs(inputs)


def test_the_forward_places_tokens_at_the_models_3d_positions():
    """The logits depend on the 3D positions (without mm_token_type_ids the model falls back to 1D
    ones), and megacompile's forward gives eager's, positions computed before it runs."""
    m, b = qwen2_5_vl(), qwen_batch(images=MIXED)
    inference = {k: v for k, v in b.items() if k != "labels"}
    one_d = {k: v for k, v in inference.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        three_d, flat = m(**inference).logits, m(**one_d).logits
    scale = three_d.abs().max()
    assert (three_d - flat).abs().max() > 1e-3 * scale
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    assert (engine(**inference).logits - three_d).abs().max() <= 1e-5 * scale
    assert (engine(**one_d).logits - flat).abs().max() <= 1e-5 * scale


def test_token_types_or_image_tokens_that_disagree_with_the_grids_are_refused():
    """mm_token_type_ids marking one more image than image_grid_thw lists: eager cannot place its
    positions; image tokens short of the grids' features: eager cannot merge them. Both are refused
    before anything runs, and the good batch then trains as eagerly."""
    m = qwen2_5_vl()
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    good = qwen_batch(images=MIXED)
    extra = dict(good, mm_token_type_ids=good["mm_token_type_ids"].clone())
    extra["mm_token_type_ids"][0, 0] = 1                               # a text token marked as an image
    short = dict(good, input_ids=good["input_ids"].clone())
    short["input_ids"][1][short["input_ids"][1] == IMAGE_TOKEN] = 5    # row 1's image loses its tokens
    for bad, message in ((extra, r"cannot place its 3D positions"),
                         (short, r"input_ids hold 6 image tokens \(id 127\), but the step's pixel_values give 10")):
        with pytest.raises(Exception):
            m(**bad)
        with pytest.raises(megacompile.InputMismatchError, match=message):
            engine.step(**bad)
        assert engine.steps_done == 0
    assert engine.step(**good) == pytest.approx(m(**good).loss.item(), rel=1e-5)


def test_videos_without_their_tokens_are_refused():
    """Videos train (test_vlm_videos.py), placed by their own tokens: pixel_values_videos whose video
    tokens input_ids lack are refused before anything runs."""
    b = qwen_batch(images=MIXED)
    videos = dict(b, pixel_values_videos=b["pixel_values"], video_grid_thw=b["image_grid_thw"])
    engine = megacompile.compile(qwen2_5_vl(), hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.InputMismatchError, match=r"input_ids hold 0 video tokens \(id 123\), but the "
                                                             r"step's pixel_values_videos give 10 video features"):
        engine.step(**videos)
    assert engine.steps_done == 0


def test_a_prepared_capture_is_taken_for_its_grids_alone():
    """A capture made before the engine (engine/prepared.py, a run that plans before it trains) is
    taken for a call with its shapes and grids, and not for the same shapes with other grids."""
    from megacompile.capture.rope_positions import with_rope_positions
    from megacompile.engine import prepare
    from megacompile.engine.prepared import signature
    from megacompile.settings import Settings
    m = qwen2_5_vl()
    first, swapped = (with_rope_positions(m, (), qwen_batch(seed=i, images=MIXED, grids=grids))
                      for i, grids in enumerate((QWEN_GRIDS, OTHER_GRIDS)))
    prepared = prepare(m, first, Settings(hbm_budget=1.0, compute_dtype=torch.float32, device="cpu"), clip=True)
    cpu = torch.device("cpu")
    assert prepared.captures(m, signature(m, (), first, True), cpu, torch.float32, None)
    assert not prepared.captures(m, signature(m, (), swapped, True), cpu, torch.float32, None)
    assert [g.values for g in prepared.captured.grids] == [g.values for g in prepared.plan.captured.grids]


@pytest.mark.slow   # a Qwen2.5-VL captured and planned from its own batch: ~10 s on 2 cores
def test_plan_takes_a_qwen_vl_batch():
    """plan() (and minimum_budget(), which plans the same capture) take a Qwen2.5-VL's own batch:
    its 3D positions are computed from the grids' values before the capture, as a step computes
    them, and the grids are the capture's constants."""
    m, batch = qwen2_5_vl(), qwen_batch(seed=0, images=MIXED)
    plan = megacompile.plan(m, 1.0, inputs=batch, hardware="cpu", compute_dtype=torch.float32)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert [g.values for g in plan.captured.grids] == [tuple(map(tuple, batch["image_grid_thw"].tolist()))]
