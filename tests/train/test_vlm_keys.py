"""LlamaFactory's vision-language keys on every family megacompile trains: freeze_vision_tower,
freeze_multi_modal_projector and freeze_language_model freeze exactly the part each names, whatever
the family calls it; image_max_pixels and image_min_pixels reach the image processor; the video keys
are taken and checked; LlamaFactory's examples/train_full/qwen2_5vl_full_sft.yaml loads with its keys
as written and trains a tiny Qwen2.5-VL with the default budget."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import grid_images, pixels
from megacompile.train.methods import vision_freeze
from tests import vlm_families
from tests.train import files, qwen_files, vlm_files

TOWER, PROJECTOR, LANGUAGE = vision_freeze.KEYS
# Each family's parts, by the prefixes of its parameter names (tied heads are the embedding's).
PARTS = {
    "llava": {TOWER: ("model.vision_tower.",), PROJECTOR: ("model.multi_modal_projector.",),
              LANGUAGE: ("model.language_model.", "lm_head.")},
    "gemma3": {TOWER: ("model.vision_tower.",), PROJECTOR: ("model.multi_modal_projector.",),
               LANGUAGE: ("model.language_model.",)},
    "idefics3": {TOWER: ("model.vision_model.",), PROJECTOR: ("model.connector.",),
                 LANGUAGE: ("model.text_model.", "lm_head.")},
    "smolvlm": {TOWER: ("model.vision_model.",), PROJECTOR: ("model.connector.",),
                LANGUAGE: ("model.text_model.", "lm_head.")},
    "qwen2_5_vl": {TOWER: ("model.visual.patch_embed.", "model.visual.blocks."), PROJECTOR: ("model.visual.merger.",),
                   LANGUAGE: ("model.language_model.", "lm_head.")},
    # LlamaFactory groups the deepstack mergers with the tower (its vision_model_keys for qwen3_vl)
    "qwen3_vl": {TOWER: ("model.visual.patch_embed.", "model.visual.pos_embed.", "model.visual.blocks.",
                         "model.visual.deepstack_merger_list."),
                 PROJECTOR: ("model.visual.merger.",), LANGUAGE: ("model.language_model.", "lm_head.")},
}


def _llava():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=63))


def _model(family: str):
    return _llava() if family == "llava" else vlm_families.model(family)


def _keys(**given) -> SimpleNamespace:
    return SimpleNamespace(**{k: given.get(k) for k in vision_freeze.KEYS})


def _part(family: str, name: str) -> str | None:
    found = [key for key, prefixes in PARTS[family].items() if name.startswith(prefixes)]
    assert len(found) <= 1, name
    return found[0] if found else None


@pytest.mark.parametrize("family", sorted(PARTS))
def test_each_key_freezes_exactly_its_part_in_every_family(family):
    """The prefixes above cover every parameter, each in one part; a key set to true freezes the
    parameters of its part and no other; set to false, or unset, it freezes nothing."""
    model = _model(family)
    params = dict(model.named_parameters())
    sizes = {key: sum(p.numel() for n, p in params.items() if _part(family, n) == key) for key in vision_freeze.KEYS}
    assert [n for n in params if _part(family, n) is None] == []
    assert all(sizes.values())
    assert {n: vision_freeze.part_of(n) for n in params} == {n: _part(family, n) for n in params}
    for key in vision_freeze.KEYS:
        for p in model.parameters():
            p.requires_grad_(True)
        vision_freeze.apply(_keys(**{key: True}), model)
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        assert frozen == {n for n in params if _part(family, n) == key}, key
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert trainable == sum(sizes.values()) - sizes[key]
    for p in model.parameters():
        p.requires_grad_(True)
    vision_freeze.apply(_keys(**{k: False for k in vision_freeze.KEYS}), model)
    assert all(p.requires_grad for p in model.parameters())


def test_llamafactorys_defaults_leave_qwen_vl_its_language_model_alone_trained():
    """freeze_vision_tower and freeze_multi_modal_projector (LlamaFactory's defaults, its example's
    values): the whole of `visual` frozen, merger included; the decoder and head train."""
    model = vlm_families.model("qwen2_5_vl")
    vision_freeze.apply(_keys(freeze_vision_tower=True, freeze_multi_modal_projector=True,
                              freeze_language_model=False), model)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if n.startswith(("model.language_model.", "lm_head."))}
    assert any(".merger." in n for n, _ in model.named_parameters())


def test_lora_on_qwen_vl_puts_adapters_on_the_language_model_alone():
    """The tower's blocks have gate_proj, up_proj and down_proj too; lora_target all (and their
    names) adapt the decoder's alone."""
    pytest.importorskip("peft")
    from megacompile.train.methods.lora import with_adapters
    for target in ("all", ["gate_proj", "q_proj"]):
        wrapped = with_adapters(vlm_families.model("qwen2_5_vl"), 2, 4.0, 0.0, target)
        trained = [n for n, p in wrapped.named_parameters() if p.requires_grad]
        assert trained and all(".language_model." in n and ".lora_" in n for n in trained)
        assert any(".visual.blocks." in n and "gate_proj" in n for n, _ in wrapped.named_parameters())


