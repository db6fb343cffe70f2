"""The lease runbook (benchmarks/peers/lease.sh), with a stand-in python that records its commands
and writes the tables they would: within one command, the calls not done yet, in order, each only
when its need fits in what is left of LEASE_SECONDS; a call marked done once its table is there, one
that did not finish run again; the results packed into $OUT after every call and taken up again on a
fresh machine."""
import os
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LEASE = ROOT / "benchmarks" / "peers" / "lease.sh"

FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "$*" >> "$CALLS"
out=""; prev=""
for a in "$@"; do [ "$prev" = "--out" ] && out=$a; prev=$a; done
case "$*" in *"${SLOW_IN:-none}"*) sleep 3 ;; esac
case "$*" in
  *"import megacompile.passes"*) exit 0 ;;
  *"import torch, triton"*) [ -z "${NO_TORCH:-}" ] && echo "torch 2.11.0" ; exit 0 ;;
  *"import deepspeed, liger_kernel"*) exit 0 ;;
  *"get_device_name"*) echo "${GPU_NAME:-NVIDIA H100 80GB HBM3}" ; exit 0 ;;
  *"megacompile calibrate"*) echo '{"name": "measured here"}' > profile.json ; exit 0 ;;
  *"megacompile.bench peers"*)
    [ -n "${DIE_IN:-}" ] && [ "$out" = "$DIE_IN" ] && exit 1
    mkdir -p "$out" && touch "$out/peers.md"
    if [ "$out" = "${SKIPPED_IN:-none}" ]; then echo "megacompile,budget 0.34,skipped,,OutOfMemoryError" > "$out/peers.csv"
    else echo "megacompile,budget 0.34,step_s,1.25," > "$out/peers.csv"; fi ;;
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

ALL = ("preflight calibrate 7b-streamed 3b-megacompile 3b-landing 3b-fsdp2 deepspeed-op 3b-deepspeed kernels-check "
       "3b-resident acceptance kernels")


def _lease(tmp_path, *args, status=0, **env):
    python = tmp_path / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (tmp_path / "bin").mkdir(exist_ok=True)
    (tmp_path / "bin" / "stat").write_text(FAKE_STAT)
    (tmp_path / "bin" / "stat").chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.write_text("")
    env = {**os.environ, "PYTHON": str(python), "CALLS": str(calls), "WEIGHTS": str(tmp_path / "weights"),
           "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "IN_RAM": "", "LEASE_OUT": "",
           "LEASE_RESULTS": str(tmp_path / "results"), **env}
    proc = subprocess.run(["bash", str(LEASE), *args], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in env.items() if v is not None})
    assert proc.returncode == status, proc.stdout + proc.stderr
    preflight = ("import megacompile.passes", "import torch, triton", "import deepspeed, liger_kernel",
                 "get_device_name")
    return proc.stdout + proc.stderr, [line for line in calls.read_text().splitlines()
                                       if not any(p in line for p in preflight)]


def _done(tmp_path):
    return sorted(p.stem for p in (tmp_path / "results").glob("*.done"))


def test_a_command_runs_every_call_that_fits_its_time_in_order_and_a_call_that_did_not_finish_runs_again(tmp_path):
    out, calls = _lease(tmp_path, DIE_IN="3b-fsdp2", LEASE_SECONDS="900")
    assert "lease call 7b-streamed" in out
    assert "megacompile calibrate --device cuda --out profile.json" in calls[0]
    calls = calls[1:]
    assert "megacompile.kernels --check --only attention" in calls[0]
    assert "--shape llama-7b --batch 4 --seq 4096" in calls[1] and "--budgets 0.34" in calls[1]
    assert f"--profile {tmp_path / 'results' / 'profile.json'} " in calls[1] and "--systems megacompile " in calls[1]
    assert calls[1].endswith("--fuse")
    assert "--systems megacompile --budgets 0.34 " in calls[2] and "--out 3b " in calls[2] + " "
    assert "--budgets 0.34 --updates as_gradients_land" in calls[3] and "--compare-with 3b/peers.csv" in calls[3]
    assert "--out 3b-landing" in calls[3]
    assert "--systems fsdp2 --compare-with 3b/peers.csv" in calls[4]
    assert "CPUAdamBuilder().load()" in calls[5]
    assert "--systems deepspeed --compare-with 3b/peers.csv" in calls[6]
    assert "--skip parity,budget,calibrate,step" in calls[7]
    assert "--budgets resident" in calls[8] and "--compare-with 3b/peers.csv" in calls[8]
    assert "--skip kernels" in calls[9]
    kernels = sorted(p.stem.removeprefix("bench_") for p in (ROOT / "benchmarks" / "kernels").glob("bench_*.py"))
    assert sorted(c.split("liger.py ")[1].split()[0] for c in calls[10:]) == kernels
    assert "3b-fsdp2 did not finish" in out and "not done yet: 3b-fsdp2" in out
    assert len(_done(tmp_path)) == len(ALL.split()) - 1
    out, calls = _lease(tmp_path, LEASE_SECONDS="130")
    # A second may pass between the start and the check on a loaded machine.
    assert calls == [] and re.search(r"3b-fsdp2 needs about 140 s, 1(30|29) s are left: it runs in the next command", out)
    out, calls = _lease(tmp_path, LEASE_SECONDS="540")
    assert len(calls) == 1 and "3b-fsdp2 done" in out and "every call is done" in out


