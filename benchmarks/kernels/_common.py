"""Shared by the kernel benchmarks: timing with triton.testing.do_bench, normalized units, machine
facts and the long-format CSV (one row per point and metric) in benchmarks/results/kernels.csv.

Each bench_<kernel>.py lists its points (shapes x dtypes x implementations) and calls `main`.
Without a GPU a script says so and exits 0: timing the interpreter would measure Python.
`--smoke` runs every point once at tiny shapes (on the interpreter when there is no GPU) without
timing or writing, so the scripts themselves stay tested.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import importlib
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
CSV_PATH = ROOT / "benchmarks" / "results" / "kernels.csv"
QUANTILES = (0.5, 0.2, 0.8)  # median, then the spread written next to it
FIELDS = ["kernel", "shape", "dtype", "impl", "metric", "value", "p20", "p80",
          "device", "torch", "triton", "git_sha", "time"]


def kernels_package():
    """megacompile.kernels when installed, else the top-level kernels/ folder of this checkout."""
    try:
        return importlib.import_module("megacompile.kernels")
    except ImportError:
        sys.path.insert(0, str(ROOT))
        return importlib.import_module("kernels")


def kernel_module(name: str):
    return importlib.import_module(f"{kernels_package().__name__}.{name}")


@dataclass
class Point:
    """One shape and dtype of one kernel, with every implementation to time on it."""
    kernel: str
    shape: str  # for the table and the CSV, e.g. "4096x4096"
    dtype: torch.dtype
    make_inputs: Callable[[], tuple]  # fresh inputs; tensors that need gradients have requires_grad set
    impls: dict[str, Callable]  # name -> fn(*inputs) -> tensor or tuple of tensors
    bytes_fwd: float = 0.0  # bytes the fused forward must move (for GB/s)
    bytes_fwd_bwd: float = 0.0  # forward plus backward
    flops_fwd_bwd: float = 0.0  # when set, report TFLOPS for fwd+bwd instead of GB/s
    backward: bool = True  # False for optimizer steps and casts: only "fwd" is timed
    notes: dict = field(default_factory=dict)


def _facts() -> dict:
    import triton

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        sha = "unknown"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__, "git_sha": sha,
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _timer(smoke: bool):
    if smoke:
        def once(fn, grad_to_none=None):
            fn()
            return [float("nan")] * len(QUANTILES)
        return once
    import triton.testing

    def timed(fn, grad_to_none=None):
        return triton.testing.do_bench(fn, quantiles=list(QUANTILES), grad_to_none=grad_to_none)
    return timed


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def measure(point: Point, smoke: bool = False) -> list[dict]:
    """Rows of (impl, metric, value, p20, p80) for one point."""
    bench = _timer(smoke)
    rows = []
    for impl, fn in point.impls.items():
        inputs = point.make_inputs()
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        fn(*inputs)  # compile / autotune outside the timing
        ms = bench(lambda: fn(*inputs))
        rows.append(dict(impl=impl, metric="fwd_ms", value=ms[0], p20=ms[1], p80=ms[2]))
        if point.bytes_fwd:
            rows.append(dict(impl=impl, metric="fwd_GBps", value=point.bytes_fwd / ms[0] / 1e6,
                             p20=point.bytes_fwd / ms[2] / 1e6, p80=point.bytes_fwd / ms[1] / 1e6))
        if not point.backward:
            continue
        # a loss gets the gradient 1 that .backward() gives it; other outputs a random one
        upstream = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in _outputs(fn(*inputs))]

        def fwd_bwd():
            torch.autograd.backward(_outputs(fn(*inputs)), upstream)

        fwd_bwd()
        if torch.cuda.is_available():
            for leaf in leaves:
                leaf.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            rows.append(dict(impl=impl, metric="fwd_bwd_peak_MiB",
                             value=(torch.cuda.max_memory_allocated() - base) / 2**20, p20="", p80=""))
        ms = bench(fwd_bwd, grad_to_none=leaves)
        rows.append(dict(impl=impl, metric="fwd_bwd_ms", value=ms[0], p20=ms[1], p80=ms[2]))
        if point.flops_fwd_bwd:
            f = point.flops_fwd_bwd
            rows.append(dict(impl=impl, metric="fwd_bwd_TFLOPS", value=f / ms[0] / 1e9,
                             p20=f / ms[2] / 1e9, p80=f / ms[1] / 1e9))
        elif point.bytes_fwd_bwd:
            b = point.bytes_fwd_bwd
            rows.append(dict(impl=impl, metric="fwd_bwd_GBps", value=b / ms[0] / 1e6,
                             p20=b / ms[2] / 1e6, p80=b / ms[1] / 1e6))
    return rows


def write_csv(rows: list[dict], path: Path = CSV_PATH) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerows(rows)


def print_table(rows: list[dict]) -> None:
    print(f"{'kernel':<18}{'shape':<22}{'dtype':<10}{'impl':<14}{'metric':<18}{'median':>11}{'p20':>11}{'p80':>11}")
    for r in rows:
        fmt = lambda v: f"{v:>11.3f}" if isinstance(v, float) else f"{v!s:>11}"  # noqa: E731
        print(f"{r['kernel']:<18}{r['shape']:<22}{r['dtype']:<10}{r['impl']:<14}{r['metric']:<18}"
              f"{fmt(r['value'])}{fmt(r['p20'])}{fmt(r['p80'])}")


def main(name: str, points: Callable[[bool], list[Point]], argv=None) -> int:
    """Parse --smoke/--csv, time every point (GPU only), print the table and append the CSV."""
    parser = argparse.ArgumentParser(description=f"benchmark the {name} kernel against torch eager and torch.compile")
    parser.add_argument("--smoke", action="store_true", help="run every point once at tiny shapes, no timing")
    parser.add_argument("--csv", type=Path, default=CSV_PATH)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        print(f"{name}: no GPU, nothing timed (the Triton interpreter would measure Python); exit 0")
        return 0
    facts = _facts()
    rows = []
    for point in points(args.smoke):
        dtype = str(point.dtype).replace("torch.", "")
        for row in measure(point, smoke=args.smoke):
            rows.append({"kernel": point.kernel, "shape": point.shape, "dtype": dtype, **row, **facts})
    print_table(rows)
    if not args.smoke:
        write_csv(rows, args.csv)
        print(f"appended {len(rows)} rows to {args.csv}")
    return 0


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def lm_head_inputs(n: int, hidden: int, vocab: int, dtype: torch.dtype, ignore_every: int = 0):
    """(h [N, H], W [V, H], labels [N]) of an lm head, both differentiable; every `ignore_every`-th
    label -100 when asked."""
    h = torch.randn(n, hidden, device=device(), dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, device=device()) * hidden**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,), device=device())
    if ignore_every:
        labels[::ignore_every] = -100
    return h, w, labels


def compiled(fn):
    """torch.compile(fn), or fn itself where inductor cannot run (smoke runs on the CPU)."""
    return torch.compile(fn) if torch.cuda.is_available() else fn
