"""Image features merged into the token embeddings, captured at static shapes.

A Hugging Face vision-language model (LLaVA) embeds the tokens, runs its vision tower and
projector over the images, and writes the image features over the embeddings of the image
placeholder tokens: `inputs_embeds.masked_scatter(input_ids == image_token_id, features)`. The
scatter itself traces: its output has the embeddings' shape and its backward
(`masked_scatter_backward`) the features' shape, whatever the mask holds. What does not trace is
transformers' check before it (`get_placeholder_mask`), which reads the number of image tokens
out of a tensor to compare it with the number of features.

That number is known before the step runs: the features' count is fixed by pixel_values' shape
(so by the capture), and the tokens' count is read from the step's input_ids. While tracing,
`static_image_merge` gives each such module a `get_placeholder_mask` that returns the same mask
without the check and records `ImageTokens` (which input holds the ids, the token id, the count
the features fill); the engine checks every step's ids against it before anything runs, and a
mismatch is our InputMismatchError, as eager transformers would refuse it. Gemma 3 merges as
LLaVA does (its bidirectional attention over an image is a mask computed from token_type_ids,
which traces); Idefics3 checks and scatters in one `inputs_merger`, replaced the same way, and it
and SmolVLM give features whose count is read from pixel_values' values (padded_images.py).
Qwen2-VL, Qwen2.5-VL and Qwen3-VL place images and videos, each kind over its own tokens, counted apart (one
`ImageTokens` a kind); their tower reads the grids' values, which capture takes as constants
(grid_constants.py), and runs once a step over both kinds (grid_media.py).
"""
from __future__ import annotations

import contextlib
import inspect
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import CaptureError, InputMismatchError
from .grid_constants import MEDIA, GridConstants, GridTower, keys_grids, patch_width
from .grid_media import GridMedia
from .padded_images import PaddedImages, pads_images, static_image_features

# The model's input tensors as the trace sees them (top.py sets it in the traced forward), to name
# the input a module's input_ids came from.
_TRACED_INPUTS: ContextVar[list | None] = ContextVar("megacompile_traced_inputs", default=None)
_SIGNATURE = ["input_ids", "inputs_embeds", "image_features"]
_CHECKED = ("transformers.models.llava.modeling_llava", "transformers.models.gemma3.modeling_gemma3")


@dataclass(frozen=True)
class ImageTokens:
    """A step's image placeholder tokens must number the image features its pixel_values give (or,
    with `media` "video", its video tokens the video features of pixel_values_videos)."""
    module: str        # the module that merges them, in words ("LlavaModel at 'model'")
    input: int         # which of the model's input tensors holds the token ids
    token_id: int
    count: int         # features, one token each, over the whole batch (without `padded`)
    padded: PaddedImages | None = None   # pixel_values padded per row: the count is read from them
    media: str = "image"

    def features(self, inputs: list[torch.Tensor]) -> tuple[int, str]:
        """How many features the step's pixel_values give, and how, in words."""
        if self.padded is None:
            return self.count, ""
        images = self.padded.real_images(inputs)
        if images == 0:   # transformers' vision tower cannot encode an empty batch of images
            raise InputMismatchError(
                f"the step's pixel_values hold only padding (all-zero) images ({self.module}): pass pixel_values "
                "only with a batch that holds an image, and none for a batch of text alone")
        per_image = self.padded.tokens_per_image
        return images * per_image, f" ({images} images encoded, {per_image} each; all-zero images are padding)"

    def check(self, inputs: list[torch.Tensor]) -> None:
        found = int((inputs[self.input] == self.token_id).sum())
        count, how = self.features(inputs)
        if found != count:
            media, pixels = self.media, MEDIA[self.media][0]
            raise InputMismatchError(
                f"input_ids hold {found} {media} tokens (id {self.token_id}), but the step's {pixels} give "
                f"{count} {media} features{how}, one per {media} token ({self.module}): give each {media} as many "
                f"{media} tokens as it has features (the model's processor expands its placeholder so), and pass "
                f"{pixels} for exactly the {media}s the ids hold")


@contextlib.contextmanager
def traced_inputs(tensors: list[torch.Tensor]):
    """In the traced forward: the model's input tensors, in order."""
    token = _TRACED_INPUTS.set(tensors)
    try:
        yield
    finally:
        _TRACED_INPUTS.reset(token)