def test_a_model_without_the_part_is_refused_by_name(tmp_path):
    """A vision-language model whose parts no name above matches is refused, naming what it looked
    for and what the model holds."""
    model = vlm_families.model("qwen2_5_vl")
    model.model.visual.merger = None        # no projector left
    with pytest.raises(ArgumentError, match=r"freeze_multi_modal_projector: Qwen2_5_VLForConditionalGeneration has "
                                            r"no module named multi_modal_projector or connector or visual.merger; "
                                            r"its top modules are language_model, lm_head, visual"):
        vision_freeze.apply(_keys(freeze_multi_modal_projector=True), model)


def test_fit_scales_an_image_within_the_limits_keeping_its_aspect_ratio():
    from PIL import Image
    image = Image.new("RGB", (640, 480))
    fitted = pixels.fit(image, pixels.Limits(max_pixels=262144))
    assert fitted.width * fitted.height <= 262144 and fitted.size == (591, 443)       # LlamaFactory's sides
    assert abs(fitted.width / fitted.height - 640 / 480) < 0.01
    assert pixels.fit(image, pixels.Limits(max_pixels=640 * 480)) is image
    small = pixels.fit(Image.new("RGB", (8, 6)), pixels.Limits(min_pixels=1200))
    assert small.width * small.height >= 1200 and abs(small.width / small.height - 8 / 6) < 0.05
    assert pixels.fit(image) is image


def _big_image(folder, size=(64, 48)) -> str:
    from PIL import Image
    path = os.path.join(folder, "big.png")
    Image.new("RGB", size, (200, 40, 40)).save(path)
    return path


def test_image_max_pixels_caps_a_qwen_images_grid(tmp_path):
    """A 64 x 48 image fills 12 tokens (a 6 x 8 grid) under the tiny processor's own limit of 1,024
    pixels; at image_max_pixels 256 its grid holds at most 256 / 4**2 patches, so at most 4 tokens;
    the processor's own range is narrowed, never widened."""
    model = qwen_files.model_dir(str(tmp_path / "model"))
    big = _big_image(str(tmp_path))
    assert grid_images.media(model).width(big, "big") == 12
    media = grid_images.media(model)
    pixels.attach(media, pixels.Limits(max_pixels=256))
    grid = media._pixels(big)[1]
    assert int(grid.prod()) * 4 ** 2 <= 256 and 0 < media.width(big, "big") <= 256 // (4 * 2) ** 2
    wide = grid_images.media(model)
    pixels.attach(wide, pixels.Limits(max_pixels=10 ** 6, min_pixels=16))
    assert (wide.image_processor.size["longest_edge"], wide.image_processor.size["shortest_edge"]) == (1024, 64)
    assert wide.width(big, "big") == 12


