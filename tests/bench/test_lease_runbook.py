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
  *"megacompile.kernels --check"*) [ -n "${ATTENTION_FAILS:-}" ] && exit 1 ;;
esac
exit 0
"""


# stat -f -c %T as a file system in RAM answers it, for the folders named in $IN_RAM.
FAKE_STAT = r"""#!/usr/bin/env bash
for dir in $IN_RAM; do [ "${@: -1}" = "$dir" ] && { echo tmpfs; exit 0; }; done
echo ext2/ext3
"""


def _lease(tmp_path, status=0, **env):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "stat").write_text(FAKE_STAT)
    (tmp_path / "bin" / "stat").chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = {**os.environ, "PYTHON": str(python), "CALLS": str(calls), "WEIGHTS": str(tmp_path / "weights"),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "IN_RAM": "", **env}
    proc = subprocess.run(["bash", str(LEASE), str(tmp_path / "results")], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in env.items() if v is not None})
    assert proc.returncode == status, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr, [line for line in calls.read_text().splitlines()
                                       if "import megacompile.passes" not in line]


def test_each_run_does_the_next_call_and_a_call_that_did_not_finish_runs_again(tmp_path):
    out, calls = _lease(tmp_path)
    assert "lease call 7b-streamed" in out
    assert "megacompile.kernels --check --only attention" in calls[0]
    assert "--shape llama-7b --batch 4 --seq 4096" in calls[1] and "--budgets 0.34" in calls[1]
    assert "h100-calibrated-profile.json" in calls[1] and "--systems megacompile " in calls[1]
    assert calls[1].endswith("--fuse")
    assert "--skip parity,budget,calibrate,step" in calls[2]
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


def test_the_weights_go_to_a_disk_never_to_a_file_system_in_ram(tmp_path):
    weights = str(tmp_path / "weights")
    out, calls = _lease(tmp_path, status=2, IN_RAM=weights)
    assert f"WEIGHTS={weights} is on tmpfs, a file system in RAM" in out and calls == []
    # Without WEIGHTS: the checkout's tmp/lease-weights, unless it is in RAM too.
    ours = ROOT / "tmp" / "lease-weights"
    out, calls = _lease(tmp_path, WEIGHTS=None, IN_RAM=f"{ours} /var/tmp/megacompile-bench-weights")
    assert f"--weights {os.path.realpath('/tmp/megacompile-bench-weights')} " in calls[1]
    (tmp_path / "again").mkdir()
    out, calls = _lease(tmp_path / "again", WEIGHTS=None)
    assert f"--weights {ours} " in calls[1]


def test_the_7b_row_runs_unfused_when_the_attention_kernel_fails_its_check_on_the_gpu(tmp_path):
    out, calls = _lease(tmp_path, ATTENTION_FAILS="1")
    assert "the attention kernel failed its check" in out
    assert "--shape llama-7b" in calls[1] and calls[1].endswith("--no-fuse")
