"""Qwen2.5-VL's and Qwen3-VL's videos: the folder's whole processor writes a record that has them.

A video's tokens are its processor's to write: Qwen2.5-VL fills t * h * w / merge_size**2 video
tokens between a vision-start and a vision-end token; Qwen3-VL writes each temporal patch's tokens
between its own start and end, after its timestamp as text ("<0.5 seconds>", from the frames'
indices and the stream's frames a second). So a record with videos is written by the folder's
processor itself: the conversation rendered by the chat template (each `<video>` as the template
writes a video, `<|vision_start|><|video_pad|><|vision_end|>`), its images, and its clips
(videos.read) with their metadata; the targets are carried over from the masked rendering by
aligning the token sequences (images.targets_on), as for any processor that writes its own rows.

transformers builds video processors only with torchvision, so a record with videos needs it (an
error names it before anything is read). The processor's image processor is replaced by the run's
(grid_images.GridMedia's, PIL, narrowed by image_max_pixels), so an image in a record with videos
is processed as in one without. The video processor keeps its own range of pixels per frame, as
LlamaFactory leaves it (the frames were scaled within video_max_pixels / video_min_pixels before
it sees them; Qwen's video processors then raise a frame to their fewest pixels, 128 x 28 x 28 by
default, above LlamaFactory's default video_max_pixels). A micro-batch's video inputs are what the processor
writes for the clips one by one, joined as it joins a batch: pixel_values_videos (every clip's
patches, one after another), video_grid_thw (a row per clip) and, for Qwen2.5-VL,
second_per_grid_ts (temporal_patch_size over the frames sampled per second).
"""
from __future__ import annotations

import importlib.util
from functools import lru_cache

from ...errors import ArgumentError
from . import videos
from .images import reason


class GridVideos:
    """The video half of a Qwen folder's processor (loaded when the first video is read)."""

    def __init__(self, folder: str, image_processor, settings: videos.Settings):
        self.folder, self.image_processor, self.settings = folder, image_processor, settings
        self._processor = None
        self.clip = lru_cache(maxsize=64)(self._clip)
        self.load = lru_cache(maxsize=64)(self._load)

    def processor(self, where: str):
        """The folder's processor, its image processor the run's; refused naming what it needs."""
        if self._processor is not None:
            return self._processor
        if importlib.util.find_spec("torchvision") is None:
            raise ArgumentError(f"{where}: the record has videos, and transformers builds the video processor of "
                                f"{self.folder} only with torchvision, which this environment lacks: pip install "
                                "torchvision (the build that matches your torch)")
        try:
            from transformers import AutoProcessor
            processor = AutoProcessor.from_pretrained(self.folder)
        except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
            raise ArgumentError(f"{where}: cannot load the processor from {self.folder} for its videos: "
                                f"{reason(e)}") from e
        if getattr(processor, "video_processor", None) is None:
            raise ArgumentError(f"{where}: the processor in {self.folder} ({type(processor).__name__}) has no video "
                                "processor (video_preprocessor_config.json): save the model's own processor there")
        processor.image_processor = self.image_processor
        self._processor = processor
        return processor

    def _clip(self, path: str) -> videos.Clip:
        return videos.read(path, self.settings, path)

    def _call(self, where: str, **kwargs) -> dict:
        processor = self.processor(where)
        try:
            return processor(**kwargs, do_sample_frames=False, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - transformers' own words, with the record named
            raise ArgumentError(f"{where}: the processor ({type(processor).__name__}) refused the record: "
                                f"{reason(e)}") from e

    def row(self, text: str, pictures: list, paths: list[str], where: str) -> list[int]:
        """What the processor writes for the rendered text with these images (PIL) and videos."""
        from transformers.video_utils import VideoMetadata
        clips = [self._checked(p, where) for p in paths]
        out = self._call(where, text=[text], images=pictures or None, videos=[c.frames for c in clips],
                         video_metadata=[VideoMetadata(**c.metadata) for c in clips], add_special_tokens=False)
        return [int(t) for t in out["input_ids"][0]]

    def _checked(self, path: str, where: str) -> videos.Clip:
        try:
            return self.clip(path)
        except ArgumentError as e:      # read with the path as its `where`: name the record too
            raise ArgumentError(f"{where}: {e}") from None

    def _load(self, path: str) -> dict:
        """The processor's video inputs for this clip alone."""
        from transformers.video_utils import VideoMetadata
        clip = self.clip(path)
        out = self._call(path, text=[self.processor(path).video_token], videos=[clip.frames],
                         video_metadata=[VideoMetadata(**clip.metadata)])
        found = {"pixel_values_videos": out["pixel_values_videos"].float(), "video_grid_thw": out["video_grid_thw"]}
        if "second_per_grid_ts" in out:
            found["second_per_grid_ts"] = out["second_per_grid_ts"].float().reshape(-1)
        return found

    def tokens(self, path: str, merge: int) -> int:
        """The clip's video tokens: its grid's patches over merge_size**2."""
        return int(self.load(path)["video_grid_thw"][0].prod()) // merge ** 2

    def inputs(self, paths: list[str]) -> dict:
        """pixel_values_videos, video_grid_thw (and second_per_grid_ts) of these clips, in order."""
        import torch
        loaded = [self.load(p) for p in paths]
        return {k: torch.cat([x[k] for x in loaded]) for k in loaded[0]}
