"""The validation's record: one row per checked thing, written as a long CSV and a markdown table."""
from __future__ import annotations

import csv
import math
import platform
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Row:
    section: str           # kernels | parity | budget | calibrate | step
    name: str              # what was checked, e.g. "llama fp32" or "rms_norm bfloat16"
    value: float           # the figure the row is about (an error, bytes, seconds)
    limit: float = math.nan   # the tolerance or bound it is held to (nan: a measurement, not a check)
    passed: bool | None = None   # None: a measurement
    detail: dict = field(default_factory=dict)


def machine() -> dict:
    facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
             "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        facts |= {"gpu": props.name, "gpu_memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
                  "driver": _driver()}
    try:
        import triton
        facts["triton"] = triton.__version__
    except ImportError:
        pass
    return facts


def _driver() -> str:
    try:
        import subprocess
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, IndexError, Exception):   # noqa: BLE001 - a fact for the record, never a failure
        return "unknown"


def write_csv(path: Path, rows: list[Row], facts: dict) -> None:
    """Long format: one line per (row, key) of the detail, plus the row's own value."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["section", "name", "metric", "value", "limit", "passed", *facts])
        writer.writeheader()
        for r in rows:
            base = {"section": r.section, "name": r.name, "limit": r.limit, "passed": r.passed, **facts}
            writer.writerow({**base, "metric": "value", "value": r.value})
            for key, value in r.detail.items():
                writer.writerow({**base, "metric": key, "value": value})


def markdown(rows: list[Row], facts: dict) -> str:
    def num(x) -> str:
        if isinstance(x, float):
            return "-" if math.isnan(x) else f"{x:.4g}"
        return str(x)

    lines = ["# megacompile validation", "", ", ".join(f"{k} {v}" for k, v in facts.items()), "",
             "| section | name | value | limit | result | detail |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        result = "-" if r.passed is None else ("pass" if r.passed else "**FAIL**")
        detail = "; ".join(f"{k} {num(v)}" for k, v in r.detail.items())
        lines.append(f"| {r.section} | {r.name} | {num(r.value)} | {num(r.limit)} | {result} | {detail} |")
    failed = [r for r in rows if r.passed is False]
    lines += ["", f"{sum(r.passed is True for r in rows)} checks passed, {len(failed)} failed"
              + (": " + ", ".join(f"{r.section}/{r.name}" for r in failed) if failed else "")]
    return "\n".join(lines)


def write(out_dir: Path, rows: list[Row], facts: dict) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path, md_path = out_dir / "validate.csv", out_dir / "validate.md"
    write_csv(csv_path, rows, facts)
    md_path.write_text(markdown(rows, facts) + "\n")
    return csv_path, md_path