def test_each_call_is_given_at_most_what_is_left_and_time_spent_is_counted(tmp_path):
    out, calls = _lease(tmp_path, "3b-megacompile", LEASE_SECONDS="200")
    assert re.search(r"--minutes 3\.1[0-3] --out 3b", calls[0])    # 200 s less a margin, not the call's 9.5 minutes
    (tmp_path / "again").mkdir()
    out, calls = _lease(tmp_path / "again", "deepspeed-op", "kernels-check", LEASE_SECONDS="122",
                        SLOW_IN="CPUAdamBuilder")
    # 3 s went into deepspeed-op (it needs 60): less than kernels-check's 120 are left.
    assert "deepspeed-op done" in out and re.search(r"kernels-check needs about 120 s, 1[01]\d s are left", out)
    assert _done(tmp_path / "again") == ["deepspeed-op"]


def test_a_peer_waits_for_the_row_it_is_held_to_in_a_command_that_runs_it_and_runs_alone_without(tmp_path):
    out, calls = _lease(tmp_path, "3b-fsdp2", "3b-megacompile", LEASE_SECONDS="900")
    assert "3b-fsdp2 waits for 3b-megacompile" in out and len(calls) == 1 and "--out 3b" in calls[0]
    out, calls = _lease(tmp_path, "3b-fsdp2", LEASE_SECONDS="900")          # measured by now: compared with it
    assert "--systems fsdp2 --compare-with 3b/peers.csv" in calls[0]
    # DeepSpeed's own command, in a lease that has not measured megacompile: its op first, then alone.
    alone = tmp_path / "alone"
    alone.mkdir()
    out, calls = _lease(alone, "3b-deepspeed", LEASE_SECONDS="900")
    assert calls == [] and "3b-deepspeed waits for deepspeed-op" in out
    out, calls = _lease(alone, "deepspeed-op", "3b-deepspeed", LEASE_SECONDS="900")
    assert "CPUAdamBuilder().load()" in calls[0] and "--systems deepspeed --minutes" in calls[1]
    assert _done(alone) == ["3b-deepspeed", "deepspeed-op"]


def test_the_rows_are_predicted_under_this_machines_own_profile(tmp_path):
    """The calibrate call measures the machine whatever its card: a shipped profile of the same card
    (the H100's, the H200's) holds another host's AdamW rate. Without the call, the shipped H100 one."""
    for card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        folder = tmp_path / card.split()[1]
        folder.mkdir()
        out, calls = _lease(folder, "calibrate", "3b-megacompile", LEASE_SECONDS="900", GPU_NAME=card)
        assert "megacompile calibrate --device cuda --out profile.json" in calls[0]
        assert f"--profile {folder / 'results' / 'profile.json'} " in calls[1]
    (tmp_path / "none").mkdir()
    out, calls = _lease(tmp_path / "none", "3b-megacompile", LEASE_SECONDS="900")
    assert "peers-h100/h100-calibrated-profile.json" in calls[0]


def test_the_peers_are_held_to_the_landing_row_where_the_lease_measured_no_other(tmp_path):
    out, calls = _lease(tmp_path, "3b-landing", "3b-fsdp2", LEASE_SECONDS="900")
    assert "--compare-with" not in calls[0] and "--systems fsdp2 --compare-with 3b-landing/peers.csv" in calls[1]
    out, calls = _lease(tmp_path, "3b-megacompile", "deepspeed-op", "3b-deepspeed", LEASE_SECONDS="900")
    assert "--systems deepspeed --compare-with 3b/peers.csv" in calls[-1]


def test_an_unknown_call_is_refused(tmp_path):
    out, calls = _lease(tmp_path, "3b-zero3", status=2)
    assert "no call 3b-zero3: the calls are " + ALL in out and calls == []


