"""Host AdamW, full update path: bf16 grad in, fp32 master/m/v updated, bf16 copy of the master out.

Compares, in one process on the same master/m/v buffers:
  megacompile      megacompile.optim.fused_adamw.adamw_update_, one call, one pass (28 B/param)
  deepspeed        grad bf16 -> fp32 buffer, DeepSpeedCPUAdam.step, master -> bf16 staging
  torch_fused      the same conversions around torch.optim.AdamW(fused=True)
  *_step_only      the optimizer step alone on an fp32 grad (for reference; not the same result)
  bandwidth_bound  measured in-place memory bandwidth / 28 B per param

The paths take turns in bursts (see `measure`), so drift in the machine's memory bandwidth (shared
hosts) lands on all of them alike. Prints a table, writes a long CSV
(benchmarks/results/host_adam.csv) and, as the last line, one JSON object.

    python benchmarks/host_adam.py --params 50000000
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import provenance

ROOT = Path(__file__).resolve().parents[1]
try:
    from megacompile.optim import fused_adamw
except ImportError:
    sys.path.insert(0, str(ROOT))
    from megacompile.optim import fused_adamw

# fp32 master, exp_avg, exp_avg_sq read and written in place (24 B), bf16 grad read (2 B),
# bf16 staging copy written (2 B).
BYTES_PER_PARAM = 28
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)


def quantiles(samples: list[float]) -> tuple[float, float, float]:
    """p10, median, p90 (nearest rank)."""
    ordered = sorted(samples)

    def rank(q: float) -> float:
        return ordered[round(q * (len(ordered) - 1))]
    return rank(0.1), statistics.median(ordered), rank(0.9)


class Buffers:
    """One block's host buffers, shared by every path."""

    def __init__(self, params: int):
        gen = torch.Generator().manual_seed(0)
        self.master = torch.randn(params, generator=gen)
        self.exp_avg = torch.zeros(params)
        self.exp_avg_sq = torch.zeros(params)
        self.grad = torch.randn(params, generator=gen).to(torch.bfloat16)
        self.staging = torch.empty(params, dtype=torch.bfloat16).fill_(0)
        self.grad_fp32 = torch.empty(params).fill_(0)  # only the baselines need it


def megacompile_path(b: Buffers):
    step = 0

    def run():
        nonlocal step
        step += 1
        fused_adamw.adamw_update_(b.master, b.grad, b.exp_avg, b.exp_avg_sq, step=step,
                                  out=b.staging, **HYPER)
    return run


def optimizer_path(b: Buffers, make_optimizer, state_step):
    """Conversions around a torch.optim-style optimizer whose state is our exp_avg/exp_avg_sq."""
    param = torch.nn.Parameter(b.master, requires_grad=False)
    param.grad = b.grad_fp32
    optimizer = make_optimizer(param)
    optimizer.state[param] = {"step": state_step, "exp_avg": b.exp_avg,
                              "exp_avg_sq": b.exp_avg_sq}

    def full():
        b.grad_fp32.copy_(b.grad)      # 2 B read, 4 B written
        optimizer.step()               # 28 B: fp32 grad read, master, m, v in place
        b.staging.copy_(b.master)      # 4 B read, 2 B written
    return full, optimizer.step


def deepspeed_path(b: Buffers):
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as error:  # noqa: BLE001 -- ImportError or a failed op build: both mean skip
        print(f"deepspeed is missing ({type(error).__name__}: {error}); install it with "
              f"`pip install deepspeed` (or `pip install -e .[bench]`) to compare against "
              f"DeepSpeedCPUAdam. Reporting null for it.")
        return None, None

    def make(param):
        return DeepSpeedCPUAdam([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                                adamw_mode=True)
    return optimizer_path(b, make, 0)


def torch_fused_path(b: Buffers):
    def make(param):
        return torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                 eps=HYPER["eps"], weight_decay=HYPER["weight_decay"], fused=True)
    return optimizer_path(b, make, torch.tensor(0.0))


