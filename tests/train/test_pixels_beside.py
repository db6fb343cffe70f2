"""The processed pixels a vision-language run holds in host memory, counted beside the engine's
state before it is placed (train/beside.py): the pixels kept for images read again (at most the
cache's limit) and the heaviest micro-batch's pixel inputs, which no micro-batch of the epoch
passes; in stage grpo also a generator call's, or a copy's whole rollout's on a GPU. A run shown
no images counts none."""
from __future__ import annotations

from megacompile.train import load
from megacompile.train.data.images import PixelCache
from megacompile.train.data import packing
from megacompile.train.stages import kind
from megacompile.train.stages.sft import SFTStage
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.model import meta_model
from tests.posttrain import test_image_prompts
from tests.train import files, qwen_files

WIDTH = 3 * 2 * 4 * 4 * 4       # a patch's float32 bytes: 3 channels x 2 frames x 4 x 4 pixels (qwen_files)
COLOUR = {f"images/{c}.png": c for c in qwen_files.SIZES}


def _image_bytes(path: str) -> int:
    t, h, w = qwen_files.GRIDS[COLOUR[path[path.index("images/"):]]]
    return t * h * w * WIDTH


def _sft(tmp_path, **more):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=qwen_files.model_dir(str(tmp_path / "model")),
                            data=qwen_files.records(str(tmp_path / "data.jsonl"), 12), batch=2, seq=48, steps=1,
                            device="cpu", run_dir=str(tmp_path / "run"), **more), [])
    return SFTStage(c, c.run_dir)


def test_an_sft_run_with_images_counts_the_kept_pixels_and_its_heaviest_micro_batchs(tmp_path):
    stage = _sft(tmp_path)
    try:
        kept, batch = stage.host_beside(None, "cpu")
        assert kept.nbytes == PixelCache.LIMIT and "kept for the images read again" in kept.what
        rows = stage.rows
        each = sorted((sum(_image_bytes(p) for p in rows.images(i)) for i in range(rows.rows_per_epoch)),
                      reverse=True)
        assert batch.nbytes == sum(each[:2]) > 0 and "micro-batch's pixel inputs" in batch.what
        # every micro-batch the epoch makes holds at most that, and the heaviest pair of rows exactly it
        held = [sum(v.numel() * v.element_size() for k, v in packing.batch(rows, i, 2, shifted=False).items()
                    if k.startswith("pixel_values")) for i in range(0, rows.rows_per_epoch - 1)]
        assert max(held) <= batch.nbytes
    finally:
        stage.discard()


def test_a_run_on_a_vision_language_model_shown_no_images_counts_no_pixels(tmp_path):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=qwen_files.model_dir(str(tmp_path / "model")),
                            data=files.chats(str(tmp_path / "chats.jsonl")), batch=2, seq=32, steps=1, device="cpu",
                            run_dir=str(tmp_path / "run")), [])
    stage = SFTStage(c, c.run_dir)
    try:
        assert stage.media is not None and stage.host_beside(None, "cpu") == []
    finally:
        stage.discard()


def test_grpo_counts_a_generator_calls_pixels_or_a_copys_rollout_on_a_gpu(tmp_path):
    data = test_image_prompts.trl_prompts(str(tmp_path / "data" / "prompts.jsonl"), n=6, text_every=3)
    settings = test_image_prompts._settings(tmp_path, data, batch=2, num_generations=2, steps_per_generation=2)

    def stage(**more):
        c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**settings, **more}), [])
        return kind(c)(c, load_tokenizer(c.model, c.chat_template), c.run_dir)
    engine = stage()
    by_prompt = sorted((sum(_image_bytes(p) for p in shown) for shown in engine.shown), reverse=True)
    parts = {b.what.split(",")[0]: b.nbytes for b in engine.host_beside(None, "cpu")}
    assert parts["processed pixels kept for the images read again"] == PixelCache.LIMIT
    assert parts["a micro-batch's pixel inputs"] == sum(by_prompt[:2])
    assert parts["a generator call's pixel inputs"] == sum(by_prompt[:2])        # batch 2 rows a forward
    copy = stage(generator="hf")
    on_gpu = {b.what.split(",")[0]: b.nbytes for b in copy.host_beside(None, "cuda")}
    assert on_gpu["a rollout's pixel inputs before they go to the GPU"] == sum(by_prompt[:4])      # 2 x 2 rows
    # on the cpu backend a copy's pixels are counted with its generate (beside.generator_host)
    held = copy.host_beside(meta_model(copy.c), "cpu")
    assert not any("rollout's pixel inputs" in b.what for b in held) and any("generate" in b.what for b in held)