# The methods that place image features in transformers' vision-language models: most check the
# placeholders' count in get_placeholder_mask; Idefics3 checks and scatters in inputs_merger.
_MERGERS = ("get_placeholder_mask", "inputs_merger")


def _mergers(module: nn.Module) -> list[str]:
    """The merging methods of a transformers module (most vision-language models have one)."""
    cls = type(module)
    if not cls.__module__.startswith("transformers."):
        return []
    return [m for m in _MERGERS if getattr(cls, m, None) is not None]


def _supported(module: nn.Module) -> bool:
    """The families held to parity with images (tests/e2e/test_vlm.py, test_vlm_families.py): LLaVA,
    Gemma 3, Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5. Others place their features
    otherwise (several media kinds, features added between decoder layers) and are not checked yet."""
    if getattr(getattr(module, "config", None), "image_token_id", None) is None:
        return False
    if pads_images(module) or keys_grids(module):
        return True
    cls = type(module)
    if getattr(cls, "get_placeholder_mask", None) is None:
        return False
    params = [p for p in inspect.signature(cls.get_placeholder_mask).parameters if p != "self"]
    return cls.__module__ in _CHECKED and params == _SIGNATURE


def _cross_attending(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """Models whose decoder attends to the image features in cross-attention layers (Mllama), with
    their vision model: (path, model, vision model)."""
    found: dict[int, tuple[str, nn.Module, nn.Module]] = {}
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        text = getattr(config, "text_config", None)
        vision = getattr(module, "vision_model", None)
        if getattr(text, "cross_attention_layers", None) and isinstance(vision, nn.Module):
            found.setdefault(id(vision), (name, module, vision))   # one patch per vision model
    return list(found.values())


def _inputs() -> list:
    return _TRACED_INPUTS.get() or []


@contextlib.contextmanager
def static_image_merge(model: nn.Module, real: list[torch.Tensor] | None = None,
                       grids: dict[str, GridConstants] | None = None):
    """While tracing `model`: its image-merging modules build the placeholder mask without reading
    a tensor's value (Idefics3-style ones encode their padded images at static shapes, see
    padded_images.py; Qwen2.5-VL's and Qwen3-VL's tower takes its image and video grids, read from
    `real`, the model's inputs as given, as constants, recorded in `grids`, see grid_constants.py and
    grid_media.py); yields the `ImageTokens` the trace records, one per module and kind of media."""
    found: dict[str, ImageTokens] = {}
    padded: dict[str, PaddedImages] = {}
    grids = {} if grids is None else grids
    patched = [(name, m) for name, m in model.named_modules() if _mergers(m)]

    def refuse(name: str, module: nn.Module):
        def merge(*args, **kwargs):
            raise CaptureError(f"{type(module).__name__} ('{name}') merges image features in a way megacompile does "
                               "not train yet: of the vision-language models, LLaVA, Gemma 3, Idefics3, SmolVLM, "
                               "Qwen2-VL, Qwen2.5-VL, Qwen3-VL and Qwen3.5 train with images (docs/families.md); "
                               "this model trains on text alone (no pixel_values)")
        return merge

    def refuse_cross_attention(name: str, module: nn.Module):
        def encode(*args, **kwargs):
            raise CaptureError(f"{type(module).__name__} ('{name}') reads its image features in cross-attention "
                               "layers, which megacompile does not train yet: the features would be read, with a "
                               "gradient, by several streamed decoder blocks, and the block chain carries a gradient "
                               "to one reader only (docs/families.md); this model trains on text alone (no "
                               "pixel_values)")
        return encode

    def placeholder_mask(name: str, module: nn.Module, input_ids, inputs_embeds, features, media: str = "image"):
        label = name or type(module).__name__
        if input_ids is None:
            raise CaptureError(f"{label} was given inputs_embeds with {media}s: megacompile places {media} features "
                               f"by the {media} tokens of input_ids; pass input_ids")
        index = next((i for i, t in enumerate(_inputs()) if t is input_ids), None)
        if index is None:
            raise CaptureError(f"the input_ids {label} places {media} features by are not one of the model's "
                               "inputs: pass the token ids to the model as input_ids")
        width = inputs_embeds.shape[-1]
        if features.numel() % width:
            raise CaptureError(f"{label}'s {media} features {tuple(features.shape)} do not split into tokens "
                               f"of width {width}")
        token_id = int(getattr(module.config, f"{media}_token_id"))
        count = 0 if name in padded else features.numel() // width
        found[name if media == "image" else f"{name}:{media}"] = ImageTokens(
            f"{type(module).__name__} at '{name}'", index, token_id, count, padded.get(name), media)
        return (input_ids == token_id).unsqueeze(-1).to(inputs_embeds.device)

    def methods(name: str, module: nn.Module) -> dict:
        if not _supported(module):
            # refused before its image encoder runs, which may read values (Idefics2 drops padding images)
            encoder = ["get_image_features"] if hasattr(type(module), "get_image_features") else []
            refused = _mergers(module) + encoder
            return {m: refuse(name, module) for m in refused}

        def get_placeholder_mask(input_ids, inputs_embeds, image_features):
            return placeholder_mask(name, module, input_ids, inputs_embeds, image_features)

        def inputs_merger(input_ids, inputs_embeds, image_hidden_states):
            features = image_hidden_states.to(inputs_embeds.device, inputs_embeds.dtype)
            mask = placeholder_mask(name, module, input_ids, inputs_embeds, features)
            return inputs_embeds.masked_scatter(mask, features)

        def media_mask(media, input_ids, inputs_embeds, features):
            return placeholder_mask(name, module, input_ids, inputs_embeds, features, media)

        own = {"get_placeholder_mask": get_placeholder_mask, "inputs_merger": inputs_merger}
        out = {m: own[m] for m in _mergers(module)}
        if hasattr(type(module), "get_image_features"):
            out["get_image_features"] = module.get_image_features
        if pads_images(module):
            out["get_image_features"] = static_image_features(name, module, _inputs, padded)
        if keys_grids(module):   # images and videos on grids (grid_media.py)
            tower = GridTower(name, module, _inputs, real or [], grids)
            out.update(GridMedia(name, module, tower, media_mask).methods())
        if "get_image_features" in out:
            out["get_image_features"] = _shape_checked(name, module, out["get_image_features"])
        return out

    installed = []
    try:
        for name, module in patched:
            for attr, fn in methods(name, module).items():
                setattr(module, attr, fn)
                installed.append((module, attr))
        for name, module, vision in _cross_attending(model):
            vision.forward = refuse_cross_attention(name, module)
            installed.append((vision, "forward"))
        yield found
    finally:
        for module, attr in installed:
            delattr(module, attr)   # back to the class's method


def expected_pixels(module: nn.Module) -> tuple[str, object] | None:
    """What pixel_values the module's vision tower takes, from its vision config: (in words, a
    test of a shape), or None when the config does not say."""
    vision = getattr(getattr(module, "config", None), "vision_config", None)
    if vision is None:
        return None
    if keys_grids(module):      # Qwen2.5-VL / Qwen3-VL: every image's patches, flattened
        patch = patch_width(vision)
        if patch is None:
            return None
        width, words = patch
        return f"[patches, {width}] ({words})", lambda s: len(s) == 2 and s[1] == width
    c, size = getattr(vision, "num_channels", 3), getattr(vision, "image_size", None)
    if not isinstance(size, int) or not isinstance(c, int):
        return None
    if pads_images(module):     # Idefics3 / SmolVLM: padded per row, images at most the tower's size
        return f"[rows, images, {c}, H, W] with H, W <= {size} (images padded per row)", \
            lambda s: len(s) == 5 and s[2] == c and s[3] <= size and s[4] <= size
    return f"[images, {c}, {size}, {size}]", lambda s: len(s) == 4 and tuple(s[1:]) == (c, size, size)


def _shape_checked(name: str, module: nn.Module, encode):
    """`encode` (get_image_features), refusing pixel_values of a shape the vision tower does not
    take before it runs: transformers' own failure inside the tower reads as a tracing failure."""
    expected = expected_pixels(module)
    if expected is None:
        return encode
    words, fits = expected

    def get_image_features(*args, **kwargs):
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        if isinstance(pixels, torch.Tensor) and not fits(tuple(pixels.shape)):
            raise InputMismatchError(
                f"pixel_values of shape {list(pixels.shape)} given to {type(module).__name__} ('{name}'), whose "
                f"vision tower takes {words}: make the pixels with the model's own image processor (its "
                "preprocessor_config.json), at the size of the model's vision_config")
        return encode(*args, **kwargs)
    return get_image_features
