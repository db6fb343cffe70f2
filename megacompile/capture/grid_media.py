"""Qwen2.5-VL's and Qwen3-VL's images and videos, merged into the token embeddings at static shapes.

These models place two kinds of media: image features over the image tokens
(`config.image_token_id`) and video features over the video tokens (`config.video_token_id`), each
kind by a `masked_scatter` over a mask from one `get_placeholder_mask`, which returns both. Their
vision tower encodes both kinds on tables computed from the grids (grid_constants.py). While
tracing, `GridMedia` gives the model's module (image_tokens.static_image_merge installs them):

- get_image_features, get_video_features: the tower on its grids' tables, constants of the capture;
- get_placeholder_mask: both masks without the check that reads the tokens' count out of a tensor;
  the count each kind's features fill is recorded (image_tokens.ImageTokens, one for the images,
  one for the videos), and every step's input_ids are counted against it before anything runs;
- forward, which hands a step with images and videos both to the model's own: eagerly the model
  runs its tower twice, once per kind, but the tower's layers are streamed blocks, each called once
  a step. So the tower runs once over both (`GridTower.encode`: each image and each frame is
  encoded on its own either way) and the model takes the features as its precomputed
  `mm_encoder_outputs`. Qwen3-VL then joins the two kinds' deepstack features in token order by
  boolean indexing (`image_mask[image_mask | video_mask]`, a shape read from values). Instead, both
  kinds' features are put in token order at static shapes (`in_token_order`) and the model takes
  them as one kind over the tokens of both: the same values at the same tokens, deepstack's too.

Without videos, the model runs as before; without images, its own video path traces as it is.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Callable

import torch
import torch.nn as nn

from ..errors import CaptureError
from .grid_constants import GridTower

# (media, input_ids, inputs_embeds, features) -> the [batch, sequence, 1] mask of that media's
# tokens; records how many tokens the features fill (image_tokens.py).
PlaceholderMask = Callable[[str, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def in_token_order(image_mask: torch.Tensor, video_mask: torch.Tensor, images: torch.Tensor,
                   videos: torch.Tensor) -> torch.Tensor:
    """The rows of `images` and `videos` (features, one per token) in the order of their tokens,
    row-major over the [batch, sequence] masks: what Qwen3-VL's boolean indexing gives, at static
    shapes. Each kind is scattered over a zero tensor of every token, then the tokens of either
    kind are gathered in order, found by a stable sort on "is neither"; only copies, so the values
    and their gradients are eager's."""
    width = images.shape[-1]
    placed = images.new_zeros(image_mask.numel(), width)                       # [batch * sequence, width]
    placed = placed.masked_scatter(image_mask.reshape(-1, 1).expand(-1, width), images)
    placed = placed.masked_scatter(video_mask.reshape(-1, 1).expand(-1, width), videos.to(images.dtype))
    neither = (~(image_mask | video_mask)).reshape(-1).to(torch.uint8)
    order = torch.argsort(neither, stable=True)[:images.shape[0] + videos.shape[0]]
    return placed[order]


class GridMedia:
    """The methods capture gives one Qwen2.5-VL or Qwen3-VL model module while tracing."""

    def __init__(self, name: str, module: nn.Module, tower: GridTower, placeholder_mask: PlaceholderMask):
        self.name, self.module, self.tower, self.placeholder_mask = name, module, tower, placeholder_mask
        # While a Qwen3-VL step with images and videos runs: each kind's features, concatenated; the
        # model is given them as one kind, in token order.
        self.joined: tuple[torch.Tensor, torch.Tensor] | None = None

    def methods(self) -> dict[str, Callable]:
        return {"get_placeholder_mask": self.get_placeholder_mask, "forward": self.forward,
                "get_image_features": self.tower.features("image"),
                "get_video_features": self.tower.features("video")}

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):
        if self.joined is not None:     # the features of both kinds, in token order: the mask of both
            images = self.placeholder_mask("image", input_ids, inputs_embeds, self.joined[0])
            videos = self.placeholder_mask("video", input_ids, inputs_embeds, self.joined[1])
            return images | videos, videos
        images = None if image_features is None else self.placeholder_mask("image", input_ids, inputs_embeds,
                                                                           image_features)
        if video_features is not None:
            return images, self.placeholder_mask("video", input_ids, inputs_embeds, video_features)
        return images, (input_ids == self.module.config.video_token_id).unsqueeze(-1).to(inputs_embeds.device)

    def forward(self, *args, **kwargs):
        model = type(self.module)
        named = inspect.signature(model.forward).parameters
        kwargs.update(zip(list(named)[1:], args))       # as keywords, after self
        if kwargs.get("pixel_values") is None or kwargs.get("pixel_values_videos") is None \
                or kwargs.get("mm_encoder_outputs") is not None:
            return model.forward(self.module, **kwargs)
        # what the model hands its get_<media>_features besides the pixels and grids
        extra = {k: v for k, v in kwargs.items() if k not in named}
        images, videos = self.tower.encode([("image", kwargs["pixel_values"], kwargs.get("image_grid_thw")),
                                            ("video", kwargs["pixel_values_videos"], kwargs.get("video_grid_thw"))],
                                           {**extra, "return_dict": True})
        rest = dict(kwargs, pixel_values=None, pixel_values_videos=None)
        if getattr(images, "deepstack_features", None) is None:   # Qwen2.5-VL merges both kinds at static shapes
            return model.forward(self.module, **dict(rest, mm_encoder_outputs={"image": images, "video": videos}))
        with self._joined(images, videos, kwargs.get("input_ids")) as both:
            return model.forward(self.module, **dict(rest, mm_encoder_outputs={"image": both}))

    @contextlib.contextmanager
    def _joined(self, images, videos, input_ids):
        """Qwen3-VL's outputs of both kinds as one, features in token order; get_placeholder_mask
        gives the mask of both kinds' tokens meanwhile."""
        if input_ids is None:
            raise CaptureError(f"{type(self.module).__name__} ('{self.name}') was given inputs_embeds with images "
                               "and videos: megacompile places their features by the image and video tokens of "
                               "input_ids; pass input_ids")
        config = self.module.config
        image_mask, video_mask = input_ids == config.image_token_id, input_ids == config.video_token_id

        def ordered(image_parts, video_parts):
            return (in_token_order(image_mask, video_mask, torch.cat(image_parts), torch.cat(video_parts)),)
        both = type(images)(**images)
        both.pooler_output = ordered(images.pooler_output, videos.pooler_output)
        both.deepstack_features = [ordered(i, v) for i, v in zip(images.deepstack_features, videos.deepstack_features)]
        self.joined = (torch.cat(images.pooler_output), torch.cat(videos.pooler_output))
        try:
            yield both
        finally:
            self.joined = None
