"""`megacompile` / `python -m megacompile`: the command line (plan.py: `megacompile plan`)."""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

from ..errors import MegacompileError
from .plan import DTYPES, plan as _plan


def _train(args: argparse.Namespace) -> int:
    from ..train import load, run
    from ..train.preemption import Preempted
    from ..report.outputs import check_outputs
    check_outputs(trace=args.trace)
    try:
        run(load(args.config, args.overrides), trace=args.trace)
    except Preempted as e:      # a stop signal: the last whole step saved (train/preemption.py)
        import shlex
        again = ["megacompile", "train"] + (["--config", args.config] if args.config else []) + list(args.overrides)
        print(f"megacompile: stopped: {e}\n  resume with   {shlex.join(again + e.resume_overrides)}",
              file=sys.stderr, flush=True)
        return e.exit_code
    return 0


def _json_alone(command):
    """--json: stdout holds the one JSON document (`| jq` reads it) and the human text goes to
    stderr; the command prints its document to args.json_out."""
    def run(args: argparse.Namespace) -> int:
        args.json_out = sys.stdout
        if not args.json:
            return command(args)
        with contextlib.redirect_stdout(sys.stderr):
            return command(args)
    return run


def _calibrate(args: argparse.Namespace) -> int:
    import json

    import torch

    from ..arguments import file_in_the_way
    from ..errors import ArgumentError
    from ..calibrate import measure, measure_gpu
    from ..io import durable
    if args.device == "cuda" and not torch.cuda.is_available():
        raise MegacompileError("--device cuda: torch sees no GPU here; calibrate the cpu profile with --device cpu")
    from ..arguments import disk_folder
    disk_folder("--nvme-dir", args.nvme_dir)     # before measuring: a folder the disk tier could use
    blocker = file_in_the_way(os.path.dirname(os.path.abspath(args.out)))
    if blocker is not None:   # before measuring, which takes a while
        raise ArgumentError(f"--out {args.out} lies under the file {blocker}; give a path in a folder")
    profile = measure_gpu() if args.device == "cuda" else measure()
    if args.nvme_dir is not None:     # the disk tier's disk: sequential O_DIRECT, as the tier reads and writes
        from ..cost.hardware import replace
        from ..disk.bandwidth import measure_disk
        disk = measure_disk(args.nvme_dir)
        if not disk["direct"]:
            print(f"  note: {args.nvme_dir} does not take O_DIRECT; the figures include the page cache")
        profile = replace(profile, disk_read_bw=disk["read_bw"], disk_write_bw=disk["write_bw"])
    for key, value in profile.to_dict().items():
        print(f"  {key:<24} {value:.4g}" if isinstance(value, float) else f"  {key:<24} {value}")
    try:
        durable.replace_text(args.out, json.dumps(profile.to_dict(), indent=1))
    except OSError as e:
        raise MegacompileError(f"cannot write the profile to {args.out}: {e.strerror or e}") from e
    print(f"wrote {args.out}: use it with `megacompile plan --hardware {args.out}`")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megacompile", description="Full-precision LLM training on one GPU.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fine-tune a local Hugging Face model on .jsonl/.txt files (docs/training.md); "
                                     "with no --config, the bundled small Llama on the bundled corpus")
    t.add_argument("--config", default=None, help="run.yaml (default: the embedded default run)")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="settings laid over run.yaml, e.g. lr=2e-5 steps=500")
    t.add_argument("--trace", default=None, metavar="FILE",
                   help="where the last step's Chrome trace goes (default: RUN_DIR/step.json)")
    t.set_defaults(run=_train)

    q = sub.add_parser("plan", help="plan a model from its Hugging Face config.json, or a run from its run.yaml, "
                                    "without weights, data or a GPU")
    what = q.add_mutually_exclusive_group(required=True)
    what.add_argument("--config", default=None,
                      help="config.json (or its folder) of a causal LM or a vision-language model")
    what.add_argument("--run", dest="run_yaml", default=None, metavar="RUN_YAML",
                      help="the run `megacompile train --config RUN_YAML` would start: its model as the run builds "
                           "it (rope_scaling, added tokens, LoRA or frozen layers), its batch, seq, accumulation, "
                           "budgets, dtype and stage; key=value after it as train takes them")
    q.add_argument("overrides", nargs="*", metavar="key=value", help="with --run: settings laid over run.yaml")
    q.add_argument("--hbm-budget", type=float, default=None,
                   help="GiB of device memory the plan may use (default: 90%% of the --hardware card's memory)")
    q.add_argument("--hardware", default=None,
                   help="h100, h100-pcie, h200, gh200, a100, a100-40gb, b200, l40s, rtx6000-ada, rtx-a6000, l4, a10, "
                        "rtx5090, rtx4090, rtx3090, cpu, or a profile.json from `megacompile calibrate` (the faithful "
                        "one); default h100, or cpu for a --run whose run.yaml says device: cpu")
    from ..cost.host import HOSTS
    q.add_argument("--host", default=None, choices=list(HOSTS),
                   help="the host the card sits in: its memory bandwidth, AdamW rate and disk (default: the "
                        "--hardware profile's own; consumer cards a DDR5 desktop, data-centre cards a server)")
    q.add_argument("--host-cores", type=int, default=None,
                   help="the host cores the AdamW updates run on (default: the profile's host: a data-centre "
                        "card's server host is the 16 cores a cloud GPU is given)")
    q.add_argument("--batch", type=int, default=None,
                   help="sequences per step (default 1); with --stage dpo, preference pairs (2 rows each)")
    q.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step: choose the micro-batch and accumulation that train fastest")
    q.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048)")
    q.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="compute dtype (default bfloat16); masters are float32")
    q.add_argument("--updates", choices=["at_commit", "as_gradients_land"], default=None,
                   help="when each host AdamW update starts (compile()'s updates): once the step is known sound "
                        "(default), or as its gradients land, beside the rest of the backward")
    q.add_argument("--host-budget", type=float, default=None,
                   help="GiB of host RAM for masters, AdamW state and offloaded activations (default: 90%% of this "
                        "machine's RAM, or of this process's memory cgroup limit where lower, as compile() takes it; "
                        "give it to plan for another machine); per node with --gpus")
    q.add_argument("--nvme-budget", type=float, default=None,
                   help="GiB of disk for a disk tier: when host RAM is short the AdamW moments, then the fp32 masters, "
                        "go there (default: no disk tier)")
    q.add_argument("--nvme-bandwidth", type=float, default=None,
                   help="GB/s the disk tier's disk reads and writes (default: the hardware profile's disk)")
    q.add_argument("--gpus", type=int, default=1,
                   help="GPUs in all, each running the plan on its own batch (data parallel): per rank memory "
                        "and the throughput of all")
    q.add_argument("--nodes", type=int, default=1, help="machines the GPUs sit in (--gpus a multiple of it)")
    q.add_argument("--network-bandwidth", type=float, default=None,
                   help="GB/s per rank for the gradient and weight collectives (default: the hardware profile's "
                        "intra-node figure, or inter-node with --nodes > 1)")
    q.add_argument("--smallest", action="store_true",
                   help="name the smallest budget any plan fits, the blocks whole or over sequence chunks (each "
                        "chunk count is captured and solved: slower); default: the smallest for the plan's own blocks")
    q.add_argument("--lora-rank", type=int, default=None, metavar="R",
                   help="plan LoRA fine-tuning: adapters of rank R trained, the base frozen (no masters or AdamW "
                        "state for it, no gradient offload)")
    q.add_argument("--lora-target", default=None,
                   help="with --lora-rank: the Linear modules given adapters, comma-separated (default: all, every "
                        "Linear of the decoder blocks)")
    q.add_argument("--images-per-row", type=int, default=0, metavar="N",
                   help="a vision-language model (LLaVA, Gemma 3, Idefics3, SmolVLM, Qwen2.5-VL, Qwen3-VL, "
                        "Qwen3.5): N images in every row, laid out as its processor writes them; their image "
                        "tokens count in --seq (default 0: text alone)")
    q.add_argument("--image-size", type=int, default=None, metavar="PX",
                   help="pixels per side of each image (default: the vision tower's); LLaVA and Gemma 3 resize every "
                        "image to the tower's size, Idefics3 and SmolVLM split it into tiles of that size, "
                        "Qwen2.5-VL keeps it (resized to whole patches; required for it)")
    q.add_argument("--json", action="store_true",
                   help="print the plan as one JSON document on stdout (the text summary goes to stderr)")
    q.add_argument("--trace", default=None, metavar="FILE",
                   help="write the predicted step as a Chrome trace (open it in Perfetto or chrome://tracing)")
    q.add_argument("--plot", default=None, metavar="DIR",
                   help="write DIR/memory.png, device and host memory over the schedule (needs matplotlib)")
    s = q.add_argument_group("post-training (--stage; keys by TRL's names, docs/posttraining.md)")
    s.add_argument("--stage", default=None,
                   help="sft, pt, dpo, kto, rm or grpo: the predicted step of that stage, part by part (generation, the "
                        "forward-only passes, the training steps) and in all")
    s.add_argument("--precompute-ref-log-probs", action="store_true", default=None,
                   help="dpo: the reference's log-probabilities are given, no reference forward per step")
    s.add_argument("--sync-ref-model", action="store_true", default=None,
                   help="dpo: the reference moves (TRL's sync_ref_model): a second engine runs it every step, its "
                        "weights a second copy on the host")
    s.add_argument("--loss-type", default=None,
                   help="dpo: TRL's loss_type, or several joined by commas (default sigmoid; simpo and orpo read no "
                        "reference); kto: kto (default) or apo_zero_unpaired")
    s.add_argument("--prompts", type=int, default=None, help="grpo: prompts per rollout batch (default 1)")
    s.add_argument("--num-generations", type=int, default=None, help="grpo: completions per prompt (default 8)")
    s.add_argument("--max-prompt-length", type=int, default=None, help="grpo: prompt tokens (default 512)")
    s.add_argument("--max-completion-length", type=int, default=None, help="grpo: completion tokens (default 256)")
    s.add_argument("--num-iterations", type=int, default=None,
                   help="grpo: optimizer steps per rollout batch (default 1)")
    s.add_argument("--steps-per-generation", type=int, default=None,
                   help="grpo: micro-batches the rollout batch is cut into, one optimizer step of them (default 1)")
    s.add_argument("--beta", type=float, default=None, help="grpo: the KL coefficient; > 0 adds a reference forward "
                                                           "(default 0)")
    s.add_argument("--generator", default=None,
                   help="grpo: engine (default: the engine's own forward, the rows at full width, once per token) "
                        "or kv_cache (a bfloat16 copy with a key-value cache: what one would take) or hf_streamed "
                        "(that copy's layers streamed from the host every token)")
    q.set_defaults(run=_json_alone(_plan), grad_accum=1, accumulation=None)

    c = sub.add_parser("calibrate", help="measure this machine's GPU and host into a hardware profile")
    c.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    c.add_argument("--out", default="profile.json", help="where to write the profile (JSON)")
    c.add_argument("--nvme-dir", default=None,
                   help="measure the disk tier's disk here (1 GiB written and read back); default: keep the "
                        "profile's disk figures")
    c.set_defaults(run=_calibrate)

    from .export import add_to as add_export      # export.py: `megacompile export`
    add_export(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except MegacompileError as e:
        print(f"megacompile: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:    # a file the command reads or writes: say which and why, without a traceback
        print(f"megacompile: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
