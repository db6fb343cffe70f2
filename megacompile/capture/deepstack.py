"""Qwen3-VL's deepstack: features of some tower layers added to the hidden states of the image
tokens after the first decoder layers, folded into the blocks they follow.

Qwen3-VL's vision tower runs a merger (a norm and an MLP) over the output of some of its layers
(`deepstack_visual_indexes`), and its text model adds the k-th merger's features to the hidden
states of the image tokens after decoder layer k (`_deepstack_process`, a boolean-mask
`index_put`). Both run between two blocks of one stack, where the stages have no room, so each
is folded into the block it follows (an `Attachment` of the block's call):

- a tower layer followed by a merger returns the merger's output as an extra output of its
  block, after its own (the merger's parameters join the block's stage);
- a decoder layer followed by features takes the image-token mask and the features as extra
  inputs and adds them itself, `h + zeros_like(h).masked_scatter(mask, features)`: the values the
  model's `index_put` gives (adding zero changes nothing), at static shapes.

Between the two, the bridge splits and joins the features per image as the model does. Their
gradients come back the same way, around the blocks in between: one row of the decoder's width
per image token, held on the device from the decoder block's backward to the tower block's.
Whether the model's get_image_features hands its forward the deepstack features split per image
(transformers 5.24, whose forward joins them again) or whole (5.17, whose forward reads them as
they come) is read off the installed method (`splits_per_image`); the capture's own encoder
hands them on the same way.
"""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.func import functional_call

from ..errors import CaptureError

LOCAL = "deepstack"      # the prefix of an attached merger's parameters inside its block's stage


@dataclass(eq=False)
class Attachment:
    """Work the model runs on one block's output before the next block, folded into the block."""
    kind: str                         # "merger": also return merger(h); "add": h + features at the mask
    merger: nn.Module | None = None   # kind "merger": the module
    path: str = ""                    # its module path

    @property
    def key(self) -> str:
        """What blocks sharing a template must share."""
        return self.kind

    def param_names(self) -> list[tuple[str, str]]:
        """(name inside the block's stage, the model's name) of the merger's parameters and buffers."""
        if self.merger is None:
            return []
        own = [n for n, _ in self.merger.named_parameters()] + [n for n, _ in self.merger.named_buffers()]
        return [(f"{LOCAL}.{n}", f"{self.path}.{n}") for n in own]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The merger's parameters and buffers as the module holds them now, by their names in the stage."""
        if self.merger is None:
            return {}
        own = dict(self.merger.named_parameters()) | dict(self.merger.named_buffers())
        return {local: own[local[len(LOCAL) + 1:]] for local, _ in self.param_names()}

    def apply(self, out: Any, params: list[torch.Tensor] | None, extra: list[torch.Tensor]) -> tuple[Any, list]:
        """The block's output after the attached work, and the outputs the work adds; `params`: the
        merger's tensors in param_names' order (None: as the module holds them); `extra`: the call's
        extra inputs (kind "add": the image-token mask and the features)."""
        if not isinstance(out, torch.Tensor):
            raise CaptureError(f"a Qwen3-VL layer followed by deepstack work returned {type(out).__name__}, not "
                               "a tensor: megacompile folds the deepstack into layers that return their hidden states")
        if self.kind == "merger":
            if params is None:
                return out, [self.merger(out)]
            own = [local[len(LOCAL) + 1:] for local, _ in self.param_names()]
            return out, [functional_call(self.merger, dict(zip(own, params)), (out,), strict=False)]
        mask, features = extra
        spread = mask[..., None].expand_as(out).to(out.device)
        return out + torch.zeros_like(out).masked_scatter(spread, features.to(out.device, out.dtype)), []


class _TwoImages:
    """Stands in for a Qwen3-VL vision tower: two images of one feature each, one deepstack merger."""
    dtype = torch.float32
    spatial_merge_size = 1

    def __call__(self, pixel_values, grid_thw=None, **kwargs):
        return types.SimpleNamespace(pooler_output=torch.zeros(2, 1), deepstack_features=[torch.zeros(2, 1)])


@functools.lru_cache(maxsize=None)
def splits_per_image(get_image_features: Callable) -> bool | None:
    """Whether `get_image_features` (a Qwen3-VL model class's) returns the deepstack features split
    per image, as it returns the pooled ones (True), or each merger's as one tensor (False): found
    by running it on a stand-in tower; None where it cannot run there."""
    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        try:
            out = get_image_features(types.SimpleNamespace(visual=_TwoImages()), torch.zeros(2, 1),
                                     torch.ones(2, 3, dtype=torch.long), return_dict=True)
            features = out.deepstack_features[0]
        except Exception:  # noqa: BLE001 - a method that reads more of its model is not one known
            return None
    return not isinstance(features, torch.Tensor)


