"""training_args.yaml in the run folder: the run's settings as given (its run.yaml with the
command's key=value overrides laid over it, paths made absolute: config.py's _given, the run's
`given`), as LlamaFactory leaves training_args.yaml in output_dir. Written as the run starts
training (a resumed run's replaces it); `megacompile export` reads the run back from it
(checkpoint_export.py), so a checkpoint exports without its run.yaml at hand."""
from __future__ import annotations

import os

from .stages.stage import CHECKPOINTS

NAME = "training_args.yaml"
# The first line of the file a run writes: a training_args.yaml without it is the user's own (the
# run.yaml this run was started from, kept in its output_dir, say) and is never replaced.
MARK = "# megacompile train: this run's settings as given (overrides laid over, paths absolute)\n"


def write(c, run_dir: str) -> None:
    import yaml
    if c.given is None:     # a RunConfig made in code, not by load()
        return
    path = os.path.join(run_dir, NAME)
    text = MARK + yaml.safe_dump(c.given, sort_keys=False)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            found = f.read()
        if found == text or not found.startswith(MARK):     # the same settings, or the user's own file
            return
    from ..io import durable
    durable.replace_text(path, text)


def beside(checkpoint: str) -> str | None:
    """The training_args.yaml of the run a checkpoint (RUN/checkpoints/step-NNNNNN) belongs to."""
    folder = os.path.dirname(os.path.abspath(checkpoint))
    if os.path.basename(folder) != CHECKPOINTS:
        return None
    path = os.path.join(os.path.dirname(folder), NAME)
    return path if os.path.isfile(path) else None
