"""`log: [wandb]`: each step's scalars (the TensorBoard tags) in a Weights & Biases run whose files
live in the run folder (RUN/wandb/), its config the run's settings.

Mode: WANDB_MODE when it is set (online, offline, disabled), else online when an API key is
configured (WANDB_API_KEY, or a ~/.netrc entry for the W&B host, as `wandb login` writes),
else offline, with a note: a run never stops at a login prompt, and `wandb sync` uploads an
offline run later. The run id is kept in RUN/wandb-run-id: a resumed run continues the same W&B
run (resume="allow"). W&B cannot take back steps it has logged, so the steps a resume trains
again (those after its checkpoint) keep their first values there, while log.csv and TensorBoard
hold the new ones.
"""
from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

from ..io import durable

ID_FILE = "wandb-run-id"
DEFAULT_PROJECT = "megacompile"


class WandbLog:
    def __init__(self, run_dir: str, settings: dict, resume_step: int):
        import wandb
        id_path = os.path.join(run_dir, ID_FILE)
        run_id = None
        if resume_step > 0 and os.path.isfile(id_path):
            with open(id_path) as f:
                run_id = f.read().strip() or None
        mode = None if os.environ.get("WANDB_MODE") else ("online" if api_key_configured() else "offline")
        if mode == "offline":
            print(f"  wandb          no API key (WANDB_API_KEY or `wandb login`): logging offline in "
                  f"{os.path.join(run_dir, 'wandb')}; `wandb sync` uploads it", flush=True)
        self.run = wandb.init(project=settings.get("wandb_project") or os.environ.get("WANDB_PROJECT")
                              or DEFAULT_PROJECT, name=settings.get("name"), dir=run_dir, config=settings,
                              mode=mode, id=run_id, resume="allow" if run_id else None)
        if self.run.id != run_id:
            durable.replace_text(id_path, self.run.id)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def api_key_configured() -> bool:
    """An API key in the environment, or in the netrc entry of the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