def bandwidth_paths(params: int):
    """In-place (read + write the same lines) and copy bandwidth.

    Each op moves as many bytes as one full update (28 B per param), so it lasts as long and is
    as exposed to the host's jitter; a shorter probe reads lower on a shared machine.
    """
    numel = max(params * BYTES_PER_PARAM // 8, 1 << 24)
    source = torch.ones(numel)
    destination = torch.ones(numel)
    moved = 2 * numel * source.element_size()  # bytes read + bytes written, as the op sees them

    def inplace():
        source.mul_(1.0)

    def copy():
        destination.copy_(source)
    return inplace, copy, moved


def timed(run) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def machine_facts() -> dict:
    return {**provenance.machine_facts(), "host_adam_backend": fused_adamw.backend()}


def measure(runs: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    """Seconds per call. Each round runs every path in turn: one untimed call, then `per_round`
    timed calls back to back, as a training step updates block after block.

    Back to back, each path runs in its own steady state: torch's OpenMP workers spin for a few
    milliseconds after each parallel region, so a torch path finds them awake, while another path
    started in that window shares the cores with them; and a torch path started after a pause
    waits at its closing barrier for workers that must first wake up. The rounds spread the
    machine's drift over all paths alike.
    """
    seconds = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()
            seconds[name].extend(timed(run) for _ in range(per_round))
    return seconds


def summarize(seconds: dict[str, list[float]], params: int, moved: int) -> list[dict]:
    rows = []
    for name, samples in seconds.items():
        probe = name in ("inplace", "copy")
        # A bandwidth probe's params/s is the rate at which it would stream 28 B per param.
        rate = [(moved / BYTES_PER_PARAM if probe else params) / s for s in samples]
        p10, median, p90 = quantiles(rate)
        rows.append({"path": f"bandwidth_bound_{name}" if probe else name,
                     "params_per_s_median": median, "params_per_s_p10": p10,
                     "params_per_s_p90": p90, "seconds_median": statistics.median(samples),
                     "GBps_at_28B": median * BYTES_PER_PARAM / 1e9})
    return rows


def print_table(rows: list[dict], params: int, facts: dict) -> None:
    rate = {r["path"]: r["params_per_s_median"] for r in rows}
    print(f"host AdamW full path, {params:,} params, {facts['threads']} threads, "
          f"{facts['cpu_model']}, torch {facts['torch_version']}, "
          f"kernel {facts['host_adam_backend']}, load average {facts['load_average_1min']}")
    print(f"{'path':<24}{'G params/s p10':>15}{'median':>8}{'p90':>8}{'GB/s at 28 B':>14}"
          f"{'of bound':>10}{'megacompile is':>16}")
    for r in rows:
        median = r["params_per_s_median"]
        print(f"{r['path']:<24}{r['params_per_s_p10'] / 1e9:>15.3f}{median / 1e9:>8.3f}"
              f"{r['params_per_s_p90'] / 1e9:>8.3f}{r['GBps_at_28B']:>14.1f}"
              f"{median / rate['bandwidth_bound_inplace']:>10.0%}"
              f"{rate['megacompile'] / median:>15.2f}x")
    print("bound: in-place bandwidth (x.mul_(1.0); bytes read + written) / 28 B per param. Master, "
          "m and v (24 of the 28 B) are read and written in place, as that op does; a copy also "
          "reads each destination line before writing it, so it understates what this kernel "
          "can reach.")


def write_csv(path: Path, rows: list[dict], params: int, facts: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        fields = ["path", "params", "bytes_per_param", *rows[0], *facts]
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(fields)))
        writer.writeheader()
        for r in rows:
            writer.writerow({"params": params, "bytes_per_param": BYTES_PER_PARAM, **r, **facts})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--csv", type=Path,
                        default=ROOT / "benchmarks" / "results" / "host_adam.csv")
    args = parser.parse_args()

    facts = machine_facts()  # before the runs: the load average is the machine's, not ours
    buffers = Buffers(args.params)
    deepspeed_full, deepspeed_step = deepspeed_path(buffers)
    torch_full, torch_step = torch_fused_path(buffers)
    inplace, copy, moved = bandwidth_paths(args.params)
    # *_step_only: the optimizer alone on an fp32 grad, no conversions. Not the same result; shown
    # because it moves the same 28 B per param as megacompile's full path.
    runs = {"megacompile": megacompile_path(buffers), "deepspeed": deepspeed_full,
            "torch_fused": torch_full, "deepspeed_step_only": deepspeed_step,
            "torch_fused_step_only": torch_step, "inplace": inplace, "copy": copy}
    runs = {name: run for name, run in runs.items() if run is not None}

    rows = summarize(measure(runs, args.rounds, args.per_round), args.params, moved)
    print_table(rows, args.params, facts)
    write_csv(args.csv, rows, args.params, facts)
    rate = {r["path"]: r["params_per_s_median"] for r in rows}
    print(json.dumps({"params": args.params, "megacompile_params_per_s": rate["megacompile"],
                      "deepspeed_params_per_s": rate.get("deepspeed"),
                      "torch_fused_params_per_s": rate["torch_fused"],
                      "bandwidth_bound_params_per_s": rate["bandwidth_bound_inplace"]}))


if __name__ == "__main__":
    main()
