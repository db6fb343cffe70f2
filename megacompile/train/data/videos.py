"""A record's videos, read as LlamaFactory reads them: decoded with PyAV, frames sampled by
video_fps and video_maxlen, each frame scaled within video_max_pixels / video_min_pixels.

    {"messages": [{"role": "user", "content": "<video> what happens here"},
                  {"role": "assistant", "content": "a red square turns green"}],
     "videos": ["clips/square.mp4"]}        # paths relative to the data file (its folder)

A clip of `total` frames lasting `duration` seconds gives min(total, video_maxlen,
floor(duration * video_fps)) frames (at least one), spread evenly from the first frame to the last
(LlamaFactory's `_get_video_sample_indices`). The frames go to the model's own video processor with
their metadata (the stream's frames a second, the indices taken): from it the processor computes
Qwen2.5-VL's seconds per temporal patch (2 / the frames sampled a second) and Qwen3-VL's timestamps,
as it does for a clip it samples itself, and it repeats the last frame of an odd count to fold the
frames in pairs (Qwen's temporal patches), as LlamaFactory's Qwen2-VL plugin does before it.

    Settings.of(c)                the run's video keys, LlamaFactory's defaults where unset
    read(path, settings, where)   a Clip: its frames (PIL, RGB) and the metadata the processor takes
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ...errors import ArgumentError
from .pixels import Limits, fit

PLACEHOLDER = "<video>"     # what LlamaFactory's records write for a video
# LlamaFactory's defaults (its ProcessorArguments)
MAX_PIXELS, MIN_PIXELS, FPS, MAXLEN = 256 * 256, 16 * 16, 2.0, 128


@dataclass(frozen=True)
class Settings:
    limits: Limits = Limits(MAX_PIXELS, MIN_PIXELS)
    fps: float = FPS            # frames sampled per second of video
    maxlen: int = MAXLEN        # most frames sampled from one video

    @staticmethod
    def of(c: Any) -> "Settings":
        def given(key: str, default):
            value = getattr(c, key, None)
            return default if value is None else value
        return Settings(Limits(given("video_max_pixels", MAX_PIXELS), given("video_min_pixels", MIN_PIXELS)),
                        float(given("video_fps", FPS)), int(given("video_maxlen", MAXLEN)))

    def key(self) -> list:
        """What a token file made from videos depends on (tokens.py's cache key)."""
        return [self.limits.max_pixels, self.limits.min_pixels, self.fps, self.maxlen]


@dataclass
class Clip:
    frames: list                        # PIL images, RGB, within the settings' limits
    metadata: dict = field(default_factory=dict)   # transformers' VideoMetadata fields


def sample_indices(total: int, duration: float, settings: Settings) -> list[int]:
    """The frames taken from a video of `total` frames lasting `duration` seconds."""
    count = max(1, math.floor(duration * settings.fps))
    count = max(1, min(total, settings.maxlen, count))
    import numpy as np
    return [int(i) for i in np.linspace(0, total - 1, count).round()]     # as LlamaFactory samples


def read(path: str, settings: Settings, where: str) -> Clip:
    """The video's sampled frames and their metadata; an ArgumentError naming the record for a file
    that is not a readable video (or without PyAV)."""
    try:
        import av
    except ImportError as e:
        raise ArgumentError(f"{where}: records with videos are decoded with PyAV, which this environment lacks: "
                            "pip install av (or megacompile[video])") from e
    try:
        with av.open(path) as container:
            stream = next(s for s in container.streams if s.type == "video")
            fps = float(stream.average_rate) if stream.average_rate else None
            total = stream.frames or sum(1 for _ in container.decode(stream))     # the container's count
            duration = (float(stream.duration * stream.time_base) if stream.duration is not None
                        else total / (fps or settings.fps))
            indices = sample_indices(total, duration, settings)
            wanted, taken = set(indices), {}
            container.seek(0)
            for i, frame in enumerate(container.decode(stream)):    # only the sampled frames are kept
                if i in wanted:
                    taken[i] = frame.to_image()
                if i >= indices[-1]:
                    break
    except StopIteration:
        raise ArgumentError(f"{where}: {path} holds no video stream") from None
    except Exception as e:  # noqa: BLE001 - PyAV's own words, with the file named
        raise ArgumentError(f"{where}: cannot read video {path}: {str(e).splitlines()[0][:200]}") from e
    if not taken:
        raise ArgumentError(f"{where}: video {path} holds no frames")
    # a container that counts more frames than it decodes: the last decoded frame stands in
    indices = [i if i in taken else max(taken) for i in indices]
    frames = [fit(taken[i].convert("RGB"), settings.limits) for i in indices]
    width, height = frames[0].size
    return Clip(frames, {"total_num_frames": total, "fps": fps or total / duration, "duration": duration,
                         "frames_indices": indices, "width": width, "height": height})
