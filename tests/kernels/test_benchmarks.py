"""The kernel benchmark scripts run: each point once at tiny shapes (no timing), and without a GPU
the timed run exits 0 after saying so."""
import importlib
import sys
from pathlib import Path

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels"
SCRIPTS = sorted(p.stem for p in BENCH_DIR.glob("bench_*.py"))


@pytest.fixture(scope="module")
def bench_path():
    sys.path.insert(0, str(BENCH_DIR))
    yield
    sys.path.remove(str(BENCH_DIR))


def test_there_is_a_benchmark_per_kernel_module():
    assert {s.removeprefix("bench_") for s in SCRIPTS} >= {
        "rms_norm", "layer_norm", "swiglu", "gelu", "rope", "softmax", "fused_linear_cross_entropy", "linear_logprobs", "adamw", "cast",
    }


# attention's (about 20 s on 2 cores) with -m long; the other kernels' scripts run the same harness
@pytest.mark.parametrize("script", [pytest.param(s, marks=pytest.mark.long) if s == "bench_attention" else s
                                    for s in SCRIPTS])
def test_benchmark_script_runs(script, bench_path, capsys, tmp_path):
    module = importlib.import_module(script)
    common = importlib.import_module("_common")
    name = script.removeprefix("bench_")
    assert common.main(name, module.points, ["--smoke", "--csv", str(tmp_path / "k.csv")]) == 0
    if not torch.cuda.is_available():
        assert common.main(name, module.points, ["--csv", str(tmp_path / "k.csv")]) == 0
        assert "no GPU" in capsys.readouterr().out
        assert not (tmp_path / "k.csv").exists()
