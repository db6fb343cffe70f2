"""Writes the DeepSpeed checkpoints tests/e2e/test_deepspeed_checkpoint.py takes in, each with what
DeepSpeed itself says it holds. Run by hand where DeepSpeed is installed (these were written by
DeepSpeed 0.19.8 on the CPU accelerator, gloo between the ranks):

    python tests/data/deepspeed/make.py [CASE ...]      (every case, or those named)
    python tests/data/deepspeed/make.py --out DIR --config JSON CASE ...
                        (a larger model, LlamaConfig's fields in JSON over CONFIG's, saved under DIR:
                         its checkpoint alone, for benchmarks/import_memory.py)

Each case trains a small Llama for SAVED_AT steps with ZeRO at its stage and world size, its AdamW
param groups as transformers' Trainer makes them (decayed, then exempt), and saves:

    CASE/                        DeepSpeed's save_checkpoint (latest, global_stepN/); a Trainer
                                 case also holds trainer_state.json and config.json, as checkpoint-N
    CASE.expected.safetensors    per parameter: master/, exp_avg/, exp_avg_sq/ as DeepSpeed's
                                 safe_get_full_fp32_param and safe_get_full_optimizer_state gather
                                 them; after/ the fp32 masters after GOING_ON more steps on batches
                                 after/ids.N (every rank's rows, in rank order), whose losses
                                 (averaged over the ranks) are in after/losses
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SAVED_AT, GOING_ON, ROWS, SEQ = 3, 2, 2, 8     # ROWS: each rank's micro-batch
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
PLUS = 4.0      # lora_plus_*: LoRA+'s ratio, each B at LR x PLUS
# Sizes not multiples of the ranks or of ZeRO's alignment, so that the files hold padding; the
# vocabulary of tests/train/files.tokenizer(), so that a run.yaml goes on from checkpoint-3.
CONFIG = dict(vocab_size=51, hidden_size=18, intermediate_size=22, num_hidden_layers=2, num_attention_heads=3,
              num_key_value_heads=1, max_position_embeddings=32)
# name: (ZeRO stage, ranks, bf16, tied embeddings, more zero_optimization settings, a Trainer's checkpoint-N);
# a case named lora_* trains PEFT LoRA adapters (LORA) on the frozen model, lora_plus_* in LlamaFactory's LoRA+
# param groups (each B at LR x PLUS, the empty groups as it passes them); adam_l2_* torch's Adam, whose
# weight decay is L2 (added to the gradient), not AdamW's; sgd_* torch's SGD with momentum; *_offload
# DeepSpeed's own CPU Adam (ZeRO-Offload, its adamw_mode), the optimizer of offload runs.
CASES = {
    "zero1": (1, 2, False, False, {}, False),
    "zero2": (2, 2, False, False, {}, False),
    "zero2_aligned": (2, 2, False, False, {"parameter_alignment": True}, False),
    "zero3": (3, 2, False, False, {}, False),
    "zero3_four_ranks_tied_subgroups": (3, 4, False, True, {"sub_group_size": 200}, False),
    "bf16_zero1": (1, 2, True, False, {}, False),
    "checkpoint-3": (3, 2, True, False, {}, True),
    "lora_zero2": (2, 2, False, False, {}, False),
    "lora_zero3": (3, 2, False, False, {}, False),
    "lora_plus_zero2": (2, 2, False, False, {}, False),
    "adam_l2_zero2": (2, 2, False, False, {}, False),
    "sgd_zero2": (2, 2, False, False, {}, False),
    "zero3_offload": (3, 2, False, False, {"offload_optimizer": {"device": "cpu"}}, False),
}
LORA = dict(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 7)
    return torch.randint(0, CONFIG["vocab_size"], (ROWS * world, SEQ), generator=g)[rank * ROWS:(rank + 1) * ROWS]


def trained(model) -> list:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def run(name: str, root: str = HERE, sizes: dict | None = None) -> None:
    """The case `name` written under `root`; with `sizes` (LlamaConfig fields over CONFIG's) its
    checkpoint alone, the expected tensors not gathered."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    stage, world, bf16, tied, more, trainer = CASES[name]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    zero = {"stage": stage} | more
    if sizes:       # DeepSpeed allocates its buckets whole: 500M elements each by default
        zero |= {"reduce_bucket_size": 5e7, "allgather_bucket_size": 5e7, "stage3_prefetch_bucket_size": 5e7}
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_clipping": 0.0, "zero_optimization": zero,
           "bf16": {"enabled": bf16}, "zero_force_ds_cpu_optimizer": False, "steps_per_print": 10 ** 6}
    torch.manual_seed(0)
    config = LlamaConfig(**(CONFIG | (sizes or {})), tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    if name.startswith("lora_"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA))
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": WD},
              {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
    if name.startswith("lora_plus"):       # LlamaFactory's LoRA+ groups (its _create_loraplus_optimizer)
        plus = {n for n, p in named if "lora_B" in n or p.ndim == 1}
        groups = [{"params": [p for n, p in named if n not in plus], "lr": LR, "weight_decay": WD},
                  {"params": [p for n, p in named if n in plus and n in decayed], "lr": LR * PLUS, "weight_decay": WD},
                  {"params": [p for n, p in named if n in plus and n not in decayed], "lr": LR * PLUS,
                   "weight_decay": 0.0},
                  {"params": [], "lr": 1e-6, "weight_decay": WD}]
    if name.startswith("sgd_"):
        optimizer = torch.optim.SGD(groups, lr=LR, momentum=0.9)
        cfg["zero_allow_untested_optimizer"] = True
    else:
        adam = torch.optim.Adam if name.startswith("adam_l2") else torch.optim.AdamW
        optimizer = adam(groups, lr=LR, betas=BETAS, eps=EPS)
    if name.endswith("_offload"):      # DeepSpeed makes its CPU Adam over the same groups
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                         "weight_decay": WD}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=cfg)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    step_of = lambda s: engine(input_ids=(ids := batch(s, rank, world)), labels=ids).loss   # noqa: E731
    for step in range(SAVED_AT):
        engine.backward(step_of(step))
        engine.step()
    out = os.path.join(root, name)
    engine.save_checkpoint(out)
    if sizes:
        if rank == 0:
            _finish(out, config, trainer)
        return
    expected = {}
    if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):     # ZeRO 1/2 link them lazily
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for n, p in trained(engine.module):
        master = safe_get_full_fp32_param(p)
        moments = {table: safe_get_full_optimizer_state(p, table) for table in
                   (("momentum_buffer",) if name.startswith("sgd_") else ("exp_avg", "exp_avg_sq"))}
        if rank == 0:
            expected[f"master/{n}"] = master.clone()
            expected |= {f"{table}/{n}": t.clone() for table, t in moments.items()}
    losses = []
    for step in range(SAVED_AT, SAVED_AT + GOING_ON):
        loss = step_of(step)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().float().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean / world)
        expected[f"after/ids.{step}"] = torch.cat([batch(step, r, world) for r in range(world)])
    for n, p in trained(engine.module):
        master = safe_get_full_fp32_param(p)
        if rank == 0:
            expected[f"after/{n}"] = master.clone()
    if rank == 0:
        expected["after/losses"] = torch.stack(losses)
        save_file({k: v.contiguous() for k, v in expected.items()}, f"{out}.expected.safetensors")
        _finish(out, config, trainer)


