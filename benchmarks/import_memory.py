"""Host RAM of a sharded checkpoint's import, measured: the peak resident set while
engine.load_trainer_checkpoint takes in a DeepSpeed ZeRO or an FSDP2 save of a ~320M Llama
(io/sharded_checkpoint.py), beside the resident set before it (the engine's host state built) and
the plan's host figure.

    python benchmarks/import_memory.py [--dir /tmp/megacompile_import_memory] [--layouts zero2,fsdp]
                                       [--deepspeed DIR] [--repeat N] [--csv PATH] [--keep]

Each layout's checkpoint is written once under --dir by the trainer itself, two ranks on the CPU
with gloo (tests/data/deepspeed/make.py, tests/data/fsdp/make.py with --config SIZES: fp32 masters
and AdamW's moments after three steps), and reused while its folder is there; --keep leaves them
(4-5 GiB each), else they are deleted at the end (zero3 and fsdp_full are there too, not by default;
writing one takes some 10-13 GiB of RAM over the two ranks, an import some 6 GiB, a minute or two
each on two cores). DeepSpeed need not be in this environment:
--deepspeed names a folder it was installed into (pip install --target), put on the writer's
PYTHONPATH. Each import runs in a fresh process (this file with --child): a tiny fixture of the
same layout is taken in first (imports, thread pools), then the engine is built and its host state
allocated (prepare), the freed heap given back, and VmHWM reset; a thread samples /proc/self/status
every 2 ms through load_trainer_checkpoint. The excess is the peak less the resident set before,
also in units of the largest parameter's fp32 bytes (the claim: about one). RssFile is the
checkpoint's file pages mapped into the process (memory-mapped DeepSpeed files), RssAnon the
process's own memory. Prints a table; --csv writes the long-format rows with provenance.
"""
from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import provenance

DATA = os.path.join(provenance.ROOT, "tests", "data")
# hidden 1024, 20 layers, a 32000-token vocabulary: 322M parameters, the largest (embeddings,
# lm_head) 131 MB in fp32
SIZES = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=256)
# layout: (the fixture writer, its case, a tiny fixture of the layout to take in first, described)
LAYOUTS = {
    "zero2": ("deepspeed", "zero2", "deepspeed/zero2", "DeepSpeed ZeRO-2, 2 ranks"),
    "zero3": ("deepspeed", "zero3", "deepspeed/zero3", "DeepSpeed ZeRO-3, 2 ranks"),
    "fsdp": ("fsdp", "checkpoint-3", "fsdp/checkpoint-3", "FSDP2 SHARDED_STATE_DICT, 2 ranks"),
    "fsdp_full": ("fsdp", "full_checkpoint-3", "fsdp/full_checkpoint-3", "FSDP2 FULL_STATE_DICT"),
}
STATUS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM")
GIB = 2 ** 30


# -- the child: one import, measured --------------------------------------------------------------
def status() -> dict[str, int]:
    """/proc/self/status's memory lines (STATUS) in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS:
                out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """/proc/self/status every `every` seconds: the peak of each figure, and the figures at VmRSS's peak."""

    def __init__(self, every: float = 0.002):
        super().__init__(daemon=True)
        self.every, self.done = every, threading.Event()
        self.peak: dict[str, int] = {}
        self.at_peak: dict[str, int] = {}
        self.samples = 0

    def run(self) -> None:
        while not self.done.is_set():
            now = status()
            self.samples += 1
            for k, v in now.items():
                self.peak[k] = max(self.peak.get(k, 0), v)
            if now["VmRSS"] >= self.at_peak.get("VmRSS", 0):
                self.at_peak = now
            time.sleep(self.every)

    def stop(self) -> None:
        self.done.set()
        self.join()


