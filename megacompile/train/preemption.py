"""Preemption: a scheduler's stop signal (SIGTERM from SLURM, Kubernetes or a spot instance's
notice; SIGUSR1 from SLURM's `--signal` before the time limit) ends a run at a step boundary.

The signal only sets a flag. The optimizer step in flight runs to its end (every micro-batch of
it: a step is never half-applied), the loop sees the flag, writes a checkpoint of that whole step
through the crash-safe checkpoint writer (io/checkpoint.py) and raises `Preempted`;
`megacompile train` prints where the checkpoint is and the command that resumes it, and exits
128 + the signal's number (143 for SIGTERM). A second stop signal while the step or the save
runs ends the process at once, as the signal does by default: the checkpoint writer leaves the
previous checkpoint committed whatever instant it is killed at.

For a loop of one's own:

    with megacompile.train.StopSignals() as stop:     # SIGTERM and SIGUSR1
        for batch in batches:
            engine.step(**batch)
            if stop.requested:
                engine.save_checkpoint(path)
                sys.exit(stop.exit_code)
"""
from __future__ import annotations

import signal
import threading

from ..errors import ArgumentError, MegacompileError

DEFAULT = ("SIGTERM", "SIGUSR1")
UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_names(value) -> list[str]:
    """run.yaml's `stop_signals`: a list (or comma-separated string) of signal names, checked."""
    if value is None:
        return []
    names = value.split(",") if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ArgumentError(f"stop_signals is a list of signal names, e.g. [SIGTERM, SIGUSR1] (or [] to die at "
                            f"once); got {value!r}")
    out = []
    for name in (n.strip().upper() for n in names if n.strip()):
        name = name if name.startswith("SIG") else "SIG" + name
        if name in UNCATCHABLE:
            raise ArgumentError(f"stop_signals: {name} cannot be caught by any process, so no checkpoint can be "
                                "written on it; give signals such as SIGTERM, SIGUSR1, SIGUSR2, SIGINT")
        if not hasattr(signal.Signals, name) or name.startswith("SIG_"):
            raise ArgumentError(f"stop_signals: {name} is no signal of this system; give names such as SIGTERM, "
                                "SIGUSR1, SIGUSR2, SIGINT")
        out.append(name)
    return list(dict.fromkeys(out))


class Preempted(MegacompileError):
    """A stop signal ended the run after a whole step; `checkpoint` holds that step (the one it
    resumed from when no step ran since; None when no step ran at all), `exit_code` is 128 + the
    signal's number."""

    def __init__(self, message: str, signum: int, checkpoint: str | None, step: int,
                 resume_overrides: list[str] = ()):
        super().__init__(message)
        self.signum, self.checkpoint, self.step = signum, checkpoint, step
        self.resume_overrides = list(resume_overrides)     # key=value the same command needs to resume

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """A context in which the signals `names` set `requested` (the first one's number) instead of
    ending the process; a second one ends it as the signal does by default. The handlers before
    it are put back on exit. Signals can only be caught in the main thread: in another one the
    context changes nothing (`active` is False)."""

    def __init__(self, names=DEFAULT):
        self.names = signal_names(list(names))
        self.requested: int | None = None
        self.active = False
        self._before: dict[int, object] = {}

    @property
    def name(self) -> str | None:
        return None if self.requested is None else signal.Signals(self.requested).name

    @property
    def exit_code(self) -> int | None:
        return None if self.requested is None else 128 + self.requested

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:     # asked twice: stop now, without waiting for the step
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested = signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in self.names:
                number = getattr(signal.Signals, name)
                self._before[number] = signal.signal(number, self._handle)
            self.active = bool(self.names)
        return self

    def __exit__(self, *exc) -> None:
        for number, before in self._before.items():
            signal.signal(number, before)
        self._before.clear()
        self.active = False


def resume_overrides(c, run_dir: str) -> list[str]:
    """The key=value arguments the same command needs to go on from the run folder's latest checkpoint."""
    return ([] if c.resume == "auto" else ["resume=auto"]) + ([] if c.run_dir else [f"run_dir={run_dir}"])


def stop(stop_signals: StopSignals, c, step: int, latest: tuple[int, str | None], save, run_dir: str) -> None:
    """At a step boundary, when a stop signal came: the whole step `step` saved (`save()` writes its
    checkpoint and returns the path) unless `latest`, the (step, path) of the newest checkpoint
    this run has written or resumed from, holds it already; then Preempted."""
    if stop_signals.requested is None:
        return
    checkpoint = latest[1] if latest[0] == step else save()
    again = resume_overrides(c, run_dir)
    where = (f"its checkpoint is {checkpoint}" if checkpoint
             else "no step ran, so there is nothing to save")
    message = (f"{stop_signals.name} at step {step}: stopped after the whole step; {where}; the same command"
               + (f" with {' '.join(again)}" if again else "") + " resumes it exactly")
    raise Preempted(message, stop_signals.requested, checkpoint, step, again)
