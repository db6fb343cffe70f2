"""Under torchrun the host AdamW runs on the rank's share of the cores, not on the one thread
OMP_NUM_THREADS=1 would give it (torchrun sets that for every rank when it starts several)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megacompile.optim.host_threads import host_threads, usable_cores

ROOT = Path(__file__).resolve().parents[2]


def test_a_torchrun_rank_updates_on_every_core_it_may_use(tmp_path):
    if usable_cores() < 2:
        pytest.skip("needs a process that may use 2 cores or more")
    out = tmp_path / "rank0.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                          str(ROOT / "tests" / "distributed" / "torchrun_host_threads.py"), str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["omp_num_threads"] == "1" and got["local_world_size"] == "1"
    assert got["compute_threads"] == 1          # the compute thread keeps what the launcher asked
    assert got["record"] == host_threads(ranks=1) > 1
    if got["kernel_backend"] == "cpp":          # the native kernel used them: 12 chunks to share
        assert got["kernel"] == got["record"]