def test_the_results_come_back_after_every_call_and_a_fresh_machine_goes_on_from_them(tmp_path):
    back = tmp_path / "out"
    back.mkdir()
    _lease(tmp_path, "7b-streamed", "3b-megacompile", LEASE_OUT=str(back), DIE_IN="3b", LEASE_SECONDS="900")
    with tarfile.open(back / "lease.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"./7b-streamed.done", "./7b-streamed/peers.md", "./7b-streamed.log", "./3b-megacompile.log"} <= names
    assert "./3b-megacompile.done" not in names
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    out, calls = _lease(fresh, "7b-streamed", "3b-megacompile", LEASE_RESUME=str(back / "lease.tar.gz"),
                        LEASE_SECONDS="900")
    assert "7b-streamed" not in out and "3b-megacompile done" in out
    assert len(calls) == 1 and "--out 3b" in calls[0]


def test_the_weights_go_to_a_disk_never_to_a_file_system_in_ram(tmp_path):
    weights = str(tmp_path / "weights")
    out, calls = _lease(tmp_path, status=2, IN_RAM=weights)
    assert f"WEIGHTS={weights} is on tmpfs, a file system in RAM" in out and calls == []
    # Without WEIGHTS: lease-weights beside the results (the checkout's tmp/), unless it is in RAM too.
    ours = tmp_path / "lease-weights"
    out, calls = _lease(tmp_path, WEIGHTS=None, IN_RAM=f"{ours} /var/tmp/megacompile-bench-weights")
    assert f"--weights {os.path.realpath('/tmp/megacompile-bench-weights')} " in calls[2]
    (tmp_path / "again").mkdir()
    out, calls = _lease(tmp_path / "again", WEIGHTS=None)
    assert f"--weights {tmp_path / 'again' / 'lease-weights'} " in calls[2]


def test_the_7b_row_runs_unfused_when_the_attention_kernel_fails_its_check_on_the_gpu(tmp_path):
    out, calls = _lease(tmp_path, ATTENTION_FAILS="1")
    assert "the attention kernel failed its check" in out
    assert "--shape llama-7b" in calls[2] and calls[2].endswith("--no-fuse")


def test_every_command_the_runbook_gives_is_one_its_program_takes(tmp_path):
    """The runbook's arguments, read by the programs' own parsers: a flag misspelt in lease.sh, or
    a section acceptance does not have, is found here rather than on the rented GPU."""
    from megacompile.acceptance.main import SECTIONS
    from megacompile.acceptance.main import parser as acceptance_parser
    from megacompile.bench import peers
    from megacompile.kernels.__main__ import parser as kernels_parser
    out, calls = _lease(tmp_path, LEASE_SECONDS="100000")
    assert "every call is done" in out
    seen = set()
    for call in calls:
        argv = call.split()
        if argv[:3] == ["-m", "megacompile.bench", "peers"]:
            args = peers._arguments(argv[3:])
            assert args.minutes > 0 and peers._jobs(args)
            seen.add("peers")
        elif argv[:2] == ["-m", "megacompile.acceptance"]:
            args = acceptance_parser().parse_args(argv[2:])
            assert {s for s in args.skip.split(",") if s} <= set(SECTIONS)
            seen.add("acceptance")
        elif argv[:2] == ["-m", "megacompile.kernels"]:
            assert kernels_parser().parse_args(argv[2:]).check
            seen.add("kernels")
    assert seen == {"peers", "acceptance", "kernels"}
    row = next(peers._arguments(c.split()[3:]) for c in calls if " --out 3b " in f"{c} ")
    assert row.host_threads and all(n < os.cpu_count() or n == 1 for n in row.host_threads)


def test_acceptance_refuses_a_section_it_does_not_have(capsys):
    import pytest

    from megacompile.acceptance.main import main
    with pytest.raises(SystemExit) as e:
        main(["--skip", "kernels,parity,speed"])
    assert e.value.code == 2 and "--skip: speed is not a section; the sections are kernels, parity" in capsys.readouterr().err


def test_the_first_call_records_the_machine_and_a_machine_without_torch_goes_no_further(tmp_path):
    out, calls = _lease(tmp_path, "preflight", LEASE_SECONDS="100")
    assert "preflight done" in out
    found = (tmp_path / "results" / "preflight.txt").read_text()
    assert "torch 2.11.0" in found and "cores " in found
    (tmp_path / "bare").mkdir()
    out, calls = _lease(tmp_path / "bare", "preflight", LEASE_SECONDS="100", NO_TORCH="1")
    assert "preflight did not finish" in out and _done(tmp_path / "bare") == []


def test_a_bench_call_whose_every_row_was_skipped_is_done_but_said_to_have_measured_nothing(tmp_path):
    """The second H100 lease: the 3B row ran out of device memory, its table held one skipped row, and
    the runbook called it done like a measured one."""
    out, calls = _lease(tmp_path, "preflight", "3b-megacompile", "3b-fsdp2", SKIPPED_IN="3b", LEASE_SECONDS="900")
    assert "3b-megacompile measured nothing: every row of 3b/peers.md was skipped" in out
    assert "== measured nothing (every row skipped; see their logs): 3b-megacompile" in out
    assert (tmp_path / "results" / "3b-megacompile.skipped").exists()
    assert not (tmp_path / "results" / "3b-fsdp2.skipped").exists()
    assert _done(tmp_path) == ["3b-fsdp2", "3b-megacompile", "preflight"]
