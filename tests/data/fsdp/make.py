"""Writes the FSDP checkpoints tests/e2e/test_fsdp_checkpoint.py takes in, each with what torch
itself gathers from it. Run by hand (torch alone; FSDP2 on the CPU, gloo between the ranks):

    python tests/data/fsdp/make.py [CASE ...]      (every case, or those named)
    python tests/data/fsdp/make.py --out DIR --config JSON CASE ...
                        (a larger model, as tests/data/deepspeed/make.py's: its checkpoint alone)

Each case trains the Llama of tests/data/deepspeed/make.py with FSDP2 (fully_shard per decoder
layer, then the model; fsdp1_*: FSDP1, FullyShardedDataParallel wrapping each decoder layer) over two ranks, torch AdamW in the param groups of transformers' Trainer,
for SAVED_AT steps, and saves what Accelerate's FSDP saves with SHARDED_STATE_DICT (FULL_STATE_DICT
for full_*), as checkpoint-N of a Trainer:

    CASE/pytorch_model_fsdp_0/   torch.distributed.checkpoint of {"model": the model's state_dict}
    CASE/optimizer_0/            torch.distributed.checkpoint of {"optimizer": get_optimizer_state_dict}
    (full_*: CASE/pytorch_model_fsdp.bin and CASE/optimizer.bin, the same gathered whole by rank 0)
    CASE/trainer_state.json, config.json
    CASE.expected.safetensors    as tests/data/deepspeed's: master/, exp_avg/, exp_avg_sq/ gathered
                                 whole (full_state_dict), after/ GOING_ON more steps
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("deepspeed_make", os.path.join(HERE, "..", "deepspeed", "make.py"))
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)
WORLD = 2
# full_*: FULL_STATE_DICT; fsdp1_*: FSDP1 (FullyShardedDataParallel, each decoder layer wrapped, orig params as
# Accelerate's default), saved as Accelerate saves it (its sharded state_dict and FSDP.optim_state_dict)
CASES = ("checkpoint-3", "lora_checkpoint-3", "full_checkpoint-3", "fsdp1_checkpoint-3")


def run(name: str, root: str = HERE, sizes: dict | None = None) -> None:
    """The case `name` written under `root`; with `sizes` (LlamaConfig fields over the config's) its
    checkpoint alone, the expected tensors not gathered."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(**(ds.CONFIG | (sizes or {})))
    model = LlamaForCausalLM(config)
    inner = model
    if name.startswith("lora_"):
        import peft
        model = peft.get_peft_model(model, peft.LoraConfig(**ds.LORA))
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    one = name.startswith("fsdp1_")
    if one:
        model = _fsdp1(model, type(inner.model.layers[0]))
    else:
        for layer in inner.model.layers:
            fully_shard(layer)
        fully_shard(model)
    # FSDP1 names its wrapped modules into the parameters' names; its state dicts use the model's own
    named = [(n.replace("_fsdp_wrapped_module.", ""), p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for n, p in named if n in decayed], "weight_decay": ds.WD},
                                   {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}],
                                  lr=ds.LR, betas=ds.BETAS, eps=ds.EPS)

    def step(s: int) -> torch.Tensor:
        ids = ds.batch(s, rank, WORLD)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    for s in range(ds.SAVED_AT):
        step(s)
    out = os.path.join(root, name)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if one:
        _save_fsdp1(model, optimizer, out)
    elif name.startswith("full_"):      # whole tensors gathered to rank 0, saved by it alone
        whole = (get_model_state_dict(model, options=full), get_optimizer_state_dict(model, optimizer, options=full))
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            torch.save(whole[0], os.path.join(out, "pytorch_model_fsdp.bin"))
            torch.save(whole[1], os.path.join(out, "optimizer.bin"))
    else:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(out, "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)},
                 checkpoint_id=os.path.join(out, "optimizer_0"))
    if sizes:
        if rank == 0:
            _finish(out, config)
        dist.destroy_process_group()
        return
    masters, moments = (_gathered_fsdp1(model, optimizer) if one else
                        (get_model_state_dict(model, options=full),
                         get_optimizer_state_dict(model, optimizer, options=full)))     # on rank 0 alone
    expected = {}
    for n, _ in named if rank == 0 else ():
        expected[f"master/{n}"] = masters[n].clone()
        expected |= {f"{t}/{n}": moments["state"][n][t].clone() for t in ("exp_avg", "exp_avg_sq")}
    losses = []
    for s in range(ds.SAVED_AT, ds.SAVED_AT + ds.GOING_ON):
        loss = step(s)
        dist.all_reduce(loss)
        losses.append(loss / WORLD)
        expected[f"after/ids.{s}"] = torch.cat([ds.batch(s, r, WORLD) for r in range(WORLD)])
    masters = _gathered_fsdp1(model, optimizer)[0] if one else get_model_state_dict(model, options=full)
    if rank == 0:
        expected |= {f"after/{n}": masters[n].clone() for n, _ in named}
        expected["after/losses"] = torch.stack(losses)
        save_file({k: v.contiguous() for k, v in expected.items()}, f"{out}.expected.safetensors")
        _finish(out, config)
    dist.destroy_process_group()


def _fsdp1(model, layer_class):
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_class})
    return FullyShardedDataParallel(model, auto_wrap_policy=policy, device_id=torch.device("cpu"), use_orig_params=True)


def _save_fsdp1(model, optimizer, out: str) -> None:
    """As Accelerate's save_fsdp_model and save_fsdp_optimizer write SHARDED_STATE_DICT under FSDP1 (without
    its offload_to_cpu: the ranks are on the CPU, where FSDP1's offload copy corrupts the live AdamW state)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig(),
                              ShardedOptimStateDictConfig()):
        dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(os.path.join(out, "pytorch_model_fsdp_0")))
        dcp.save({"optimizer": FSDP.optim_state_dict(model, optimizer)},
                 storage_writer=dcp.FileSystemWriter(os.path.join(out, "optimizer_0")))


def _gathered_fsdp1(model, optimizer) -> tuple[dict, dict]:
    """The masters and the optimizer state gathered whole by torch's state_dict API (FSDP1's own
    FULL_STATE_DICT gather on the CPU hands back exp_avg_sq's values as exp_avg, or crashes with
    offload_to_cpu), each tensor cloned before the next gather."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    full = StateDictOptions(full_state_dict=True)
    masters = {n: t.clone() for n, t in get_model_state_dict(model, options=full).items()}
    state = get_optimizer_state_dict(model, optimizer, options=full)
    return masters, {"state": {n: {k: v.clone() for k, v in s.items()} for n, s in state["state"].items()}}


def _finish(out: str, config) -> None:
    """Rank 0, the save written: a Trainer's files beside it."""
    config.save_pretrained(out)
    with open(os.path.join(out, "trainer_state.json"), "w") as f:
        json.dump({"global_step": ds.SAVED_AT, "epoch": 0.5, "log_history": []}, f)


if __name__ == "__main__":
    args = ds.arguments(sys.argv[1:], HERE)
    if os.environ.get("LOCAL_RANK") is not None:     # one of a case's ranks
        run(args.cases[0], args.out, args.config)
        sys.exit(0)
    more = ["--out", args.out] + (["--config", json.dumps(args.config)] if args.config else [])
    for name in CASES:
        if args.cases and name not in args.cases:
            continue
        shutil.rmtree(os.path.join(args.out, name), ignore_errors=True)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD),
                        "--master_port", "29534", os.path.abspath(__file__), name, *more], check=True)