def _finish(out: str, config, trainer: bool) -> None:
    """Rank 0, the save written: DeepSpeed's scripts beside it removed, a Trainer's files added."""
    for spare in ("zero_to_fp32.py", "zero_to_torch.py"):
        if os.path.exists(os.path.join(out, spare)):
            os.remove(os.path.join(out, spare))
    if trainer:
        config.save_pretrained(out)
        with open(os.path.join(out, "trainer_state.json"), "w") as f:
            json.dump({"global_step": SAVED_AT, "epoch": 0.5, "log_history": []}, f)


def arguments(argv: list[str], here: str = HERE) -> argparse.Namespace:
    """make.py's command line (this one's, and tests/data/fsdp/make.py's with its folder `here`)."""
    parser = argparse.ArgumentParser(description="Writes checkpoint fixtures by the trainer itself.")
    parser.add_argument("cases", nargs="*", help="the cases to write (every one if none)")
    parser.add_argument("--out", default=here, help=f"the folder the cases go in ({here})")
    parser.add_argument("--config", type=json.loads, default=None,
                        help="LlamaConfig fields over CONFIG's, as JSON: the checkpoint alone is written")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = arguments(sys.argv[1:])
    if os.environ.get("LOCAL_RANK") is not None:     # one of a case's ranks
        run(args.cases[0], args.out, args.config)
        sys.exit(0)
    more = ["--out", args.out] + (["--config", json.dumps(args.config)] if args.config else [])
    for name, (_, world, *_) in CASES.items():
        if args.cases and name not in args.cases:
            continue
        shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                        "--master_port", "29533", os.path.abspath(__file__), name, *more], check=True)
