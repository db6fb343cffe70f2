"""Planning a vision-language model with images, from its config alone.

`megacompile.plan(config, ..., images_per_row=N, image_size=PX)` builds the model on the meta
device and a meta batch laid out as the family's processor writes it (planner/image_inputs.py),
and reports the vision tower's share of the predicted time and of the device peak
(planner/vision_share.py). The predicted peak is the one the same model, with weights, measures
when it steps on such a batch on the cpu backend.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import megacompile
from megacompile.acceptance.parity import weight_bytes
from megacompile.cli import main
from megacompile.errors import ArgumentError
from tests import vlm, vlm_families

GiB = 2 ** 30
CPU = dict(hardware="cpu", compute_dtype=torch.float32)


def measured_peak(model, inputs: dict, budget_gib: float) -> int:
    engine = megacompile.compile(model, hbm_budget=budget_gib, device="cpu")
    engine.step(**inputs)
    return engine.memory_stats()["device_peak_bytes"]


# gemma3's (about 30 s on 2 cores) with -m long; llava's and Qwen2.5-VL's below stand for it
# 18 s; Qwen2.5-VL's planned peak below is the default tier's
@pytest.mark.parametrize("family", [pytest.param("llava", marks=pytest.mark.slow),
                                    pytest.param("gemma3", marks=pytest.mark.long)])
def test_the_planned_peak_is_what_the_model_measures_with_images_of_that_size(family):
    """Planned from the config (no weight), then the same model built with weights steps on a batch
    its processor would write: 2 rows of 1 (LLaVA) or 2 (Gemma 3) images. Below the weights' bytes
    (the blocks stream) and at the smallest budget the plan names, the peaks agree to the byte."""
    if family == "llava":
        model, images, seq, inputs = vlm.llava(), 1, vlm.SEQ, vlm.batch(images=(True, True))
        per_image = vlm.PATCHES
    else:
        model, images, seq = vlm_families.gemma3(), 2, vlm_families.SEQ
        inputs, per_image = vlm_families.batch("gemma3", images=(2, 2)), vlm_families.GEMMA3_TOKENS
    config = model.config.to_dict()
    budget = 0.9 * weight_bytes(model) / GiB
    for _ in range(2):
        plan = megacompile.plan(config, hbm_budget=budget, batch=2, seq=seq, images_per_row=images, **CPU)
        assert plan.vision.images.tokens_per_image == per_image          # the processor's count
        assert plan.captured.image_tokens[0].count == 2 * images * per_image
        share = plan.vision
        state = plan.captured.state
        assert share.vision_params == sum(e.numel for n, e in state.items() if not e.is_buffer and n.startswith(
            ("model.vision_tower.", "model.multi_modal_projector.")))            # the head is the language model's
        assert share.vision_params + share.language_params == sum(e.numel for e in state.values() if not e.is_buffer)
        assert share.vision_peak_bytes + share.language_peak_bytes + share.working_set_bytes == \
            plan.predicted_peak_bytes
        assert share.vision_peak_bytes > 0 and 0 < share.time_share < 1
        assert measured_peak(type(model)(model.config), inputs, budget) == plan.predicted_peak_bytes
        budget = plan.minimum_budget_bytes / GiB


@pytest.mark.slow    # four plans; the planned grid and its measured peak stay in the default tier
def test_more_images_or_larger_images_raise_the_vision_share():
    config = vlm.llava().config
    one, two = (megacompile.plan(config, hbm_budget=1.0, batch=2, seq=vlm.SEQ, images_per_row=n, **CPU).vision
                for n in (1, 2))
    assert two.vision_s > one.vision_s and two.time_share > one.time_share
    assert two.vision_peak_bytes > one.vision_peak_bytes and two.memory_share > one.memory_share
    # Idefics3 splits an image larger than the tower's 16 px into 16 px tiles and adds the whole
    # image: 40 px gives 3 x 3 tiles and one more, 10 tower inputs, as its image processor writes.
    config = vlm_families.idefics3().config
    small, large = (megacompile.plan(config, hbm_budget=1.0, batch=2, seq=vlm_families.SEQ, images_per_row=1,
                                     image_size=px, **CPU) for px in (16, 40))
    from transformers import Idefics3ImageProcessorPil
    written = Idefics3ImageProcessorPil(size={"longest_edge": 40}, max_image_size={"longest_edge": 16})(
        [[np.zeros((40, 40, 3), dtype=np.uint8)]], return_tensors="pt")["pixel_values"]
    assert large.vision.images.tiles_per_image == written.shape[1] == 10
    assert large.vision.images.tokens_per_image == 10 * vlm_families.IDEFICS3_TOKENS
    assert large.captured.image_tokens[0].padded.tokens_per_image == vlm_families.IDEFICS3_TOKENS
    assert large.vision.time_share > small.vision.time_share
    assert large.vision.memory_share > small.vision.memory_share


def _qwen(image_px: int, rows: int = 2, build=vlm_families.qwen2_5_vl) -> tuple:
    """A tiny Qwen2.5-VL (or Qwen2-VL) with the released models' 14-pixel patches (a 56 px image: 4 x 4
    patches, 4 image tokens after the 2 x 2 merge), and the batch its processor would write: one image
    of image_px pixels in each row."""
    model = build()
    config = model.config
    config.vision_config.patch_size = 14
    if hasattr(config.vision_config, "window_size"):        # Qwen2-VL's tower has no windows
        config.vision_config.window_size = 56
    torch.manual_seed(0)
    model = type(model)(config)
    side = image_px // 14
    tokens = side * side // 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vlm_families.VIDEO_TOKEN, (rows, vlm_families.SEQ), generator=g)
    ids[:, 3] = vlm_families.VISION_START
    ids[:, 4:4 + tokens] = vlm_families.IMAGE_TOKEN
    ids[:, 4 + tokens] = vlm_families.END_OF_IMAGE
    batch = {"input_ids": ids, "labels": ids.masked_fill(ids == vlm_families.IMAGE_TOKEN, -100),
             "pixel_values": torch.randn(rows * side * side, 3 * 2 * 14 * 14, generator=g),
             "mm_token_type_ids": (ids == vlm_families.IMAGE_TOKEN).int(),
             "image_grid_thw": torch.tensor([[1, side, side]] * rows)}
    return model, batch, tokens


def test_qwen2_5_vl_plans_the_grid_its_processor_writes_and_measures_the_planned_peak():
    """Qwen2.5-VL keeps an image's size: its processor's resizing (a blank image run through it)
    gives the grid, a constant of the capture, and the planned peak is the measured one."""
    small = None
    for px in (56, 112):
        model, batch, tokens = _qwen(px)
        plan = megacompile.plan(model.config.to_dict(), hbm_budget=1.0, batch=2, seq=vlm_families.SEQ,
                                images_per_row=1, image_size=px, **CPU)
        assert plan.vision.images.tokens_per_image == tokens and plan.vision.images.pixels == px
        assert plan.captured.grids[0].values == ((1, px // 14, px // 14),) * 2
        assert measured_peak(model, batch, 1.0) == plan.predicted_peak_bytes
        small = plan.vision if px == 56 else small
    assert plan.vision.time_share > small.time_share and plan.vision.memory_share > small.memory_share
    with pytest.raises(ArgumentError, match="planning its images needs image_size"):
        megacompile.plan(model.config.to_dict(), hbm_budget=1.0, batch=2, seq=vlm_families.SEQ, images_per_row=1,
                         **CPU)


def test_qwen2_vl_plans_its_grid_as_qwen2_5_vl_does_and_measures_the_planned_peak():
    model, batch, tokens = _qwen(56, build=vlm_families.qwen2_vl)
    plan = megacompile.plan(model.config.to_dict(), hbm_budget=1.0, batch=2, seq=vlm_families.SEQ,
                            images_per_row=1, image_size=56, **CPU)
    assert plan.vision.images.tokens_per_image == tokens == 4
    assert measured_peak(model, batch, 1.0) == plan.predicted_peak_bytes


def test_a_vision_language_config_plans_its_text_path_without_images():
    plan = megacompile.plan(vlm_families.gemma3().config.to_dict(), hbm_budget=1.0, batch=2, seq=32, **CPU)
    assert plan.captured.block_path == "model.language_model.layers"
    assert not plan.captured.image_tokens and plan.vision is None
    assert sum(1 for s in plan.captured.stages if s.template.kind == "block") == 6


def test_what_cannot_be_planned_with_images_is_refused_by_name():
    llava = vlm.llava().config
    text = llava.text_config
    cases = [
        (dict(model_or_config=text, images_per_row=1), "has no vision tower: plan it without images"),
        (dict(model_or_config=vlm.vipllava().config, images_per_row=1),
         "VipLlavaForConditionalGeneration \\(model_type 'vipllava'\\) places its image features its own way"),
        (dict(model_or_config=llava, image_size=32), "image_size 32 was given without images_per_row"),
        (dict(model_or_config=llava, images_per_row=3), "seq 40 cannot hold 3 image\\(s\\) of 16 image tokens"),
        (dict(model_or_config=llava, images_per_row=-1), "images_per_row"),
        (dict(model_or_config=llava, images_per_row=1, inputs={}), "give either inputs or images_per_row"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ArgumentError, match=message):
            megacompile.plan(hbm_budget=1.0, batch=2, seq=vlm.SEQ, **kwargs, **CPU)
    with pytest.raises(ArgumentError, match="images_per_row"):
        megacompile.minimum_budget(llava, batch=2, seq=vlm.SEQ, images_per_row=0.5, hardware="cpu")


@pytest.mark.long   # about 60 s on two cores
def test_minimum_budget_with_images_is_the_smallest_that_plans():
    config = vlm.llava().config
    lowest = megacompile.minimum_budget(config, batch=2, seq=vlm.SEQ, images_per_row=2, **CPU)
    text = megacompile.minimum_budget(config, batch=2, seq=vlm.SEQ, **CPU)
    assert lowest > text       # the tower's weights and activations
    assert megacompile.plan(config, hbm_budget=lowest, batch=2, seq=vlm.SEQ, images_per_row=2, **CPU).fits


def test_the_command_plans_a_config_folder_with_images(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(vlm_families.gemma3().config.to_dict()))
    assert main(["plan", "--config", str(tmp_path), "--hbm-budget", "1", "--batch", "2", "--seq", "48",
                 "--images-per-row", "2", "--image-size", "64", "--host-budget", "4", "--json"]) == 0
    captured = capsys.readouterr()      # --json: the document on stdout, the text on stderr
    vision, out = json.loads(captured.out)["vision"], captured.err
    assert vision["images"] == {"family": "gemma3", "images_per_row": 2, "image_size": 64, "pixels": 16,
                                "tiles_per_image": 1, "tokens_per_image": 4}
    assert 0 < vision["time_share"] < 1 and 0 < vision["memory_share"] < 1
    assert "images         2 per row of 64 x 64 px, resized to the tower's 16 x 16 px" in out
    assert "parameters (tower and projector)" in out
    assert main(["plan", "--config", str(tmp_path), "--hbm-budget", "1", "--stage", "dpo", "--seq", "48",
                 "--images-per-row", "1", "--host-budget", "4", "--json"]) == 0     # each part plans the tower
    assert all(p["name"] in ("training", "reference forward") for p in json.loads(capsys.readouterr().out)["parts"])
    assert main(["plan", "--config", str(tmp_path), "--hbm-budget", "1", "--stage", "rm", "--seq", "48",
                 "--images-per-row", "1", "--host-budget", "4", "--json"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)["parts"]] == ["training"]


GEMMA3_27B = {"model_type": "gemma3", "mm_tokens_per_image": 256, "image_token_index": 262144,
              "boi_token_index": 255999, "eoi_token_index": 256000,
              "text_config": {"model_type": "gemma3_text", "hidden_size": 5376, "intermediate_size": 21504,
                              "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
                              "head_dim": 128, "vocab_size": 262208, "sliding_window": 1024,
                              "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                                "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896,
                                "patch_size": 14, "vision_use_head": False}}


@pytest.mark.long   # about 30 s on two cores
def test_a_gemma3_27b_shaped_config_plans_with_images():
    """Gemma-3-27B's published shapes (a 27-layer SigLIP tower at 896 px, 256 tokens per image)
    on an 80 GB H100, 4 images in a row of 4096 tokens."""
    plan = megacompile.plan(GEMMA3_27B, hbm_budget=80, batch=1, seq=4096, images_per_row=4)
    share = plan.vision
    assert plan.fits and share.images.tokens_per_image == 256
    assert 0.40e9 < share.vision_params < 0.45e9 and 26e9 < share.language_params < 28e9
    assert 0 < share.time_share < 0.5 and 0 < share.memory_share < 0.5


def test_the_vision_share_counts_tower_blocks_whole_and_splits_the_bridge_by_data_flow():
    """LLaVA's bridge holds the tower's last norm, the projector, the token embedding and the
    merge: the ops that read the projector's weights or the tower's output are vision, the token
    embedding's lookup is not, and the bridge's vision bytes are the projector's and the norm's.
    A tower block is vision in every op and every byte."""
    from megacompile.ir.program import Op
    from megacompile.planner.vision_share import _forward_nodes, _stage_share
    plan = megacompile.plan(vlm.llava().config.to_dict(), hbm_budget=1.0, batch=2, seq=vlm.SEQ, images_per_row=1,
                            **CPU)
    captured = plan.captured
    names = [s.name for s in captured.stages]
    bridge = captured.stages[names.index("bridge")]
    vision_slot = [not n.startswith("model.language_model.") for n in bridge.params]
    assert any(vision_slot) and not all(vision_slot)
    towers = {s for s, st in enumerate(captured.stages) if captured.in_tower(st.origin)}
    vision_act = [p.stage in towers for p in bridge.inputs]
    share, kinds = _stage_share(bridge, vision_slot, vision_act, plan.hardware, captured.compute_dtype)
    t = bridge.template
    assert kinds["weights"] == pytest.approx(
        sum(p.meta.nbytes for p, v in zip(t.params, vision_slot) if v) / t.weight_bytes)
    assert 0 < share[Op.FORWARD] < 1 and 0 < share[Op.BACKWARD] < 1
    forward = _forward_nodes(t.forward, vision_slot + vision_act)
    placeholders = dict(zip(t.forward.placeholders, [*bridge.params, *([None] * len(bridge.inputs))]))
    for node in t.forward.body:
        if node.op != "call_function":
            continue
        reads = {placeholders.get(a) for a in node.all_input_nodes}
        if "model.multi_modal_projector.linear_1.weight" in reads:
            assert node in forward
        if "model.language_model.embed_tokens.weight" in reads:
            assert node not in forward, node      # the token embedding's lookup
    # the tower blocks' compute is vision whole; the prologue and the bridge add their vision parts
    seconds = {}
    for i, stream, start, end in plan.predicted_spans():
        node = plan.program.nodes[i]
        if stream == "compute" and node.op in (Op.FORWARD, Op.BACKWARD, Op.RECOMPUTE):
            kind = "tower" if node.stage in towers else captured.stages[node.stage].name
            seconds[kind] = seconds.get(kind, 0.0) + end - start
    assert seconds["tower"] < plan.vision.vision_s < seconds["tower"] + seconds["prologue"] + seconds["bridge"]
