"""`python -m megacompile.bench peers`: one model, one device, one table. megacompile at three
budgets (every weight resident; half the bf16 weights; 0.34x of them, the ratio of 80 GiB to a 118B
model's weights, so every block streams) beside DeepSpeed ZeRO-3 offload and FSDP2 CPU offload,
on the same model, seed and batches. Each system runs in its own process (runner.py); one that
cannot run here is skipped with its reason. Writes peers.csv (long) and peers.md into --out."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from .agreement import BF16_LOSS_RTOL, FP32_LOSS_RTOL, agree
from .table import markdown, write_csv
from .workload import Workload

# The streamed budget first: with the peers right after it, the rows the comparison rests on run
# before the others if --minutes runs short.
MEGACOMPILE_BUDGETS = ("0.34", "0.5", "resident")


def _arguments(argv):
    p = argparse.ArgumentParser(prog="python -m megacompile.bench peers", description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the cpu half: a 4-layer toy on the cpu backend, in fp32")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for peers.csv and peers.md")
    p.add_argument("--shape", default=None, help="llama-3b (default on a GPU), llama-7b or tiny")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--systems", default="megacompile,deepspeed,fsdp2", help="comma-separated, of megacompile, deepspeed, fsdp2")
    p.add_argument("--budgets", default=",".join(MEGACOMPILE_BUDGETS),
                   help="megacompile's budgets: resident, or fractions of the bf16 weights")
    p.add_argument("--minutes", type=float, default=9.5, help="time for the whole call; late systems are skipped")
    p.add_argument("--calibrate", action=argparse.BooleanOptionalAction, default=True,
                   help="measure this GPU's profile first, for the calibrated prediction")
    return p.parse_args(argv)


def _workload(args) -> Workload:
    tiny = args.tiny or not torch.cuda.is_available()
    return Workload(shape=args.shape or ("tiny" if tiny else "llama-3b"),
                    batch=args.batch or (2 if tiny else 4), seq=args.seq or (32 if tiny else 2048),
                    steps=args.steps or 3, warmup=args.warmup,
                    device="cpu" if tiny else "cuda")


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


def _run(system: str, workload: Workload, options: dict, timeout: float, scratch: Path, log: Path) -> dict:
    """The system in a process of its own, its output in `log` (kept: a system that hangs or dies
    says why there)."""
    spec = scratch / f"{log.stem}.json"
    result = spec.with_suffix(".result.json")
    spec.write_text(json.dumps({"system": system, "workload": workload.to_dict(), "options": options}))
    env = dict(os.environ)
    if system == "megacompile" and workload.device.startswith("cuda"):
        # Small budgets on a real device: a block's tensors differ in size from the next's, and
        # fixed segments fragment past the plan's reserve; growable segments do not.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with open(log, "w") as out:
        try:
            proc = subprocess.run([sys.executable, "-m", "megacompile.bench.runner", str(spec), str(result)],
                                  env=env, timeout=timeout, stdout=out, stderr=subprocess.STDOUT)
        except subprocess.TimeoutExpired:
            return {"ok": False, "reason": f"did not finish within {timeout:.0f} s (its output: {log})"}
    if not result.exists():
        lines = log.read_text(errors="replace").strip().splitlines()
        return {"ok": False, "reason": f"the process died, exit status {proc.returncode} "
                                       f"({lines[-1][:300] if lines else 'no output'}; all of it: {log})"}
    return json.loads(result.read_text())


def _calibrate(scratch: Path, timeout: float) -> str | None:
    path = scratch / "profile.json"
    code = ("import json, sys, torch; from megacompile.calibrate import measure_gpu; "
            "json.dump(measure_gpu(torch.device('cuda')).to_dict(), open(sys.argv[1], 'w'))")
    try:
        subprocess.run([sys.executable, "-c", code, str(path)], timeout=timeout, capture_output=True)
    except subprocess.TimeoutExpired:
        return None
    return str(path) if path.exists() else None


def run(args) -> tuple[list[dict], Workload, str]:
    workload = _workload(args)
    deadline = time.monotonic() + args.minutes * 60
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    ours = [("megacompile", f"budget {b}", {"budget": b}) for b in args.budgets.split(",") if "megacompile" in systems]
    jobs = ours[:1] + [(s, "offload", {}) for s in systems if s != "megacompile"] + ours[1:]
    results = []
    logs = args.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="megacompile-peers-") as tmp:
        scratch = Path(tmp)
        calibrated = _calibrate(scratch, 120) if args.calibrate and workload.device.startswith("cuda") else None
        for n, (system, setting, options) in enumerate(jobs):
            left = deadline - time.monotonic()
            share = left / (len(jobs) - n)       # what is left, shared by the systems not yet run
            why = _unavailable(system, workload)
            if why is None and left < 20:
                why = f"too little of --minutes {args.minutes:g} was left ({left:.0f} s)"
            if why is not None:
                result = {"ok": False, "reason": why}
            else:
                if system == "megacompile" and calibrated:
                    options = {**options, "calibrated": calibrated}
                log = logs / f"{system}-{setting.replace(' ', '-')}.log"
                result = _run(system, workload, options, max(share, 20), scratch, log)
            result = {"system": system, "setting": setting, **result}
            print(_line(result), flush=True)
            results.append(result)
    return results, workload, _reference(results)


def _reference(results: list[dict]) -> str:
    ok = [r for r in results if r.get("ok")]
    return f"{ok[0]['system']} {ok[0]['setting']}" if ok else "none"


def check_agreement(results: list[dict], rtol: float) -> bool:
    """Marks each row with losses_agree and loss_deviation against the first row that ran; True
    when every row that ran agrees."""
    ok = [r for r in results if r.get("ok")]
    for r in ok:
        r["losses_agree"], r["loss_deviation"] = agree(r["losses"], ok[0]["losses"], rtol)
    return all(r["losses_agree"] for r in ok)


def _line(r: dict) -> str:
    if not r.get("ok"):
        return f"{r['system']:12s} {r['setting']:14s} skipped: {r.get('reason')}\n{r.get('traceback', '')}"
    return (f"{r['system']:12s} {r['setting']:14s} {r['step_s']:.3f} s/step  {r['tokens_per_s']:,.0f} tokens/s  "
            f"{r['tflops_6nd']:.1f} TFLOPS  losses {', '.join(f'{x:.4f}' for x in r['losses'])}")


def main(argv=None) -> int:
    args = _arguments(argv)
    results, workload, reference = run(args)
    rtol = BF16_LOSS_RTOL if workload.compute_dtype == torch.bfloat16 else FP32_LOSS_RTOL
    agreed = check_agreement(results, rtol)
    from ..acceptance.table import machine
    facts = {**machine(), "megacompile": _version("megacompile"), "deepspeed": _version("deepspeed")}
    described = {**workload.to_dict(), "parameters": workload.parameters, "compute_dtype": str(workload.compute_dtype)}
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "peers.csv", results, facts)
    (args.out / "peers.md").write_text(markdown(results, facts, described, reference, rtol))
    print((args.out / "peers.md").read_text())
    return 0 if agreed else 1


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
