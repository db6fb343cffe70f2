"""Short clips made on the spot (PyAV, MPEG-4 at 4 frames a second, 32 x 16 pixels), and the video
processor a tiny Qwen folder (qwen_files.py) lacks: Qwen2.5-VL's or Qwen3-VL's at 4 x 4 pixel
patches merged 2 x 2 and frames folded in pairs, so a clip's sampled frames f fill f / 2 x 4 x 8
patches, f / 2 x 8 video tokens. Saving the processor needs torchvision (tests/torchvision_env.py)."""
from __future__ import annotations

import os

SIZE = (32, 16)     # width, height
RATE = 4            # frames a second


def clip(path: str, frames: int = 10, rate: int = RATE, size: tuple[int, int] = SIZE) -> str:
    """A clip whose frame i is coloured by i (so frames differ), `frames` long at `rate` a second."""
    import av
    import numpy as np
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with av.open(path, "w") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for i in range(frames):
            pixels = np.full((size[1], size[0], 3), 40, np.uint8)
            pixels[..., i % 3] = 200
            pixels[:, : 3 * i % size[0]] = 120
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def video_processor(family: str):
    import transformers
    cls = transformers.Qwen2VLVideoProcessor if family == "qwen2_5_vl" else transformers.Qwen3VLVideoProcessor
    return cls(patch_size=4, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 64, "longest_edge": 4096})


def model_dir(path: str, family: str, seed: int = 0) -> str:
    """qwen_files.model_dir with the family's video processor saved beside its image processor, and
    the words of Qwen3-VL's timestamps in its vocabulary."""
    from tests.train import qwen_files
    qwen_files.model_dir(path, seed=seed, family=family)
    video_processor(family).save_pretrained(path)
    return path
