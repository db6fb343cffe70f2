"""`python -m megacompile.bench peers`: one model, one device, one table. megacompile at three
budgets (every weight resident; half the bf16 weights; 0.34x of them, the ratio of 80 GB to a 118B
model's weights, so every block streams) beside DeepSpeed ZeRO-3 offload and FSDP2 CPU offload
(fused host AdamW; its unfused row on request), on the same model, seed and batches. Each system
runs in its own process (runner.py) with at least the time it needs (shares.py); one that cannot
run here, or not in what is left of --minutes, is skipped with its reason. Writes peers.csv (long)
and peers.md into --out."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import budgets
from .agreement import BF16_LOSS_RTOL, FP32_LOSS_RTOL, agree, loss_fall
from .shares import need_s, share_s
from .table import markdown, read_csv, thread_sweep, write_csv
from .workload import SHAPES, Workload, width_lr
from ..settings import UPDATES

# The streamed budget first: with the peers right after it, the rows the comparison rests on run
# before the others if --minutes runs short.
MEGACOMPILE_BUDGETS = ("0.34", "0.5", "resident")
# --systems names of the peers: (the runner's system, the row's setting, its options)
PEERS = {"deepspeed": ("deepspeed", "ZeRO-3 offload", {}),
         "fsdp2": ("fsdp2", "offload, fused AdamW", {"fused": True}),
         "fsdp2-unfused": ("fsdp2", "offload, for-loop AdamW", {"fused": False})}
NEEDS_WEIGHTS = ("megacompile", "deepspeed")

_clock = time.monotonic


@dataclass
class Job:
    name: str           # as --systems names it
    system: str         # as runner.py runs it
    setting: str
    options: dict = field(default_factory=dict)

    def alone(self) -> str:
        """The arguments that run this row in a call of its own."""
        if self.system == "megacompile":
            return f"--systems megacompile --budgets {self.options['budget']} --updates {self.options['updates']}"
        return f"--systems {self.name}"


def _arguments(argv):
    p = argparse.ArgumentParser(prog="python -m megacompile.bench peers", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the cpu half: a 4-layer toy on the cpu backend, in fp32")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for peers.csv and peers.md")
    p.add_argument("--weights", type=Path, default=None,
                   help="folder for the model's fp32 weights, written once per shape and seed (default: OUT/weights)")
    p.add_argument("--shape", default=None, help="llama-3b (default on a GPU), llama-7b or tiny")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per system, after --warmup (9 on a GPU)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW's learning rate (default: 1e-4 x 1024 / the shape's width, at most 1e-4 "
                   "(bench/workload.py width_lr: 3.3e-5 at 3B, 2.5e-5 at 7B); 3e-3 for the toy)")
    p.add_argument("--lr-warmup", type=int, default=None, metavar="STEPS",
                   help="steps over which the rate rises linearly to --lr, from --lr / STEPS at the first "
                   "(default: every step of the run, --warmup and --steps; 0: --lr from the first)")
    p.add_argument("--systems", default="megacompile,deepspeed,fsdp2",
                   help=f"comma-separated, of megacompile, {', '.join(PEERS)}")
    p.add_argument("--budgets", default=",".join(MEGACOMPILE_BUDGETS),
                   help="megacompile's budgets: resident, or fractions of the bf16 weights")
    p.add_argument("--updates", default="at_commit",
                   help="when megacompile's host updates start (compile()'s updates): at_commit, as_gradients_land, "
                        "or both comma-separated (a row for each at every budget)")
    p.add_argument("--host-budget", type=float, default=None, help="GiB of host RAM megacompile's plan may use")
    p.add_argument("--host-threads", type=_thread_counts, default=None, metavar="N[,N...]",
                   help="after megacompile's timed steps, time a few more with its host AdamW on each of these "
                        "thread counts (default: every core of the rank): whether the updates contend with the "
                        "compute thread and the copies")
    p.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=None,
                   help="megacompile's fused Triton kernels (default: on a GPU, as compile() does)")
    p.add_argument("--minutes", type=float, default=9.5, help="time for the whole call; late systems are skipped")
    p.add_argument("--profile", type=Path, default=None,
                   help="a calibrated profile (JSON) to predict with; default: measure this GPU's first")
    p.add_argument("--compare-with", type=Path, default=None,
                   help="an earlier call's peers.csv (the same workload): its first row's losses are the reference")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="measure this GPU's profile first, for the calibrated prediction (unless --profile)")
    return p.parse_args(argv)


def _workload(args) -> Workload:
    tiny = args.tiny or not torch.cuda.is_available()
    shape = args.shape or ("tiny" if tiny else "llama-3b")
    steps = args.steps or (3 if tiny else 9)
    if args.lr_warmup is not None and args.lr_warmup < 0:
        from ..errors import ArgumentError
        raise ArgumentError(f"--lr-warmup must be 0 (no warmup) or more steps, got {args.lr_warmup}")
    return Workload(shape=shape, batch=args.batch or (2 if tiny else 4), seq=args.seq or (32 if tiny else 2048),
                    steps=steps, warmup=args.warmup,
                    lr=args.lr or (3e-3 if tiny else width_lr(SHAPES[shape]["dim"])),
                    lr_warmup=args.warmup + steps if args.lr_warmup is None else args.lr_warmup,
                    device="cpu" if tiny else "cuda")


def _thread_counts(text: str) -> list[int]:
    counts = [c.strip() for c in text.split(",") if c.strip()]
    if not counts or not all(c.isdigit() and int(c) > 0 for c in counts):
        raise argparse.ArgumentTypeError(f"thread counts are whole numbers >= 1, comma-separated (14,8), got {text!r}")
    return [int(c) for c in counts]


def _jobs(args) -> list[Job]:
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in names if n != "megacompile" and n not in PEERS]
    if unknown:
        from ..errors import ArgumentError
        raise ArgumentError(f"--systems: {', '.join(unknown)} is not one of megacompile, {', '.join(PEERS)}")
    placements = [u.strip() for u in args.updates.split(",") if u.strip()]
    wrong = [u for u in placements if u not in UPDATES]
    if wrong or not placements:
        from ..errors import ArgumentError
        raise ArgumentError(f"--updates: {', '.join(wrong) or 'nothing'} is not one of {', '.join(UPDATES)}")
    ours = [Job("megacompile", "megacompile", f"budget {b}" + ("" if u == "at_commit" else f", updates {u}"),
                {"budget": b, "updates": u})
            for b in args.budgets.split(",") for u in placements if "megacompile" in names]
    return ours[:1] + [Job(n, *PEERS[n]) for n in names if n != "megacompile"] + ours[1:]


def _unavailable(system: str, workload: Workload) -> str | None:
    """Why a system cannot run here, or None."""
    if system == "deepspeed":
        if not workload.device.startswith("cuda"):
            return "DeepSpeed ZeRO-3 offload needs a GPU (its CPU accelerator runs no offload)"
        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed (benchmarks/peers/wheels.sh builds it for a machine without network)"
    if system == "fsdp2":
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except ImportError:
            return f"this torch ({torch.__version__}) has no FSDP2 (torch.distributed.fsdp.fully_shard)"
        import torch.distributed as dist
        if not dist.is_available():
            return "this torch was built without torch.distributed"
    return None


def _process(argv: list[str], env: dict, timeout: float, log: Path) -> tuple[int | None, str]:
    """(exit status, None when it ran past `timeout`; its last line), its output in `log` (kept: a
    process that hangs or dies says why there)."""
    with open(log, "w") as out:
        try:
            code = subprocess.run([sys.executable, *argv], env=env, timeout=timeout, stdout=out,
                                  stderr=subprocess.STDOUT).returncode
        except subprocess.TimeoutExpired:
            code = None
    lines = log.read_text(errors="replace").strip().splitlines()
    return code, lines[-1][:300] if lines else "no output"


def _run(system: str, workload: Workload, options: dict, timeout: float, scratch: Path, log: Path) -> dict:
    """The system in a process of its own."""
    spec = scratch / f"{log.stem}.json"
    result = spec.with_suffix(".result.json")
    spec.write_text(json.dumps({"system": system, "workload": workload.to_dict(), "options": options}))
    env = dict(os.environ)
    if system == "megacompile" and workload.device.startswith("cuda"):
        # Small budgets on a real device: a block's tensors differ in size from the next's, and
        # fixed segments fragment past the plan's reserve; growable segments do not.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    code, last = _process(["-m", "megacompile.bench.runner", str(spec), str(result)], env, timeout, log)
    if code is None:
        return {"ok": False, "reason": f"did not finish within {timeout:.0f} s (its output: {log})"}
    if not result.exists():
        return {"ok": False, "reason": f"the process died, exit status {code} ({last}; all of it: {log})"}
    return json.loads(result.read_text())


def _weights(workload: Workload, root: Path, timeout: float, scratch: Path, log: Path) -> tuple[str | None, str]:
    """(the folder of the workload's fp32 weights, written now or before; or None and why not)."""
    spec = scratch / "weights.json"
    spec.write_text(json.dumps(workload.to_dict()))
    code, last = _process(["-m", "megacompile.bench.weights", str(spec), str(root)], dict(os.environ), timeout, log)
    if code == 0 and Path(last).is_dir():
        return last, ""
    why = "ran past its time" if code is None else f"exit status {code}: {last}"
    return None, f"the model's weights could not be written into {root} ({why}; all of it: {log})"


def _calibrate(scratch: Path, timeout: float) -> str | None:
    path = scratch / "profile.json"
    code = ("import json, sys, torch; from megacompile.calibrate import measure_gpu; "
            "json.dump(measure_gpu(torch.device('cuda')).to_dict(), open(sys.argv[1], 'w'))")
    try:
        subprocess.run([sys.executable, "-c", code, str(path)], timeout=timeout, capture_output=True)
    except subprocess.TimeoutExpired:
        return None
    return str(path) if path.exists() else None


def run(args, workload: Workload) -> tuple[list[dict], str]:
    deadline = _clock() + args.minutes * 60
    jobs = _jobs(args)
    results: list[dict] = []
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    weights: tuple[str | None, str] | None = None     # (folder, or None and why not), once tried
    with tempfile.TemporaryDirectory(prefix="megacompile-peers-") as tmp:
        scratch = Path(tmp)
        calibrated = str(args.profile) if args.profile else None
        # Only megacompile's rows predict: a call of peers alone spends no time calibrating.
        ours = any(job.system == "megacompile" for job in jobs)
        if calibrated is None and args.calibrate and ours and workload.device.startswith("cuda"):
            calibrated = _calibrate(scratch, 120)
        started = 0
        for n, job in enumerate(jobs):
            merged = budgets.same_plan(workload, job.options["budget"], job.options["updates"], results) \
                if job.system == "megacompile" else None
            if merged is not None:
                print(f"megacompile  {job.setting}: the plan of {merged['setting']} (raised to "
                      f"{merged['hbm_budget_gib']:.3g} GiB, which this one is below); one row for both", flush=True)
                budgets.merge(merged, job.options["budget"])
                continue
            why = _unavailable(job.system, workload)
            if why is None and job.system in NEEDS_WEIGHTS:
                if weights is None:
                    weights = _weights(workload, args.weights or args.out / "weights", max(deadline - _clock(), 20),
                                       scratch, logs / "weights.log")
                why = weights[1] or None
            timeout = None
            if why is None:
                left = deadline - _clock()
                needs = [need_s(j.system, workload) for j in jobs[n:]]
                timeout = share_s(needs, left, first=started == 0)
                if timeout is None:
                    why = (f"needs about {needs[0]:.0f} s and {max(left, 0):.0f} s of --minutes {args.minutes:g} "
                           f"were left: run it in a call of its own ({job.alone()})")
            if why is not None:
                result = {"ok": False, "reason": why}
            else:
                started += 1
                options = dict(job.options)
                if job.system in NEEDS_WEIGHTS:
                    options["weights"] = weights[0]
                if job.system == "megacompile":
                    options.update(calibrated=calibrated, host_budget=args.host_budget, fuse=args.fuse,
                                   host_threads=args.host_threads)
                log = logs / f"{job.system}-{job.setting.replace(' ', '-').replace(',', '')}.log"
                if job.system == "megacompile":
                    options["trace"] = str(log.with_suffix(".trace.json"))
                result = _run(job.system, workload, options, timeout, scratch, log)
            result = {"system": job.system, "setting": job.setting, **result}
            print(_line(result), flush=True)
            results.append(result)
    return results, _reference(results)


def _reference(results: list[dict]) -> str:
    ok = [r for r in results if r.get("ok")]
    return f"{ok[0]['system']} {ok[0]['setting']}" if ok else "none"


def earlier_reference(path: Path) -> dict | None:
    """The first row with losses in an earlier call's peers.csv, as a row of this one's."""
    rows = [r for r in read_csv(path) if r["metric"] == "loss"]
    if not rows:
        return None
    first = [r for r in rows if (r["system"], r["setting"]) == (rows[0]["system"], rows[0]["setting"])]
    first.sort(key=lambda r: int(r["note"].removeprefix("step ")))
    return {"system": rows[0]["system"], "setting": f"{rows[0]['setting']} ({path})", "ok": True,
            "losses": [float(r["value"]) for r in first]}


def check_agreement(results: list[dict], rtol: float, reference: dict | None = None) -> bool:
    """Marks each row with losses_agree and loss_deviation against `reference`'s losses (default:
    the first row that ran); True when every row that ran agrees."""
    ok = [r for r in results if r.get("ok")]
    reference = reference or (ok[0] if ok else None)
    for r in ok:
        r["losses_agree"], r["loss_deviation"] = agree(r["losses"], reference["losses"], rtol)
    return all(r["losses_agree"] for r in ok)


def _line(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['system']:12s} {r['setting']:14s} skipped: {r.get('reason')}\n{r.get('traceback', '')}"
    return (f"{r['system']:12s} {r['setting']:14s} {r['step_s']:.3f} s/step  {r['tokens_per_s']:,.0f} tokens/s  "
            f"{r['tflops_6nd']:.1f} TFLOPS  losses {', '.join(f'{x:.4f}' for x in r['losses'])}"
            + "".join(f"\n{' ' * 27}{line}" for line in thread_sweep(r)))


def main(argv=None) -> int:
    args = _arguments(argv)
    workload = _workload(args)
    results, reference = run(args, workload)
    rtol = BF16_LOSS_RTOL if workload.compute_dtype == torch.bfloat16 else FP32_LOSS_RTOL
    earlier = earlier_reference(args.compare_with) if args.compare_with else None
    if earlier is not None:
        reference = f"{earlier['system']} {earlier['setting']}"
    agreed = check_agreement(results, rtol, earlier)
    ok = [earlier] if earlier else [r for r in results if r.get("ok")]
    fall = loss_fall(ok[0]["losses"]) if ok else None
    from ..acceptance.table import machine
    facts = {**machine(), "megacompile": _version("megacompile"), "deepspeed": _version("deepspeed")}
    described = {**workload.to_dict(), "parameters": workload.parameters, "compute_dtype": str(workload.compute_dtype)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "peers.csv", results, facts)
    (args.out / "peers.md").write_text(markdown(results, facts, described, reference, rtol, fall))
    print((args.out / "peers.md").read_text())
    return 0 if agreed else 1


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
