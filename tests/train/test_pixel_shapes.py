"""pixel_values of a shape the vision tower does not take are refused before the tower runs,
naming the shape given and the one its vision config takes (not as a failure to trace)."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.errors import InputMismatchError
from tests.vlm_families import batch, model

SHAPES = {"gemma3": (r"\[3, 3, 20, 20\]", r"\[images, 3, 16, 16\]"),
          "idefics3": (r"\[2, 2, 3, 20, 20\]", r"\[rows, images, 3, H, W\] with H, W <= 16"),
          "qwen2_5_vl": (r"\[40, 88\]", r"\[patches, 96\] \(3 channels x 2 frames x 4 x 4 pixels a patch\)")}


@pytest.mark.parametrize("family", sorted(SHAPES))
def test_pixel_values_of_another_shape_are_refused_naming_both_shapes(family):
    inputs = batch(family, images=(1, 2))
    pixels = inputs["pixel_values"]
    if family == "qwen2_5_vl":
        inputs["pixel_values"] = pixels[:, :-8]                        # patches 8 values short
    else:                                                              # images of 20 x 20 pixels, not 16 x 16
        flat = torch.nn.functional.interpolate(pixels.flatten(0, -4), size=(20, 20))
        inputs["pixel_values"] = flat.reshape(*pixels.shape[:-2], 20, 20)
    given, taken = SHAPES[family]
    engine = megacompile.compile(model(family), hbm_budget=1.0, device="cpu")
    with pytest.raises(InputMismatchError, match=rf"pixel_values of shape {given} given to \w+ \('model'\), whose "
                                                 rf"vision tower takes {taken}"):
        engine.step(**inputs)
