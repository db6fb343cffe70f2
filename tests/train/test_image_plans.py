"""The engine's RetraceWarning in a run with images: quiet, and said once in the run's words where
images of several sizes (Qwen's grids) keep making new plans; never for a fixed-size processor's
pixel_values, whose shapes change only with the number of images."""
from __future__ import annotations

import warnings

import pytest
import torch

from megacompile.errors import RetraceWarning
from megacompile.train.data.image_plans import FIRST, ImagePlans, Watched


def _grids(*sizes) -> dict:
    return {"input_ids": torch.zeros(1, 8, dtype=torch.long), "image_grid_thw": torch.tensor(sizes)}


def _engine_warns(**inputs):
    warnings.warn("Pad inputs to a few fixed lengths", RetraceWarning)
    return inputs


def test_images_of_several_sizes_are_said_once_in_the_runs_words_and_the_engines_warning_is_quiet():
    said = []
    plans = ImagePlans(said.append)
    sets = [_grids([1, 4, 4]), _grids([1, 8, 6]), _grids([1, 4, 4], [1, 8, 6]), _grids([1, 2, 36])]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)
        for inputs in sets[:FIRST - 1] + sets[:2]:      # sets met again are no new plans
            with plans.over(inputs):
                _engine_warns()
        assert not said
        Watched(_engine_warns, plans)(**sets[3])        # an evaluation's forward
        for inputs in sets:
            with plans.over(inputs):
                _engine_warns()
    assert len(said) == 1, said
    assert said[0].startswith("the images come in 3 sizes so far (patch grids 1x2x36, 1x4x4, 1x8x6)")
    assert "image_max_pixels" in said[0] and "Pad inputs" not in said[0]


def test_a_fixed_size_processors_micro_batches_say_nothing_and_other_warnings_pass():
    said = []
    plans = ImagePlans(said.append)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RetraceWarning)
        for n in range(1, 2 * FIRST):
            with plans.over({"input_ids": torch.zeros(1, 8), "pixel_values": torch.zeros(n, 3, 16, 16)}):
                _engine_warns()
    assert not said
    with pytest.warns(UserWarning, match="another"), plans.over(_grids([1, 4, 4])):
        warnings.warn("another", UserWarning)
