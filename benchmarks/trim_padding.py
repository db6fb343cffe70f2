"""What cutting a step's rows after their longest document saves a fine-tune of short records.

    python benchmarks/trim_padding.py       # a 4-layer Llama of 256 wide, chats of 1-6 exchanges, seq 256
    python benchmarks/trim_padding.py --stage dpo   # the same model, pairs of a sentence each, 8 pairs a step

The same run.yaml twice, each in a fresh Python on the cpu backend: `trim_padding: true` (rows cut
to seq/8, seq/4, seq/2 or seq: train/data/trim.py) and `false` (every row seq tokens, the peer).
Seconds per step are the median of the steps after the first of each length met (the first at a
length captures and plans); the whole run's seconds too. The losses of the two runs are printed
side by side: the same to float32 rounding. Prints a table and appends to
benchmarks/results/trim_padding.csv (long format, with the machine and its load). No timed
asserts: the figures move with the machine's load.

--stage dpo: a DPO run over short preference pairs (prompt, chosen and rejected a sentence each),
its rows cut as stages dpo, kto and rm cut them; its reward columns are compared too, and its
figures go to benchmarks/results/trim_padding_dpo.csv.

--stage grpo: a GRPO run (beta 0.04: the reference's pass too) over prompts of a sentence each,
4 completions of up to 32 tokens each, in rows of seq (max_prompt_length seq - 32): its rollouts cut
as train/stages/rollout_trim.py cuts them; generation keeps whole rows in both runs. Its reward
column is compared too; its figures go to benchmarks/results/trim_padding_grpo.csv.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SENTENCES = ["the cat sat on the mat", "a dog ran in the park after the ball", "rain fell on the quiet town all night",
             "she wrote a letter to her brother", "the river carried leaves down to the sea"]


def chats(path: str) -> str:
    """Conversations of one to six exchanges: rows filled to several lengths."""
    with open(path, "w") as f:
        for i in range(400):
            turns = []
            for k in range(1 + (i * 7) % 6):
                turns += [{"role": "user", "content": SENTENCES[(i + k) % len(SENTENCES)]},
                          {"role": "assistant", "content": SENTENCES[(i + 2 * k + 1) % len(SENTENCES)]}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


def pairs(path: str) -> str:
    """Preference pairs of a sentence each: rows a tenth of seq 256 or less."""
    with open(path, "w") as f:
        for i in range(200):
            # the chosen sentence the one after the prompt's, the rejected one two to four after it
            f.write(json.dumps({"prompt": SENTENCES[i % 5], "chosen": SENTENCES[(i + 1) % 5],
                                "rejected": SENTENCES[(i + 2 + i // 5 % 3) % 5]}) + "\n")
    return path


def prompts(path: str) -> str:
    """Prompts of a sentence each, with the last word as the answer stage_files' reward looks for."""
    with open(path, "w") as f:
        for s in SENTENCES:
            f.write(json.dumps({"prompt": s, "answer": s.split()[-1]}) + "\n")
    return path


