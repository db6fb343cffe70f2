"""One torchrun rank: trains a small model on the cpu backend and writes what its host AdamW ran on
(test_torchrun_host_threads.py starts it)."""
from __future__ import annotations

import json
import os
import sys

import torch

import megacompile
from megacompile.optim import fused_adamw
from tests import models


def main(out: str) -> None:
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=256, layers=1)    # a block of 786k params: 12 chunks of 64K
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-3))
    ids = models.batch(96, 2, 16, seed=0)
    engine.step(idx=ids, targets=ids)
    engine.synchronize()
    with open(out, "w") as f:
        json.dump({"omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                   "local_world_size": os.environ.get("LOCAL_WORLD_SIZE"),
                   "compute_threads": torch.get_num_threads(),
                   "record": engine.last_step.host_threads,
                   "kernel": fused_adamw.last_threads(),
                   "kernel_backend": fused_adamw.backend()}, f)
    engine.close()


if __name__ == "__main__":
    main(sys.argv[1])
