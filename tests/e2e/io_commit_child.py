"""A save_checkpoint to a fixed path that already holds a checkpoint, SIGKILLed at one point of
its commit (test_io_crash.py): before its first rename (the new folder written and committed
beside the path), between its two renames (the old one moved aside, nothing at the path), before
the old one's removal, or mid-way through it; `none` lets it finish.

    python -m tests.e2e.io_commit_child FOLDER rename-1|rename-2|rmtree|mid-rmtree|none
"""
from __future__ import annotations

import os
import shutil
import signal
import sys

import torch

import megacompile
from tests import models


def main(folder: str, point: str) -> None:
    torch.set_num_threads(1)
    engine = megacompile.compile(models.NanoGPT(vocab=96, d=32, layers=2), 1.0, device="cpu")
    rename, rmtree, renames = os.rename, shutil.rmtree, [0]

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def renaming(src, dst):
        renames[0] += 1
        if point == f"rename-{renames[0]}":
            die()
        rename(src, dst)

    def removing(path, *args, **kwargs):
        if renames[0] == 2 and point == "rmtree":
            die()
        if renames[0] == 2 and point == "mid-rmtree":
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            die()
        rmtree(path, *args, **kwargs)
    os.rename, shutil.rmtree = renaming, removing
    engine.save_checkpoint(os.path.join(folder, "ck"), extra={"v": 2})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
