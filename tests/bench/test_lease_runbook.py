"""The lease runbook (benchmarks/peers/lease.sh), with a stand-in python that records its commands
and writes the tables they would: one call per run, in order, each marked done once its table is
there, and a call that did not finish is run again."""
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks" / "peers" / "lease.sh"

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
case "$*" in
  *"import megacompile.passes"*) exit 0 ;;
  *"megacompile.bench peers"*)
    [ -n "${DIE_IN:-}" ] && [ "$out" = "$DIE_IN" ] && exit 1
    mkdir -p "$out" && touch "$out/peers.md" ;;
  *"megacompile.acceptance"*) mkdir -p "$out" && touch "$out/validate.md" ;;
esac
exit 0
"""


def _lease(tmp_path, **env):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    proc = subprocess.run(["bash", str(LEASE), str(tmp_path / "results")], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHON": str(python), "CALLS": str(calls),
                               "WEIGHTS": str(tmp_path / "weights"), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, [line for line in calls.read_text().splitlines() if "import megacompile.passes" not in line]


def test_each_run_does_the_next_call_and_a_call_that_did_not_finish_runs_again(tmp_path):
    out, calls = _lease(tmp_path)
    assert "lease call 7b-streamed" in out
    assert "--shape llama-7b --batch 4 --seq 4096" in calls[0] and "--budgets 0.34" in calls[0]
    assert "h100-calibrated-profile.json" in calls[0] and "--systems megacompile " in calls[0]
    assert "--skip parity,budget,calibrate,step" in calls[1]
    out, calls = _lease(tmp_path, DIE_IN="3b")        # killed before its table was written
    assert "3b-fsdp2 did not finish" in out and "--systems megacompile,fsdp2" in calls[0]
    out, calls = _lease(tmp_path)
    assert "3b-fsdp2 done" in out
    out, calls = _lease(tmp_path)
    assert "deepspeed-op done" in out and "CPUAdamBuilder().load()" in calls[0]
    out, calls = _lease(tmp_path)
    assert "--systems deepspeed --compare-with 3b/peers.csv" in calls[0]
    out, calls = _lease(tmp_path)
    assert "acceptance done" in out and "--skip kernels" in calls[0]
    out, calls = _lease(tmp_path)
    kernels = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks" / "kernels").glob("bench_*.py"))
    assert sorted(c.split("liger.py ")[1].split()[0] for c in calls) == kernels
    out, calls = _lease(tmp_path)
    assert "every call is done" in out and calls == []