def one_run(args) -> dict:
    sys.path.insert(0, ROOT)
    from megacompile.train import load, log, run
    from tests.train import files
    folder = args.folder
    model = os.path.join(folder, "model")
    if not os.path.isdir(model):
        files.model_dir(model, layers=4, dim=256)
    data = {"dpo": pairs, "grpo": prompts}.get(args.stage, chats)(os.path.join(folder, f"{args.stage}.jsonl"))
    run_dir = os.path.join(folder, args.mode)
    # grpo takes no seq: its rows are max_prompt_length + max_completion_length
    shape = ({"max_prompt_length": args.seq - 32, "max_completion_length": 32, "num_generations": 4, "beta": 0.04,
              "reward_funcs": ["tests.posttrain.stage_files:starts_like_prompt"], "lr": 1e-3}
             if args.stage == "grpo" else {"seq": args.seq})
    c = load(files.run_yaml(os.path.join(folder, f"{args.mode}.yaml"), model=model, stage=args.stage, data=[data],
                            batch=args.batch, steps=args.steps, device="cpu", run_dir=run_dir,
                            trim_padding=args.mode == "trimmed", save_every=False, **shape), [])
    began = time.perf_counter()
    run(c)
    whole = time.perf_counter() - began
    rows = log.read(os.path.join(run_dir, "log.csv"))
    seen, steady = set(), []
    for r in rows:      # the first step at each length captures and plans: left out
        length = int(r["tokens"])
        if length in seen:
            steady.append(float(r["seconds"]))
        seen.add(length)
    return {"step_s": statistics.median(steady), "run_s": whole, "lengths": sorted(seen),
            "losses": [float(r["loss"]) for r in rows],
            "rewards": [float(r[k]) for r in rows for k in ("rewards_chosen", "rewards_rejected", "reward") if k in r]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--stage", choices=("sft", "dpo", "grpo"), default="sft")
    ap.add_argument("--csv", default=None, help="default: benchmarks/results/trim_padding.csv "
                                                "(trim_padding_dpo.csv, _grpo.csv with --stage dpo, grpo)")
    ap.add_argument("--mode", choices=("trimmed", "whole"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode is not None:       # the child
        print(json.dumps(one_run(args)))
        return
    sys.path.insert(0, HERE)
    from plan_time import append_rows
    from provenance import machine_facts
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for mode in ("trimmed", "whole"):
            load = os.getloadavg()[0]
            cmd = [sys.executable, __file__, "--mode", mode, "--folder", folder, "--seq", str(args.seq),
                   "--batch", str(args.batch), "--steps", str(args.steps), "--stage", args.stage]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            results[mode] = {**json.loads(out), "load_before": load, "load_after": os.getloadavg()[0]}
    trimmed, whole = results["trimmed"], results["whole"]
    what = {"dpo": f"{args.batch} pairs ({2 * args.batch} rows) x {args.seq} tokens, pairs of a sentence each",
            "grpo": f"{args.batch} rollouts x {args.seq} tokens, prompts of a sentence, completions of up to 32",
            }.get(args.stage, f"{args.batch} x {args.seq} tokens, chats of 1-6 exchanges")
    print(f"{args.steps} {args.stage} steps of {what}, a 4-layer Llama of 256")
    print(f"{'':>16} {'s/step':>9} {'run s':>8}  input lengths (tokens a step)")
    for mode, r in results.items():
        print(f"{mode:>16} {r['step_s']:>9.3f} {r['run_s']:>8.1f}  {r['lengths']}")
    ratios = whole["step_s"] / trimmed["step_s"], whole["run_s"] / trimmed["run_s"]
    print(f"{'whole / trimmed':>16} {ratios[0]:>8.2f}x {ratios[1]:>7.2f}x")
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(trimmed["losses"], whole["losses"]))
    print(f"losses: largest relative difference {worst:.2e} over {len(whole['losses'])} steps")
    if whole["rewards"]:    # beta (log pi - log pi_ref): a difference of two sums, compared absolutely
        gap = max(abs(a - b) for a, b in zip(trimmed["rewards"], whole["rewards"]))
        print(f"rewards: largest absolute difference {gap:.2e}")
    for mode, r in results.items():
        print(f"{mode}: load average (1 min) {r['load_before']:.2f} -> {r['load_after']:.2f}")
    facts = machine_facts()
    name = "trim_padding.csv" if args.stage == "sft" else f"trim_padding_{args.stage}.csv"
    csv = args.csv or os.path.join(HERE, "results", name)
    append_rows(csv, [{**facts, "seq": args.seq, "batch": args.batch, "steps": args.steps, "mode": mode,
                       "figure": figure, "value": r[figure]}
                      for mode, r in results.items() for figure in ("step_s", "run_s")])


if __name__ == "__main__":
    main()