def _deepstack_modules(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """The vision model holding deepstack mergers and the text model adding their features."""
    vision = next((m for m in model.modules() if hasattr(m, "deepstack_merger_list")
                   and hasattr(m, "deepstack_visual_indexes") and hasattr(m, "blocks")), None)
    text = next((m for m in model.modules() if hasattr(type(m), "_deepstack_process")), None)
    return vision, text


def merger_lists(model: nn.Module) -> set[str]:
    """The module paths of the deepstack merger lists: attached to tower layers, not a stack."""
    vision, _ = _deepstack_modules(model)
    if vision is None:
        return set()
    return {n for n, m in model.named_modules() if m is vision.deepstack_merger_list}


class Deepstack:
    """While the top-level graph is traced: which block calls carry an attachment, the extra inputs
    the text model hands its first layers, and the merger outputs the tower's blocks returned."""

    def __init__(self, model: nn.Module, blocks: tuple[nn.Module, ...]):
        self.attached: dict[int, Attachment] = {}
        self.pending: dict[int, list[torch.Tensor]] = {}     # block index -> [mask, features]
        self.returned: list[tuple[torch.Tensor, torch.Tensor]] = []   # (a block's output, its merger's)
        vision, self.text = _deepstack_modules(model)
        self._index = {id(b): i for i, b in enumerate(blocks)}
        paths = {id(m): n for n, m in model.named_modules()}
        if vision is not None:
            for k, layer in enumerate(vision.deepstack_visual_indexes):
                block = vision.blocks[layer]
                if id(block) in self._index:
                    merger = vision.deepstack_merger_list[k]
                    self.attached[self._index[id(block)]] = Attachment("merger", merger, paths[id(merger)])
        self.vision = vision

    def for_call(self, index: int) -> tuple[Attachment | None, list[torch.Tensor]]:
        """The attachment of block `index`'s call, and its extra inputs."""
        if index in self.pending:
            return Attachment("add"), self.pending.pop(index)
        return self.attached.get(index), []

    def hand_over(self, out: torch.Tensor, added: list[torch.Tensor]) -> None:
        if added:
            self.returned.append((out, added[0]))

    def merged(self, merger: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """What a deepstack merger gives for `x`: the output of the block call that ran it (on
        anything else, and inside a block's own run, the merger itself)."""
        for k, (out, feature) in enumerate(self.returned):
            if out is x:
                del self.returned[k]
                return feature
        return type(merger).forward(merger, x)

    @contextlib.contextmanager
    def installed(self):
        """The text model hands its deepstack inputs to the leaves instead of adding them itself;
        the mergers return what their tower blocks computed."""
        patched: list[nn.Module] = []
        try:
            if self.vision is not None:
                for merger in self.vision.deepstack_merger_list:
                    merger.forward = lambda x, _m=merger: self.merged(_m, x)
                    patched.append(merger)
            if self.text is not None:
                self.text.forward = self._text_forward
                patched.append(self.text)
            yield self
        finally:
            for module in patched:
                del module.forward   # back to the class's forward
            self.pending.clear()

    def _text_forward(self, *args, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs):
        text = self.text
        if deepstack_visual_embeds is not None:
            layers = list(text.layers)
            for j, features in enumerate(deepstack_visual_embeds[:len(layers)]):
                index = self._index.get(id(layers[j]))
                if index is None:
                    raise CaptureError(f"decoder layer {j} of {type(text).__name__} adds deepstack features but is "
                                       "not one of the blocks megacompile streams")
                self.pending[index] = [visual_pos_masks, features]
        out = type(text).forward(text, *args, visual_pos_masks=None, deepstack_visual_embeds=None, **kwargs)
        if self.pending:
            raise CaptureError(f"{type(text).__name__} did not call the decoder layers its deepstack features "
                               "follow: megacompile adds them inside those layers' blocks")
        return out


@contextlib.contextmanager
def deepstack_in_blocks(model: nn.Module, blocks: tuple[nn.Module, ...]):
    """While the top-level graph is traced: yields the model's Deepstack (none of its own: empty)."""
    with Deepstack(model, blocks).installed() as deepstack:
        yield deepstack
