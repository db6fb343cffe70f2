"""The engine's note of inputs that keep changing (RetraceWarning), said in a train run's words for
micro-batches with images.

The engine plans one program per input signature and warns, in its Python API's words ("pad
inputs to a few fixed lengths"), once it has met four. A run's micro-batches with images change
their inputs in two ways. A fixed-size processor (LLaVA, Gemma 3, Idefics3) makes every image the
same pixels, so pixel_values changes only with the number of images a micro-batch holds: the run's
own few shapes, nothing to say. Qwen2.5-VL's and Qwen3-VL's grids are constants of a capture
(docs/families.md), so each micro-batch whose images' grids were not met together before is
captured and planned anew: that is said once, with what run.yaml can do about it.
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager

from ...errors import RetraceWarning

GRIDS = ("image_grid_thw", "video_grid_thw")        # what Qwen's processors write per image (video)
FIRST = 4           # new grid sets before the note: the engine's first warning (planner/cache.py)


def _note(text: str) -> None:
    print(f"  note           {text}", flush=True)


class ImagePlans:
    """The grids a run's micro-batches brought (its steps' and its evaluations'), counted; the
    engine's warning quiet over them (over()), and the note said once (said)."""

    def __init__(self, say=_note):
        self.say, self.sets, self.sizes, self.said = say, set(), set(), False
        self.seconds = 0.0      # the new sets' micro-batches, their capture and plan with their run

    @contextmanager
    def over(self, inputs: dict, kind: str = "step"):
        """The engine's RetraceWarning quiet while it runs a micro-batch of `inputs` (`kind`: step,
        or eval: its forward is a program of its own); then the note, where their grids make it due."""
        grids = tuple((name, tuple(tuple(int(x) for x in row) for row in inputs[name].tolist()))
                      for name in GRIDS if name in inputs)
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RetraceWarning)
            yield
        if not grids or (kind, grids) in self.sets:
            return
        self.seconds += time.perf_counter() - start
        self.sets.add((kind, grids))
        self.sizes.update(size for _, rows in grids for size in rows)
        if not self.said and len(self.sets) >= FIRST:
            self.said = True
            self.say(f"the images come in {len(self.sizes)} sizes so far (patch grids "
                     f"{', '.join('x'.join(map(str, s)) for s in sorted(self.sizes)[:6])}"
                     f"{', ...' if len(self.sizes) > 6 else ''}), and each micro-batch whose sizes were not met "
                     f"together before is captured and planned anew ({len(self.sets)} so far, "
                     f"{self.seconds / len(self.sets):.1f} s each with its run): "
                     "resize the images beforehand to one size (e.g. 448 x 448 px), or, for images of one aspect "
                     "ratio, give image_min_pixels the value of image_max_pixels, so that the sizes repeat")


class Watched:
    """An engine whose forward calls (an evaluation's) run under `plans`.over, as kind eval."""

    def __init__(self, engine, plans: ImagePlans):
        self.engine, self.plans = engine, plans

    def __call__(self, **inputs):
        with self.plans.over(inputs, "eval"):
            return self.engine(**inputs)

    def __getattr__(self, name):
        return getattr(self.engine, name)
