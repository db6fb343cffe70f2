"""Where a benchmark figure came from: machine, CPU, versions, commit, and how busy the machine was.
Every benchmark writes these beside its numbers in its long-format CSV."""
from __future__ import annotations

import csv
import os
import platform
import subprocess
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_facts() -> dict:
    return {"machine": platform.node(), "cpu_model": cpu_model(), "torch_version": torch.__version__,
            "git_sha": git_sha(), "threads": torch.get_num_threads(),
            # Other work on the machine moves every figure: say how busy it was.
            "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else ""}


def write_rows(path: str, rows: list[dict]) -> None:
    """The long-format CSV: one row per point, the columns of the first row."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")


def write_table(rows: list[dict], csv_path: str, table: str, markdown_path: str | None = None) -> None:
    """A plan table's rows as a CSV (one column per key), and its markdown printed (and written)."""
    os.makedirs(os.path.dirname(csv_path), exist_ok=True)
    keys = sorted({k for r in rows for k in r})
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    print(table)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table + "\n")