def test_image_max_pixels_reaches_every_familys_images(tmp_path):
    """Images are scaled within the limits before any processor sees them (LLaVA's resizes them to
    its fixed size again: its image tokens stay)."""
    from megacompile.train.data.images import Media
    vlm_files.model_dir(str(tmp_path / "model"))
    media = Media(str(tmp_path / "model"))
    pixels.attach(media, pixels.Limits(max_pixels=256))
    opened = media._open(_big_image(str(tmp_path)), "big")
    assert opened.width * opened.height <= 256 and opened.size == (18, 13)


def test_a_run_reads_its_images_within_image_max_pixels(tmp_path, monkeypatch):
    """Through run.yaml: the token file widens a 64 x 48 image to the tokens of its image scaled
    to 256 pixels (18 x 13, rounded by the processor to 16 x 16: a 4 x 4 grid, 4 tokens), as
    LlamaFactory's image_max_pixels does; 12 without it."""
    from megacompile.train.stages.sft import SFTStage
    monkeypatch.chdir(tmp_path)
    qwen_files.model_dir(str(tmp_path / "model"))
    big = _big_image(str(tmp_path))
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(3):
            f.write('{"messages": [{"role": "user", "content": "<image> what colour is this"}, '
                    '{"role": "assistant", "content": "this is red"}], "images": ["big.png"]}\n')
    assert os.path.isfile(big)
    counts = []
    for name, over in (("capped", {"image_max_pixels": 256}), ("whole", {})):
        c = load(files.run_yaml(str(tmp_path / f"{name}.yaml"), model="model", data="data.jsonl", seq=32, steps=1,
                                device="cpu", run_dir=name, **over), [])
        stage = SFTStage(c, str(tmp_path / name))
        try:
            pad = stage.tokenizer.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            counts.append(int((np.asarray(stage.made[0].ids) == pad).sum()))
        finally:
            stage.discard()
            stage.close()
    assert counts == [3 * 4, 3 * 12]


@pytest.mark.parametrize("over, message", [
    ({"image_max_pixels": 0}, "image_max_pixels is a number of pixels"),
    ({"image_max_pixels": "768*768"}, "image_max_pixels is a number of pixels"),
    ({"image_min_pixels": 4096, "image_max_pixels": 1024}, "image_min_pixels 4,096 is above image_max_pixels 1,024"),
    ({"video_min_pixels": 100, "video_max_pixels": 10}, "video_min_pixels 100 is above video_max_pixels 10"),
    ({"video_fps": 0}, "video_fps must be a number > 0"),
    ({"video_maxlen": 1.5}, "video_maxlen must be a whole number >= 1"),
])
def test_the_image_and_video_keys_are_checked(tmp_path, over, message):
    work = files.workspace(tmp_path)
    with pytest.raises(ArgumentError, match=message):
        load(files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=work["chats"], steps=1, **over), [])


def _llamafactory(tmp_path, **over) -> str:
    """qwen2_5vl_full_sft.yaml as LlamaFactory writes it, pointed at the tiny folder and data."""
    if not os.path.isdir(tmp_path / "model"):
        qwen_files.model_dir(str(tmp_path / "model"))
        qwen_files.llamafactory_data(str(tmp_path / "data"))
    settings = {"model_name_or_path": "model", **qwen_files.LLAMAFACTORY_QWEN2_5VL_FULL_SFT,
                "output_dir": "saves/qwen2_5vl-7b/full/sft", **over}
    return files.run_yaml(str(tmp_path / "qwen2_5vl_full_sft.yaml"), **settings)


