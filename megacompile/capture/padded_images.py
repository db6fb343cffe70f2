"""Images padded per row (Idefics3, SmolVLM), encoded at static shapes.

Idefics3's processor pads pixel_values to [rows, most images in a row, 3, H, W]: a row with fewer
images gets all-zero images. transformers' `get_image_features` drops those before the vision
tower (`pixel_values[real_images_inds]`, a shape read from the pixels' values) and splits the
features by each row's count (`.tolist()`); neither traces. Every image of the tensor is one the
tower could encode, so while tracing the static version encodes them all (a padding image with an
all-ones pixel mask, so that it attends to something and stays finite), then moves the real
images' features ahead of the padding ones, in row order, by a stable sort on "is padding". The
merge (`masked_scatter` over the image tokens) takes from its source, in order, as many features as
there are image tokens, so it takes exactly the real images'; the padding images' features get a
zero gradient, and the real ones match eager's (each image is encoded on its own).

How many features a step's pixel_values give is still a value (its real images times the tokens
per image), so the capture records where the pixels are and the tokens per image
(`PaddedImages`), and the engine counts both before each step (image_tokens.ImageTokens).
SmolVLM keeps one all-zero image when a batch has none; so does the count. The tower's embeddings
place each patch's position at static shapes too (patch_positions.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import CaptureError
from .patch_positions import static_positions

# The module classes whose get_image_features drop padding images, and whether they keep one
# (all-zero) image when a batch has none.
_FAMILIES = {("transformers.models.idefics3.modeling_idefics3", "Idefics3Model"): False,
             ("transformers.models.smolvlm.modeling_smolvlm", "SmolVLMModel"): True}


@dataclass(frozen=True)
class PaddedImages:
    """pixel_values of [rows, images, 3, H, W], an all-zero image being padding."""
    input: int              # which of the model's input tensors holds them
    tokens_per_image: int
    keeps_one: bool         # a batch without a real image counts its first (all-zero) one

    def real_images(self, inputs: list[torch.Tensor]) -> int:
        pixels = inputs[self.input]
        real = int((pixels.reshape(-1, pixels[0, 0].numel()) != 0).any(dim=1).sum())
        return max(real, 1) if self.keeps_one else real


def pads_images(module: nn.Module) -> bool:
    cls = type(module)
    return (cls.__module__, cls.__name__) in _FAMILIES


def real_first(pixel_values: torch.Tensor, keeps_one: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of the flattened images are real (not all zeros), and an order that puts them first."""
    flat = pixel_values.reshape(pixel_values.shape[0] * pixel_values.shape[1], -1)
    real = (flat != 0).any(dim=1)
    if keeps_one:
        first = torch.arange(real.shape[0], device=real.device) == 0
        real = real | (first & ~real.any())
    return real, torch.argsort((~real).to(torch.uint8), stable=True)


def static_image_features(name: str, module: nn.Module, inputs, found: dict[str, PaddedImages]):
    """A get_image_features for `module` (an Idefics3-style model) that encodes every image of the
    padded pixel_values and returns the features real images first, flattened to [tokens, width];
    records the `PaddedImages` it read in found[name]. inputs(): the model's traced input tensors."""
    keeps_one = _FAMILIES[(type(module).__module__, type(module).__name__)]

    def get_image_features(pixel_values, pixel_attention_mask=None, **kwargs):
        index = next((i for i, t in enumerate(inputs()) if t is pixel_values), None)
        if index is None or pixel_values.dim() != 5:
            raise CaptureError(f"{type(module).__name__} ('{name}') was given pixel_values that are not the model's "
                               "[rows, images, 3, height, width] input: pass pixel_values to the model as its "
                               "processor writes them")
        rows, most = pixel_values.shape[:2]
        real, order = real_first(pixel_values, keeps_one)
        images = pixel_values.to(dtype=module.dtype).reshape(rows * most, *pixel_values.shape[2:])
        if pixel_attention_mask is None:
            pixel_mask = torch.ones((rows * most, *images.shape[2:]), dtype=torch.bool, device=images.device)
        else:
            pixel_mask = pixel_attention_mask.reshape(rows * most, *pixel_attention_mask.shape[2:])
            pixel_mask = torch.where(real[:, None, None], pixel_mask, torch.ones_like(pixel_mask))
        patch = module.config.vision_config.patch_size
        patches = pixel_mask.unfold(1, patch, patch).unfold(2, patch, patch)
        patch_mask = (patches.sum(dim=(-1, -2)) > 0).bool()
        kwargs = {**kwargs, "return_dict": True}
        with static_positions(module.vision_model.embeddings, f"{name}.vision_model.embeddings".lstrip(".")):
            out = module.vision_model(pixel_values=images, patch_attention_mask=patch_mask, **kwargs)
        features = module.connector(out.last_hidden_state)
        found[name] = PaddedImages(index, features.shape[1], keeps_one)
        out.pooler_output = features[order].reshape(-1, features.shape[-1])
        return out
    return get_image_features
