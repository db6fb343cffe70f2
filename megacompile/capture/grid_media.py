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
  encoded on its own either way) and the model's get_image_features and get_video_features, which
  its forward calls, return what that run gave each kind (`encoded`). Qwen3-VL then joins the two
  kinds' deepstack features in token order by boolean indexing (`image_mask[image_mask |
  video_mask]`, a shape read from values). Instead, both kinds' features are put in token order at
  static shapes (`in_token_order`) and the model is given them as one kind, images, over the
  tokens of both (its videos' pixels withheld, so it asks for no video features): the same values
  at the same tokens, deepstack's too. The forward's own inputs are all the model is given, so
  this holds whether or not the model also takes precomputed features (`mm_encoder_outputs`,
  which transformers 5.17 does not take).

Without videos, the model runs as before; without images, its own video path traces as it is.
"""
from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable

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
        self.label = f"{type(module).__name__} ('{name}')"
        # While a step with images and videos runs: what the one tower run gave each kind, handed
        # to the model when it asks for that kind's features.
        self.encoded: dict[str, Any] = {}
        # While a Qwen3-VL step with images and videos runs: each kind's features, concatenated; the
        # model is given them as one kind, in token order.
        self.joined: tuple[torch.Tensor, torch.Tensor] | None = None

    def methods(self) -> dict[str, Callable]:
        return {"get_placeholder_mask": self.get_placeholder_mask, "forward": self.forward,
                "get_image_features": self._features("image"), "get_video_features": self._features("video")}

    def _features(self, media: str) -> Callable:
        """get_<media>_features: the tower run's output for that kind, where one is waiting."""
        encode = self.tower.features(media)

        def get_features(*args, **kwargs):
            if media in self.encoded:
                return self.encoded.pop(media)
            return encode(*args, **kwargs)
        return get_features

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
        if getattr(images, "deepstack_features", None) is None:   # Qwen2.5-VL merges both kinds at static shapes
            with self._waiting({"image": images, "video": videos}):
                return model.forward(self.module, **kwargs)
        with self._joined(images, videos, kwargs.get("input_ids")) as both, self._waiting({"image": both}):
            return model.forward(self.module, **dict(kwargs, pixel_values_videos=None))

    @contextlib.contextmanager
    def _waiting(self, encoded: dict[str, Any]):
        """The outputs of the one tower run, handed to the model's forward when it asks for them;
        one it does not ask for would leave its media unplaced."""
        self.encoded = dict(encoded)
        try:
            yield
            if self.encoded:
                raise CaptureError(f"{self.label}'s forward did not ask for its {' and '.join(self.encoded)} "
                                   "features through get_image_features and get_video_features, where megacompile "
                                   "hands it what its one vision tower run gave each kind")
        finally:
            self.encoded = {}

    @contextlib.contextmanager
    def _joined(self, images, videos, input_ids):
        """Qwen3-VL's outputs of both kinds as one, features in token order (the deepstack ones
        split or whole, as the tower's part outputs hold them); get_placeholder_mask gives the mask
        of both kinds' tokens meanwhile."""
        if input_ids is None:
            raise CaptureError(f"{self.label} was given inputs_embeds with images and videos: megacompile places "
                               "their features by the image and video tokens of input_ids; pass input_ids")
        config = self.module.config
        image_mask, video_mask = input_ids == config.image_token_id, input_ids == config.video_token_id

        def whole(features) -> torch.Tensor:
            return features if isinstance(features, torch.Tensor) else torch.cat(features)

        def ordered(image_features, video_features) -> torch.Tensor:
            return in_token_order(image_mask, video_mask, whole(image_features), whole(video_features))
        both = type(images)(**images)
        both.pooler_output = (ordered(images.pooler_output, videos.pooler_output),)
        both.deepstack_features = [ordered(i, v) if isinstance(i, torch.Tensor) else (ordered(i, v),)
                                   for i, v in zip(images.deepstack_features, videos.deepstack_features)]
        self.joined = (torch.cat(images.pooler_output), torch.cat(videos.pooler_output))
        try:
            yield both
        finally:
            self.joined = None
