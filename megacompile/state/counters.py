"""The run's counters: what a checkpoint's manifest carries besides tensors and settings, and
what a step changes besides the masters.

They follow torch.distributed.checkpoint's Stateful protocol: `state_dict()` is what a checkpoint
writes (plain values, copied), `load_state_dict(values)` takes back what a checkpoint read. The
checkpoint formats name them their own way (io/run_state.py maps the manifest's keys); a format
that kept fewer of them hands back fewer, and the others keep their values.
"""
from __future__ import annotations

import uuid

from ..errors import MegacompileError

# What state_dict() holds, in the order the manifest writes them.
SAVED = ("run_id", "steps_done", "micro_batches", "skipped_steps", "missed_steps")


class Counters:
    def __init__(self):
        # Names the run in its checkpoints' manifests: keep_last rotates only this run's. A
        # load_checkpoint takes over the saved run's, so a resumed run goes on rotating its own.
        self.run_id = uuid.uuid4().hex
        self.steps_done = 0          # optimizer steps
        self.micro_batches = 0       # step() calls that committed
        self.skipped_steps = 0       # steps dropped for an inf or NaN loss or gradient
        # Per trainable parameter, the optimizer steps that gave it no gradient (absent: none): its
        # own AdamW count is steps_done less these. The host state holds this very dict and counts
        # into it at each update, so it is only ever changed in place.
        self.missed_steps: dict[str, int] = {}
        # Loads of weights into this process's state (a checkpoint, a state_dict part): with
        # steps_done, what tells the module's own tensors are stale (io/model_params.py). Not
        # saved: it counts this process's loads, not the run's.
        self.loads = 0

    def state_dict(self) -> dict:
        return {"run_id": self.run_id, "steps_done": self.steps_done, "micro_batches": self.micro_batches,
                "skipped_steps": self.skipped_steps, "missed_steps": dict(self.missed_steps)}

    def load_state_dict(self, values: dict) -> None:
        unknown = sorted(set(values) - set(SAVED))
        if unknown:
            raise MegacompileError(f"the run's counters are {', '.join(SAVED)}; got {', '.join(unknown)}")
        for key in ("run_id", "steps_done", "micro_batches", "skipped_steps"):
            if key in values:
                setattr(self, key, values[key])
        if "missed_steps" in values:
            self.missed_steps.clear()
            self.missed_steps.update(values["missed_steps"])

    @property
    def weights_version(self) -> tuple[int, int]:
        """What changes whenever the masters do: an optimizer step or a load."""
        return self.steps_done, self.loads

    def committed(self, micro_batches: int, step_ends: bool) -> None:
        self.micro_batches += micro_batches
        if step_ends:
            self.steps_done += 1

    def skipped(self, dropped_micro_batches: int) -> None:
        """A step dropped: it counts as skipped, and the micro-batches of it already committed
        (their gradient sum dropped with it) no longer count."""
        self.micro_batches -= dropped_micro_batches
        self.skipped_steps += 1

    def loaded(self) -> None:
        self.loads += 1