def engine_for(config: dict, seed: int = 1):
    """An engine of the fixtures' Llama at `config`, with make.py's AdamW, its host state built."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import megacompile
    from megacompile.acceptance.models import batch
    ds = _fixtures("deepspeed")
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config))
    optimizer = megacompile.AdamW(lr=ds.LR, betas=ds.BETAS, eps=ds.EPS, weight_decay=ds.WD,
                                  max_grad_norm=float("inf"), no_decay=megacompile.hf_no_decay)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=optimizer)
    del model
    ids = batch(config["vocab_size"], 1, 16)
    engine.prepare(input_ids=ids, labels=ids)
    return engine


def child(layout: str, folder: str) -> None:
    from megacompile.runtime import host_heap
    ds = _fixtures("deepspeed")
    tiny = engine_for(ds.CONFIG)
    tiny.load_trainer_checkpoint(os.path.join(DATA, LAYOUTS[layout][2]))
    del tiny
    config = ds.CONFIG | SIZES
    engine = engine_for(config)
    gc.collect()
    host_heap.give_back_freed()
    before = status()
    with open("/proc/self/clear_refs", "w") as f:     # VmHWM from here on
        f.write("5")
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    engine.load_trainer_checkpoint(folder)
    seconds = time.perf_counter() - start
    sampler.stop()
    hwm = status()["VmHWM"]
    after = status()
    assert engine.state.steps_done == ds.SAVED_AT, engine.state.steps_done
    params = list(engine.model.parameters())
    print(json.dumps({
        "layout": layout, "params": sum(p.numel() for p in params),
        "largest_param_bytes": max(4 * p.numel() for p in params),
        "planned_host_bytes": engine.host_cost.ram_bytes, "host_bytes": engine.memory_stats()["host_bytes"],
        "before": before, "peak": sampler.peak, "at_peak": sampler.at_peak, "hwm": hwm, "after": after,
        "samples": sampler.samples, "seconds": seconds,
    }))


# -- the parent: checkpoints written, imports measured, the table --------------------------------
def _fixtures(layout: str):
    spec = importlib.util.spec_from_file_location(f"{layout}_fixtures", os.path.join(DATA, layout, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint(layout: str, root: str, deepspeed: str | None) -> str:
    """The layout's checkpoint under `root`, written by its trainer unless a finished one is there."""
    writer, case, _, _ = LAYOUTS[layout]
    folder, done = os.path.join(root, layout, case), os.path.join(root, f"{layout}.written")
    if os.path.isfile(done) and os.path.isdir(folder):
        return folder
    shutil.rmtree(os.path.join(root, layout), ignore_errors=True)
    env = dict(os.environ)
    if writer == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        if deepspeed:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (deepspeed, env.get("PYTHONPATH")) if p)
        elif importlib.util.find_spec("deepspeed") is None:
            raise SystemExit("writing a DeepSpeed checkpoint needs DeepSpeed: DS_BUILD_OPS=0 pip install --target DIR "
                             "--no-build-isolation deepspeed hjson ninja py-cpuinfo msgpack einops --no-deps, then "
                             "--deepspeed DIR")
    print(f"writing {LAYOUTS[layout][3]} into {folder} ...", flush=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, os.path.join(DATA, writer, "make.py"), "--out", os.path.join(root, layout),
                    "--config", json.dumps(SIZES), case], env=env, cwd=provenance.ROOT, check=True,
                   stdout=subprocess.DEVNULL)
    print(f"  written in {time.perf_counter() - start:.0f} s", flush=True)
    with open(done, "w") as f:
        f.write(json.dumps(SIZES) + "\n")
    return folder


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def measure(layout: str, folder: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", layout, folder],
                         capture_output=True, text=True, cwd=provenance.ROOT)
    if out.returncode != 0:
        raise SystemExit(f"the import of {folder} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.path.join("/tmp", "megacompile_import_memory"),
                        help="where the checkpoints are written (and reused)")
    parser.add_argument("--layouts", default="zero2,fsdp", help=f"of {', '.join(LAYOUTS)}, comma-separated")
    parser.add_argument("--deepspeed", default=None, help="a folder DeepSpeed was installed into (pip --target)")
    parser.add_argument("--csv", default=None, help="write the long-format rows here")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints under --dir")
    parser.add_argument("--repeat", type=int, default=1, help="imports measured per layout, each in a fresh process")
    parser.add_argument("--child", nargs=2, metavar=("LAYOUT", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    layouts = [name.strip() for name in args.layouts.split(",") if name.strip()]
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or not layouts:
        parser.error(f"unknown layouts {unknown}: of {', '.join(LAYOUTS)}")
    root = os.path.abspath(args.dir)
    if root == str(provenance.ROOT) or root.startswith(str(provenance.ROOT) + os.sep):
        parser.error("--dir lies in the checkout: the checkpoints are some GiB each")
    os.makedirs(root, exist_ok=True)
    facts, rows, results = provenance.machine_facts(), [], []
    try:
        for layout in layouts:
            folder = checkpoint(layout, root, args.deepspeed)
            for run in range(args.repeat):
                r = measure(layout, folder)
                r["disk_bytes"], r["run"] = disk_bytes(folder), run
                results.append(r)
    finally:
        if not args.keep:
            for layout in layouts:
                shutil.rmtree(os.path.join(root, layout), ignore_errors=True)
                if os.path.exists(os.path.join(root, f"{layout}.written")):
                    os.remove(os.path.join(root, f"{layout}.written"))
            if not os.listdir(root):
                os.rmdir(root)
    print(f"\n{'layout':10} {'params':>12} {'ckpt GiB':>9} {'plan GiB':>9} {'before':>7} {'peak':>7} {'excess':>7} "
          f"{'x param':>8} {'file+':>7} {'anon+':>7} {'kept':>7} {'s':>6}")
    for r in results:
        before, peak = r["before"]["VmRSS"], max(r["hwm"], r["peak"]["VmRSS"])
        excess = peak - before
        units = excess / r["largest_param_bytes"]
        file = r["at_peak"]["RssFile"] - r["before"]["RssFile"]
        anon = r["at_peak"]["RssAnon"] - r["before"]["RssAnon"]
        kept = r["after"]["VmRSS"] - before
        print(f"{r['layout']:10} {r['params']:>12,} {r['disk_bytes'] / GIB:>9.2f} "
              f"{r['planned_host_bytes'] / GIB:>9.2f} {before / GIB:>7.2f} {peak / GIB:>7.2f} {excess / GIB:>7.3f} "
              f"{units:>8.2f} {file / GIB:>7.3f} {anon / GIB:>7.3f} {kept / GIB:>7.3f} {r['seconds']:>6.1f}")
        metrics = {"checkpoint_bytes": r["disk_bytes"], "planned_host_bytes": r["planned_host_bytes"],
                   "host_bytes": r["host_bytes"], "rss_before_bytes": before, "rss_peak_bytes": peak,
                   "rss_excess_bytes": excess, "excess_in_largest_params": units,
                   "largest_param_bytes": r["largest_param_bytes"], "rss_file_growth_at_peak_bytes": file,
                   "rss_anon_growth_at_peak_bytes": anon, "rss_kept_after_bytes": kept, "import_seconds": r["seconds"]}
        for metric, value in metrics.items():
            rows.append({**facts, "benchmark": "import_memory", "layout": r["layout"], "run": r["run"],
                         "params": r["params"], "metric": metric, "value": value})
    print("(GiB; before: VmRSS with the host state built; peak: VmHWM during the import; excess: peak - before; "
          "x param: the excess over the largest parameter's fp32 bytes; file+, anon+: RssFile's and RssAnon's "
          "growth at the sampled peak; kept: VmRSS after the import - before)")
    if args.csv:
        provenance.write_rows(args.csv, rows)


if __name__ == "__main__":
    main()
