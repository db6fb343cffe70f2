"""Records with videos, read as LlamaFactory reads them and written as the model's processor writes
them (Qwen2.5-VL, Qwen3-VL): frames sampled by video_fps and video_maxlen within the video pixel
limits; the row, its video inputs and its token types the processor's own for the same
conversation, frames and metadata; the answer alone counted. Families whose processor takes no
videos, records without a processor, files that are not videos and placeholders that do not
number the videos are refused by name.

The clip (video_files.py) is 10 frames at 4 a second, 2.5 s: at LlamaFactory's default 2 frames a
second it gives floor(2.5 x 2) = 5 frames, numpy.linspace(0, 9, 5) rounded = 0, 2, 4, 7, 9, which
the processor folds in 3 pairs (the last frame repeated): a grid of 3 x 4 x 8 patches, 24 video
tokens. Tests that run the processor need torchvision (tests/torchvision_env.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import grid_images, tokens, videos
from megacompile.train.data.pixels import Limits
from tests import torchvision_env
from tests.train import processor_files, qwen_files, video_files

RECORD = {"messages": [{"role": "user", "content": "<video> what colour is this"},
                       {"role": "assistant", "content": "this is red"}], "videos": ["clips/a.mp4"]}


def _frames(path: str) -> list:
    import av
    with av.open(path) as container:
        return [np.asarray(f.to_image()) for f in container.decode(container.streams.video[0])]


@pytest.mark.parametrize("settings, taken", [
    (videos.Settings(), [0, 2, 4, 7, 9]),                               # LlamaFactory's defaults: 2 a second
    (videos.Settings(maxlen=3), [0, 4, 9]),                             # video_maxlen caps them
    (videos.Settings(fps=0.1), [0]),                                    # at least one
    (videos.Settings(fps=10.0), list(range(10))),                       # at most every frame
])
def test_frames_are_sampled_as_llamafactory_samples_them(tmp_path, settings, taken):
    path = video_files.clip(str(tmp_path / "a.mp4"))
    clip = videos.read(path, settings, "data.jsonl:1")
    assert clip.metadata == {"total_num_frames": 10, "fps": 4.0, "duration": 2.5, "frames_indices": taken,
                             "width": 32, "height": 16}
    decoded = _frames(path)
    assert [np.asarray(f).tolist() for f in clip.frames] == [decoded[i].tolist() for i in taken]


def test_frames_are_scaled_within_the_video_pixel_limits(tmp_path):
    path = video_files.clip(str(tmp_path / "a.mp4"))
    small = videos.read(path, videos.Settings(limits=Limits(128, 16)), "w")
    assert {f.size for f in small.frames} == {(16, 8)}      # 32 x 16 = 512 pixels scaled by sqrt(128 / 512)
    large = videos.read(path, videos.Settings(limits=Limits(100_000, 2048)), "w")
    assert {f.size for f in large.frames} == {(64, 32)}     # raised to 2,048 pixels


def test_the_run_keys_set_the_reading_and_key_the_token_file():
    from types import SimpleNamespace
    c = SimpleNamespace(video_max_pixels=16384, video_min_pixels=None, video_fps=1.0, video_maxlen=None)
    assert videos.Settings.of(c) == videos.Settings(Limits(16384, 256), 1.0, 128)
    assert videos.Settings.of(c).key() != videos.Settings().key()


def test_a_file_that_is_not_a_video_is_refused_naming_the_record(tmp_path):
    path = tmp_path / "a.mp4"
    path.write_bytes(b"not a video at all")
    with pytest.raises(ArgumentError, match=rf"data.jsonl:4: cannot read video {path}"):
        videos.read(str(path), videos.Settings(), "data.jsonl:4")


def test_a_record_with_videos_and_no_processor_is_refused():
    with pytest.raises(ArgumentError, match=r"data.jsonl:3: the record has videos, and they are read only with the "
                                            r"model folder's processor"):
        tokens.encode(None, RECORD, False, "data.jsonl:3")


def test_a_family_whose_processor_takes_no_videos_refuses_them_naming_the_ones_that_do(tmp_path):
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    video_files.clip(str(tmp_path / "clips" / "a.mp4"))
    media = grid_images.media(model)
    media.at(str(tmp_path / "data.jsonl"))
    with pytest.raises(ArgumentError, match=r"data.jsonl:2: the record has videos, and the processor in .* "
                                            r"\(LlavaProcessor\) takes none: records with videos train with Qwen2.5-VL "
                                            r"and Qwen3-VL"):
        media.paths(RECORD, "data.jsonl:2")


def test_placeholders_that_do_not_number_the_videos_are_refused(tmp_path):
    model = qwen_files.model_dir(str(tmp_path / "model"))
    video_files.clip(str(tmp_path / "clips" / "a.mp4"))
    media = grid_images.media(model)
    media.at(str(tmp_path / "data.jsonl"))
    two = {**RECORD, "videos": ["clips/a.mp4", "clips/a.mp4"]}
    with pytest.raises(ArgumentError, match=r"data.jsonl:5: the turns hold 1 <video> placeholder \(video parts "
                                            r"counted\) and videos lists 2 files: each <video> \(or \{type: video\} "
                                            r"part\) stands for one video"):
        media.messages(two["messages"], media.paths(two, "data.jsonl:5"), "data.jsonl:5")


def test_without_torchvision_a_record_with_videos_names_it(tmp_path, monkeypatch):
    import importlib.util
    model = qwen_files.model_dir(str(tmp_path / "model"))
    video_files.clip(str(tmp_path / "clips" / "a.mp4"))
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchvision" else find(name, *a))
    media = grid_images.media(model)
    tokenizer = tokens.load_tokenizer(model)
    tokenizer.chat_template = media.chat_template()
    media.at(str(tmp_path / "data.jsonl"))
    with pytest.raises(ArgumentError, match=r"data.jsonl:1: the record has videos, and transformers builds the video "
                                            r"processor of .* only with torchvision.*: pip install torchvision"):
        tokens.encode(tokenizer, RECORD, False, "data.jsonl:1", media)


def _row_is_the_processors(folder: str, family: str) -> None:
    """The record's row through a token file, against the processor given the chat template's text,
    the frames taken by hand and their metadata; then its micro-batch's inputs."""
    import torch
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    from megacompile.train.data import packing
    model = video_files.model_dir(os.path.join(folder, "model"), family)
    clip = video_files.clip(os.path.join(folder, "clips", "a.mp4"))
    with open(os.path.join(folder, "data.jsonl"), "w") as f:
        f.write(json.dumps(RECORD) + "\n")
    media = grid_images.media(model)
    tokenizer = tokens.load_tokenizer(model)
    tokenizer.chat_template = media.chat_template()
    made = tokens.token_file(os.path.join(folder, "tokens"), "train", [os.path.join(folder, "data.jsonl")],
                             tokenizer, model, False, media)
    row = np.asarray(made.ids[made.docs[0]:made.docs[1]]).tolist()
    targets = np.asarray(made.targets[made.docs[0]:made.docs[1]]).astype(bool)

    processor = AutoProcessor.from_pretrained(model)
    written = [{**m, "content": m["content"].replace("<video>", "<|vision_start|><|video_pad|><|vision_end|>")}
               for m in RECORD["messages"]]
    text = processor.apply_chat_template(written, tokenize=False)
    taken = [0, 2, 4, 7, 9]
    frames = [_frames(clip)[i] for i in taken]
    metadata = VideoMetadata(total_num_frames=10, fps=4.0, duration=2.5, frames_indices=taken, width=32, height=16)
    from PIL import Image
    theirs = processor(text=[text], videos=[[Image.fromarray(f) for f in frames]], video_metadata=[metadata],
                       do_sample_frames=False, add_special_tokens=False, return_tensors="pt")
    assert row == theirs["input_ids"][0].tolist() + [tokenizer.eos_token_id]
    pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert theirs["video_grid_thw"].tolist() == [[3, 4, 8]] and row.count(pad) == 24
    answer = tokenizer.convert_tokens_to_ids(["this", "is", "red", "<|end|>"])
    assert [t for t, on in zip(row, targets) if on] == answer + [tokenizer.eos_token_id]

    rows = packing.Rows(made, len(row) + 2, False, 0, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    inputs = packing.batch(rows, 0, 1, shifted=False)
    expected = {k: v for k, v in theirs.items() if k not in ("input_ids", "attention_mask")}
    assert set(inputs) - {"input_ids", "labels"} == set(expected)
    for key, value in expected.items():
        got = inputs[key][:, :len(row) - 1] if key == "mm_token_type_ids" else inputs[key]
        torch.testing.assert_close(got.to(value.dtype), value, rtol=0, atol=0, msg=key)
    assert int((inputs["mm_token_type_ids"] == 2).sum()) == 24
    if family == "qwen2_5_vl":      # 2 frames a patch over the 2 frames sampled a second
        assert inputs["second_per_grid_ts"].tolist() == [1.0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow)])
def test_a_record_with_a_video_is_the_processors_row_and_its_answer_alone_is_counted(tmp_path, family):
    torchvision_env.call(_row_is_the_processors, str(tmp_path), family)
