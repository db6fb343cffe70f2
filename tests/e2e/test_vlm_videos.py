"""Qwen2.5-VL and Qwen3-VL train with videos through megacompile as eagerly.

The video inputs are built by hand as the models' processors lay them out (so this needs no
torchvision, which transformers' video processors need): `pixel_values_videos` holds every video's patches,
flattened in the processor's order (`patchify`), one row of 3 channels x 2 frames x 4 x 4 pixels
per patch; `video_grid_thw` gives each video's (frames / 2, rows, columns) of patches; each video
fills frames / 2 * rows * columns / 4 video tokens. Qwen2.5-VL's processor writes them in one run
between a vision-start and a vision-end token, and `second_per_grid_ts` (2 / fps) scales their
temporal positions; Qwen3-VL's writes each frame pair's tokens between a vision-start and a
vision-end token of their own, after its timestamp in text (`<0.5 seconds>`, a few text tokens
here), the whole inside an outer vision-start and vision-end. mm_token_type_ids mark image (1) and
video (2) tokens.

The video grids are constants of the capture as the image grids are (capture/grid_constants.py),
the video tokens are counted against the video features every step (capture/image_tokens.py), the
3D positions with videos are computed before the step (capture/rope_positions.py), and a step with
images and videos runs the tower once over both (capture/grid_media.py).
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import (assert_first_gradients, float64_noise, moment_error, rounding_floor,
                                         weight_bytes, weight_errors)
from megacompile.errors import InputMismatchError
from tests.e2e.harness import assert_same_weights, clone
from tests.e2e.test_vlm import GiB, STEPS, eager, first_gradients, through_megacompile
from tests.vlm_families import (END_OF_IMAGE, IMAGE_TOKEN, SEQ, VIDEO_TOKEN, VISION_START, qwen2_5_vl,
                                qwen3_5_vl, qwen3_vl)

PATCH, MERGE, TEMPORAL = 4, 2, 2     # the tiny towers' patch size, spatial merge and temporal patch size
FRAMES = 4                           # a clip of 4 frames: 2 frame pairs, each one temporal patch
TIMESTAMP = 3                        # text tokens of one Qwen3-VL timestamp ("<0.5 seconds>")
MODELS = {"qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "qwen3_5": qwen3_5_vl}

# Rows of a micro-batch: ("image", (H, W)) or ("video", (H, W), fps), in the row's order.
# Row 0 holds an image and a video (Qwen3-VL's the video first: its features join in token order),
# row 1 a video of another size, row 2 text alone.
MIXED = {"qwen2_5_vl": [[("image", (16, 16)), ("video", (16, 16), 3.0)], [("video", (8, 16), 2.0)], []],
         "qwen3_vl": [[("video", (16, 16), 2.0), ("image", (16, 16))], [("video", (8, 16), 4.0)], []]}
MIXED["qwen3_5"] = MIXED["qwen3_vl"]     # Qwen3.5 takes Qwen3-VL's inputs
VIDEOS = [[("video", (16, 16), 4.0)], [("video", (16, 8), 2.0)]]


def patchify(frames: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[frames, 3, H, W] -> [patches, 3 * 2 * 4 * 4] and the grid, as Qwen2VLVideoProcessor.patchify:
    patches by frame pair, then by 2 x 2 merge block, row-major within each."""
    t, c, h, w = frames.shape
    gt, gh, gw = t // TEMPORAL, h // PATCH, w // PATCH
    x = frames.reshape(gt, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * TEMPORAL * PATCH * PATCH), (gt, gh, gw)


