"""A training run that test_io_crash.py kills at random moments: it resumes from the latest
checkpoint that loads, trains to the last step with dropout and a torch LR scheduler, and
saves a checkpoint after every step (keep_last=2). Every line it logs is flushed at once:

    resumed STEP | fresh          where it starts, once traced and loaded
    loss STEP HEX                 each step's loss, as float.hex (bits, not digits)
    refused NAME                  a checkpoint that did not load (an unfinished save)
    saving STEP / saved STEP      around each save

    python -m tests.e2e.io_crash_child RUN_DIR STEPS [SLOW_SAVE_SECONDS]   (from the repository root)
"""
from __future__ import annotations

import os
import sys
import time

import torch

import megacompile
from megacompile.errors import WeightsFileError
from tests import models


def main(run_dir: str, steps: int, slow: float) -> None:
    torch.set_num_threads(1)
    if slow:
        # Widen the save so that a random kill often lands inside one: each file's fsync waits.
        import megacompile.io.durable as files
        fsync = files.fsync_file

        def slow_fsync(path):
            time.sleep(slow)
            fsync(path)
        files.fsync_file = slow_fsync
    log = open(os.path.join(run_dir, "log"), "a", buffering=1)
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=2, dropout=0.1)
    engine = megacompile.compile(model, 1.0, device="cpu", optimizer=megacompile.AdamW(lr=3e-3, max_grad_norm=1.0))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(engine.torch_optimizer, T_max=steps)
    start = 0
    saved = sorted((d for d in os.listdir(run_dir) if d.startswith("step-")), key=lambda d: int(d[5:]))
    for name in reversed(saved):
        try:
            start = engine.load_checkpoint(os.path.join(run_dir, name))["next"]
        except WeightsFileError:
            log.write(f"refused {name}\n")
            continue
        break
    ids = models.batch(96, 2, 16)
    engine.prepare(idx=ids, targets=ids)      # trace and plan (and stream the checkpoint in) first
    log.write(f"resumed {start}\n" if start else "fresh\n")
    for step in range(start, steps):
        ids = models.batch(96, 2, 16, seed=step)
        loss = engine.step(idx=ids, targets=ids)
        scheduler.step()
        log.write(f"loss {step} {float(loss).hex()}\n")
        log.write(f"saving {step}\n")
        engine.save_checkpoint(os.path.join(run_dir, f"step-{step}"), extra={"next": step + 1}, keep_last=2)
        log.write(f"saved {step}\n")
    log.write("done\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
