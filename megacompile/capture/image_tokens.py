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
mismatch is our InputMismatchError, as eager transformers would refuse it.
"""
from __future__ import annotations

import contextlib
import inspect
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import CaptureError, InputMismatchError

# The model's input tensors as the trace sees them (top.py sets it in the traced forward), to name
# the input a module's input_ids came from.
_TRACED_INPUTS: ContextVar[list | None] = ContextVar("megacompile_traced_inputs", default=None)
_SIGNATURE = ["input_ids", "inputs_embeds", "image_features"]
_CHECKED = ("transformers.models.llava.modeling_llava",)


@dataclass(frozen=True)
class ImageTokens:
    """A step's image placeholder tokens must number the image features its pixel_values give."""
    module: str        # the module that merges them, in words ("LlavaModel at 'model'")
    input: int         # which of the model's input tensors holds the token ids
    token_id: int
    count: int         # image features, one token each, over the whole batch

    def check(self, inputs: list[torch.Tensor]) -> None:
        found = int((inputs[self.input] == self.token_id).sum())
        if found != self.count:
            raise InputMismatchError(
                f"input_ids hold {found} image tokens (id {self.token_id}), but the step's pixel_values give "
                f"{self.count} image features, one per image token ({self.module}): give each image as many image "
                "tokens as it has features (the model's processor expands its placeholder so), and pass "
                "pixel_values for exactly the images the ids hold")


@contextlib.contextmanager
def traced_inputs(tensors: list[torch.Tensor]):
    """In the traced forward: the model's input tensors, in order."""
    token = _TRACED_INPUTS.set(tensors)
    try:
        yield
    finally:
        _TRACED_INPUTS.reset(token)


def _merges_images(module: nn.Module) -> bool:
    """A transformers module with a placeholder check (most vision-language models have one)."""
    return (getattr(type(module), "get_placeholder_mask", None) is not None
            and type(module).__module__.startswith("transformers."))


def _supported(module: nn.Module) -> bool:
    """The families held to parity with images (tests/e2e/test_vlm.py): LLaVA. Others place their
    features otherwise (several media kinds, bidirectional image attention) and are not checked yet."""
    cls = type(module)
    params = [p for p in inspect.signature(cls.get_placeholder_mask).parameters if p != "self"]
    return (cls.__module__ in _CHECKED and params == _SIGNATURE
            and getattr(getattr(module, "config", None), "image_token_id", None) is not None)


@contextlib.contextmanager
def static_image_merge(model: nn.Module):
    """While tracing `model`: its image-merging modules build the placeholder mask without reading
    a tensor's value; yields the list of `ImageTokens` the trace records, one per module."""
    found: dict[str, ImageTokens] = {}
    patched = [(name, m) for name, m in model.named_modules() if _merges_images(m)]

    def refuse(name: str, module: nn.Module):
        def get_placeholder_mask(*args, **kwargs):
            raise CaptureError(f"{type(module).__name__} ('{name}') merges image features in a way megacompile does "
                               "not train yet: of the vision-language models, LLaVA trains with images "
                               "(docs/families.md); this model trains on text alone (no pixel_values)")
        return get_placeholder_mask

    def make(name: str, module: nn.Module):
        if not _supported(module):
            return refuse(name, module)

        def get_placeholder_mask(input_ids, inputs_embeds, image_features):
            if input_ids is None:
                raise CaptureError(f"{name or type(module).__name__} was given inputs_embeds with images: megacompile "
                                   "places image features by the image tokens of input_ids; pass input_ids")
            inputs = _TRACED_INPUTS.get() or []
            index = next((i for i, t in enumerate(inputs) if t is input_ids), None)
            if index is None:
                raise CaptureError(f"the input_ids {name or type(module).__name__} places image features by are "
                                   "not one of the model's inputs: pass the token ids to the model as input_ids")
            width = inputs_embeds.shape[-1]
            if image_features.numel() % width:
                raise CaptureError(f"{name or type(module).__name__}'s image features {tuple(image_features.shape)} "
                                   f"do not split into tokens of width {width}")
            token_id = int(module.config.image_token_id)
            found[name] = ImageTokens(f"{type(module).__name__} at '{name}'", index, token_id, image_features.numel() // width)
            return (input_ids == token_id).unsqueeze(-1).to(inputs_embeds.device)
        return get_placeholder_mask

    try:
        for name, module in patched:
            module.get_placeholder_mask = make(name, module)
        yield found
    finally:
        for _, module in patched:
            del module.get_placeholder_mask   # back to the class's method