def media_tokens(family: str, kind: str, grid: tuple[int, int, int], g: torch.Generator) -> list[int]:
    t, h, w = grid
    if kind == "image":
        return [VISION_START] + [IMAGE_TOKEN] * (h * w // MERGE ** 2) + [END_OF_IMAGE]
    if family == "qwen2_5_vl":
        return [VISION_START] + [VIDEO_TOKEN] * (t * h * w // MERGE ** 2) + [END_OF_IMAGE]
    tokens = [VISION_START]
    for _ in range(t):      # Qwen3VLProcessor.replace_video_token: "<t seconds>" and the frame pair's tokens
        tokens += torch.randint(2, VIDEO_TOKEN, (TIMESTAMP,), generator=g).tolist()
        tokens += [VISION_START] + [VIDEO_TOKEN] * (h * w // MERGE ** 2) + [END_OF_IMAGE]
    return tokens + [END_OF_IMAGE]


def video_batch(family: str, rows: list, seed: int = 0) -> dict[str, torch.Tensor]:
    """One row per entry of `rows`, random text around the media at places that move with the
    seed; labels ignore the image and video tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VIDEO_TOKEN, (len(rows), SEQ), generator=g)
    pixels = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    seconds = []
    for r, media in enumerate(rows):
        spans = []
        for kind, (height, width), *fps in media:
            # a still image is its frame repeated over a temporal patch, as Qwen2VLImageProcessor writes it
            frames = (torch.randn(1, 3, height, width, generator=g).expand(TEMPORAL, -1, -1, -1) if kind == "image"
                      else torch.randn(FRAMES, 3, height, width, generator=g))
            patches, grid = patchify(frames)
            pixels[kind].append(patches)
            grids[kind].append(grid)
            if kind == "video":
                seconds.append(TEMPORAL / fps[0])
            spans.append(media_tokens(family, kind, grid, g))
        room = SEQ - 1 - sum(map(len, spans))
        gaps = torch.randint(0, room // max(len(spans), 1) + 1, (len(spans),), generator=g).tolist()
        pos = 1
        for gap, span in zip(gaps, spans):
            pos += gap
            ids[r, pos:pos + len(span)] = torch.tensor(span)
            pos += len(span)
        assert pos <= SEQ
    images, videos = ids == IMAGE_TOKEN, ids == VIDEO_TOKEN
    out = {"input_ids": ids, "labels": ids.masked_fill(images | videos, -100),
           "mm_token_type_ids": images.int() + 2 * videos.int()}
    if pixels["image"]:
        out["pixel_values"], out["image_grid_thw"] = torch.cat(pixels["image"]), torch.tensor(grids["image"])
    if pixels["video"]:
        out["pixel_values_videos"], out["video_grid_thw"] = torch.cat(pixels["video"]), torch.tensor(grids["video"])
        if family == "qwen2_5_vl":
            out["second_per_grid_ts"] = torch.tensor(seconds)
    return out


def assert_parity(model, batches, budgets: str = "both") -> None:
    """3 steps through megacompile against eager torch.optim.AdamW in float32: losses and first-step
    gradients (AdamW's first moment) to 1e-5 or their rounding floor, weights to the float64 noise floor; at twice the
    weights' bytes and (budgets "both") at the smallest budget the planner gives for these inputs."""
    reference, eager_moments = clone(model), {}
    losses = eager(reference, batches, eager_moments)

    def in_float64(exact):
        eager(exact, [{k: (v.double() if v.is_floating_point() else v) for k, v in b.items()} for b in batches])
    noise = float64_noise(in_float64, model, reference)
    floor = rounding_floor(lambda m: first_gradients(m, batches[0]), model)
    sizes = [2.0 * weight_bytes(model)]
    if budgets == "both":   # the batches share their shapes and grids: one capture, one smallest budget
        sizes.append(megacompile.minimum_budget(clone(model), compute_dtype=torch.float32, hardware="cpu",
                                                inputs=batches[0]) * GiB)
    for budget in sizes:
        moments = {}
        engine, ours, peaks = through_megacompile(clone(model), batches, budget, moments)
        loss_diff = max(abs(a - b) for a, b in zip(ours, losses))
        weights = max(weight_errors(engine, reference).values())
        print(f"\n{type(model).__name__} at {budget / 2 ** 20:.2f} MiB: loss diff {loss_diff:.3g}, moment error "
              f"{moment_error(moments, eager_moments):.3g}, weight error {weights:.3g} (float64 noise {noise:.3g})")
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
        assert_first_gradients(moments, eager_moments, floor)
        assert_same_weights(engine, reference, noise=noise)
        assert max(peaks) <= budget
        assert engine.plan.captured.block_path == "model.language_model.layers"
        stats = engine.memory_stats()       # the last step's device tensors all from the planned arena
        assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
        assert stats["device_peak_bytes"] <= stats["device_arena_bytes"] <= budget


@pytest.mark.long    # 50-140 s a family on 2 cores; the default tier trains videos alone and checks each family's forward
@pytest.mark.parametrize("family", sorted(MODELS))
def test_a_micro_batch_of_images_videos_and_text_trains_as_eagerly_at_two_budgets(family):
    """Rows holding an image and a video, a video, and text alone, at twice the weights' bytes and
    at the smallest budget. (Seeds 1 to 3: with seed 0 one embedding entry of Qwen2.5-VL's gets a
    second-step gradient of 1e-8, a cancellation at AdamW's eps, in float32 eagerly, in float64 and
    here alike, which AdamW turns into a step of a tenth of lr that differs between any two float32
    runs; the float64 floor of that batch is smaller than that.)"""
    assert_parity(MODELS[family](), [video_batch(family, MIXED[family], seed=1 + i) for i in range(STEPS)])


def test_videos_alone_train_as_eagerly():
    """Qwen3-VL given videos and no images: the model's own video path, its deepstack features added
    to the video tokens; at twice the weights' bytes (both budgets: `-m slow`, above)."""
    assert_parity(qwen3_vl(), [video_batch("qwen3_vl", VIDEOS, seed=i) for i in range(STEPS)], budgets="twice")


@pytest.mark.parametrize("family", sorted(MODELS))
def test_the_forward_with_images_and_videos_gives_eagers_logits(family):
    """One tower run over a step's images and videos, each kind placed at its tokens (Qwen3-VL's
    deepstack features in token order): the logits are eager's."""
    m, b = MODELS[family](), video_batch(family, MIXED[family])
    inference = {k: v for k, v in b.items() if k != "labels"}
    with torch.no_grad():
        expected = m(**inference).logits
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    assert (engine(**inference).logits - expected).abs().max() <= 1e-5 * expected.abs().max()
    assert [g.name for g in engine.plan.captured.grids] == ["image_grid_thw", "video_grid_thw"]
    assert [(t.media, t.count) for t in engine.plan.captured.image_tokens] == [("image", 4), ("video", 12)]


@pytest.mark.parametrize("family", [f if f == "qwen2_5_vl" else pytest.param(f, marks=pytest.mark.slow)
                                    for f in sorted(MODELS)])
def test_video_tokens_that_do_not_match_the_video_features_are_refused_before_anything_runs(family):
    """A video token short, or one too many, in input_ids: eager transformers refuses both; here each
    is an InputMismatchError naming both counts, before anything runs, the weights untouched."""
    m, good = MODELS[family](), video_batch(family, MIXED[family])
    before = {n: t.clone() for n, t in m.state_dict().items()}
    engine = megacompile.compile(m, hbm_budget=1.0, device="cpu")
    ids = good["input_ids"]
    short, extra = ids.clone(), ids.clone()
    short[1, (ids[1] == VIDEO_TOKEN).nonzero()[0]] = 5                 # row 1's video one token short
    extra[2, 0] = VIDEO_TOKEN                                           # a text token turned video token
    for bad, found in ((short, 11), (extra, 13)):
        with pytest.raises(Exception):
            MODELS[family]()(**dict(good, input_ids=bad))
        with pytest.raises(InputMismatchError,
                           match=rf"input_ids hold {found} video tokens \(id {VIDEO_TOKEN}\), but the step's "
                                 r"pixel_values_videos give 12 video features, one per video token"):
            engine.step(**dict(good, input_ids=bad))
        assert engine.steps_done == 0 and engine.micro_batches == 0
        for n, t in engine.state_dict().items():
            assert torch.equal(t, before[n]), n
    assert engine.step(**good) == pytest.approx(MODELS[family]()(**good).loss.item(), rel=1e-5)


def test_pixel_values_videos_of_another_shape_or_without_grids_are_refused():
    """Patches of one frame rather than a frame pair (48 values, not 96), patches short of the grids'
    count, and videos without their grids: each refused naming what the tower takes, before the
    tower runs (not as a failure to trace)."""
    good = video_batch("qwen2_5_vl", VIDEOS)
    pixels = good["pixel_values_videos"]
    engine = megacompile.compile(qwen2_5_vl(), hbm_budget=1.0, device="cpu")
    grids = r"the video_grid_thw \[\(2, 4, 4\), \(2, 4, 2\)\]"
    for bad, shape in ((pixels[:, :48], r"\[48, 48\]"), (pixels[:-8], r"\[40, 96\]")):
        with pytest.raises(InputMismatchError,
                           match=rf"pixel_values_videos of shape {shape} given to Qwen2_5_VLModel \('model'\), whose "
                                 rf"vision tower takes \[48, 96\] for {grids} \(3 channels x 2 frames x 4 x 4 "
                                 r"pixels a patch"):
            engine.step(**dict(good, pixel_values_videos=bad))
    no_grids = {k: v for k, v in good.items() if k not in ("video_grid_thw", "mm_token_type_ids")}
    with pytest.raises(megacompile.CaptureError, match=r"Qwen2_5_VLModel \('model'\) was given pixel_values_videos, "
                                                       r"and its video_grid_thw is not one of the model's inputs"):
        engine.step(**no_grids)
    assert engine.steps_done == 0


def other_video_grids() -> tuple[dict, dict]:
    """Two batches of the same shapes whose second video is 4 x 2 patches, then 2 x 4."""
    first = video_batch("qwen2_5_vl", VIDEOS)
    turned = video_batch("qwen2_5_vl", [VIDEOS[0], [("video", (8, 16), 2.0)]], seed=1)
    assert {k: v.shape for k, v in first.items()} == {k: v.shape for k, v in turned.items()}
    return first, turned


@pytest.mark.slow    # 6 s: a capture a batch; the refusal below is in the default tier
def test_other_video_grids_are_captured_anew_and_train_as_eagerly():
    first, turned = other_video_grids()
    m = qwen2_5_vl()
    losses = eager(clone(m), [first, turned])
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    for inputs, loss in zip((first, turned), losses):
        assert engine.step(**inputs) == pytest.approx(loss, rel=1e-5, abs=0)
        assert [g.values for g in engine.plan.captured.grids] == [tuple(map(tuple, inputs["video_grid_thw"].tolist()))]


def test_other_video_grids_are_refused_without_retrace_and_a_capture_checks_its_own():
    """With retrace=False a batch whose video grids differ from the captured ones at the same shapes
    is refused naming both sets of grids, and a capture refuses grids other than its own whatever
    found it."""
    first, turned = other_video_grids()
    strict = megacompile.compile(qwen2_5_vl(), hbm_budget=1.0, device="cpu", retrace=False)
    strict.step(**first)
    with pytest.raises(InputMismatchError, match=r"video_grid_thw \[\(2, 4, 4\), \(2, 2, 4\)\], but the plan was "
                                                 r"built for .*video_grid_thw \[\(2, 4, 4\), \(2, 4, 2\)\]"):
        strict.step(**turned)
    assert strict.steps_done == 1
    inputs = strict._inputs((), {**turned, "position_ids": torch.zeros(3, 2, SEQ, dtype=torch.long)})
    with pytest.raises(InputMismatchError, match=r"video_grid_thw is \[\(2, 4, 4\), \(2, 2, 4\)\], but this "
                                                 r"capture of Qwen2_5_VLModel at 'model' was made for"):
        strict.plan.captured.check_inputs(inputs)


def test_a_videos_temporal_positions_scale_with_its_seconds_per_frame_pair():
    """Qwen2.5-VL spaces a video's frame pairs by second_per_grid_ts x tokens_per_second positions:
    the logits depend on it, and megacompile's forward gives eager's at each value (the positions
    are an input: one capture serves both)."""
    m, b = qwen2_5_vl(), video_batch("qwen2_5_vl", VIDEOS)
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    logits = []
    for seconds in (0.25, 2.0):
        inputs = {k: v for k, v in b.items() if k != "labels"} | {"second_per_grid_ts": torch.tensor([seconds] * 2)}
        with torch.no_grad():
            expected = m(**inputs).logits
        assert (engine(**inputs).logits - expected).abs().max() <= 1e-5 * expected.abs().max()
        logits.append(expected)
    # the two differ by 6e-4 of the largest logit; ours is within 1e-5 of eager's at each
    assert (logits[0] - logits[1]).abs().max() > 1e-4 * logits[0].abs().max()


def test_qwen3_vl_video_tokens_in_one_run_are_refused_as_eagerly():
    """Qwen3-VL places a video frame pair by frame pair, each run of tokens after its timestamp: a
    video's tokens in one run (Qwen2.5-VL's layout) cannot be placed, eagerly or here."""
    m, b = qwen3_vl(), video_batch("qwen2_5_vl", VIDEOS)
    b.pop("second_per_grid_ts")
    with pytest.raises(Exception):
        m(**b)
    engine = megacompile.compile(m, hbm_budget=1.0, device="cpu")
    with pytest.raises(InputMismatchError, match=r"Qwen3VLModel at 'model' cannot place its 3D positions .*"
                                                 r"Qwen3-VL: per frame pair"):
        engine.step(**b)