def test_llamafactorys_qwen2_5vl_full_sft_yaml_loads_as_written(tmp_path, capsys):
    c = load(_llamafactory(tmp_path), [])
    assert (c.seq, c.batch, c.grad_accum, c.lr, c.epochs, c.warmup, c.schedule, c.compute_dtype) == \
           (2048, 1, 2, 1e-5, 3.0, 0.1, "cosine", "bfloat16")
    assert (c.freeze_vision_tower, c.freeze_multi_modal_projector, c.freeze_language_model) == (True, True, False)
    assert (c.image_max_pixels, c.video_max_pixels, c.max_samples, c.log, c.log_every, c.save_every) == \
           (262144, 16384, 1000, ["csv"], 10, 500)
    assert c.run_dir == str(tmp_path / "saves" / "qwen2_5vl-7b" / "full" / "sft") and c.resume is None
    assert [os.path.basename(e["path"]) for e in c.data] == ["mllm_demo.json", "identity.json", "alpaca_en_demo.json"]
    said = capsys.readouterr().out
    assert "video_max_pixels" not in said       # used: records with videos read within it (test_video_records.py)
    for key in ("trust_remote_code", "deepspeed", "pad_to_multiple_of", "overwrite_cache", "ddp_timeout"):
        assert key in said.split("ignored (no effect in a megacompile run):")[1].splitlines()[0]


@pytest.mark.long   # the tiny Qwen2.5-VL made, its data tokenised, 2 steps of 2 micro-batches in bfloat16: 55-160 s on 2 cores
def test_llamafactorys_qwen2_5vl_full_sft_trains_with_the_default_budget(tmp_path, monkeypatch):
    """The example's keys as written, its sizes tiny (cutoff_len 64 for 2048, max_steps 2 for
    3 epochs), no hbm_budget: the run trains with finite losses, its frozen tower and merger come
    out as they went in, and its language model moves."""
    import safetensors.torch
    monkeypatch.chdir(tmp_path)
    c = load(_llamafactory(tmp_path, cutoff_len=64, max_steps=2), ["device=cpu"])
    assert c.hbm_budget is None
    result = run(c)
    rows = log.read(os.path.join(c.run_dir, "log.csv"))
    assert result["steps"] == 2 and len(rows) == 2 and all(math.isfinite(float(r["loss"])) for r in rows)
    before = safetensors.torch.load_file(str(tmp_path / "model" / "model.safetensors"))
    after = safetensors.torch.load_file(os.path.join(c.run_dir, "model.safetensors"))
    # the files' own layout (as transformers saves Qwen2.5-VL): the tower and merger under visual.
    visual = {k for k in before if k.startswith("visual.")}
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert before.keys() == after.keys() and {k.split(".")[1] for k in visual} == {"patch_embed", "blocks", "merger"}
    assert moved == set(before) - visual


def test_a_token_file_made_within_other_pixel_limits_is_made_again(tmp_path, monkeypatch):
    """The pixel limits are part of what a token file is made from: a run folder's token file
    tokenised with image_max_pixels is not reused by a run without it (its image widths differ)."""
    from megacompile.train.stages.sft import SFTStage
    monkeypatch.chdir(tmp_path)
    qwen_files.model_dir(str(tmp_path / "model"))
    _big_image(str(tmp_path))
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(3):
            f.write('{"messages": [{"role": "user", "content": "<image> what colour is this"}, '
                    '{"role": "assistant", "content": "this is red"}], "images": ["big.png"]}\n')
    counts = []
    for name, over in (("capped", {"image_max_pixels": 256}), ("whole", {})):
        c = load(files.run_yaml(str(tmp_path / f"{name}.yaml"), model="model", data="data.jsonl", seq=32, steps=1,
                                device="cpu", run_dir="same", **over), [])
        stage = SFTStage(c, str(tmp_path / "same"))
        try:
            pad = stage.tokenizer.tokenizer.convert_tokens_to_ids("<|image_pad|>")
            counts.append(int((np.asarray(stage.rows.tokens.ids) == pad).sum()))
            stage.commit(str(tmp_path / "same"))
        finally:
            stage.close()
    assert counts == [3 * 4, 3 * 12]
