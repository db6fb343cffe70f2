"""megacompile's peers in the bench, each on one rank in a process of its own: FSDP2 CPU offload
with torch's AdamW on the host, and DeepSpeed ZeRO-3 with its parameters and optimizer offloaded
to the host and DeepSpeedCPUAdam. Both keep fp32 masters and AdamW state on the host and compute
in bf16, as megacompile does."""
from __future__ import annotations

import itertools
import os
import tempfile
import time

import torch

from .timing import memory, say, timed
from .weights import read
from .workload import Workload


def _one_rank_group(backend: str) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        return
    # The one rank meets itself through a file store in a folder of its own: a TCP store needs a
    # free port, and one picked free can be taken before the store listens on it (another process,
    # or an earlier group's closing socket). DeepSpeed reads the rank from the environment and,
    # finding the group made, opens none of its own.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    folder = tempfile.mkdtemp(prefix="megacompile-bench-group-")
    dist.init_process_group(backend, init_method=f"file://{folder}/store", rank=0, world_size=1)


def set_lr(groups, lr: float) -> None:
    """The step's rate (Workload.lr_at) into a torch optimizer's groups, which it reads as it steps."""
    for group in groups:
        group["lr"] = lr


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp2(workload: Workload, fused: bool = True) -> dict:
    """FSDP2 (`fully_shard`) on one rank: on a GPU with CPUOffloadPolicy, fp32 parameters and AdamW
    state on the host, bf16 compute; on the cpu half over gloo. fused: torch's fused AdamW kernel
    steps the host parameters (`AdamW(fused=True)`, the fair peer of a host AdamW kernel); else
    torch's default there, a loop over the parameters."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    cuda = workload.device.startswith("cuda")
    _one_rank_group("nccl" if cuda else "gloo")
    try:
        mesh = init_device_mesh("cuda" if cuda else "cpu", (1,))
        model = workload.model()
        kwargs = {"mesh": mesh}
        if cuda:
            kwargs.update(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
                          offload_policy=CPUOffloadPolicy(pin_memory=True))
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        say("model built and sharded")
        optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=workload.weight_decay,
                                      fused=fused)
        device = torch.device(workload.device)
        steps = itertools.count(1)

        def step(ids, labels):
            loss = model(ids.to(device), labels.to(device))
            loss.backward()
            set_lr(optimizer.param_groups, workload.lr_at(next(steps)))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().float().cpu()
        out = {"host_adamw": "fused" if fused else "for-loop", **timed(workload, step)}
        out.update(memory(workload.device))
        return out
    finally:
        dist.destroy_process_group()


def deepspeed_config(workload: Workload) -> dict:
    return {
        "train_micro_batch_size_per_gpu": workload.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": workload.lr, "weight_decay": workload.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        # No clipping, as the other systems step: DeepSpeed clips the gradients' total norm to 1.0
        # unless told otherwise (its default since 0.19.3), and a random-init model's norm is above
        # it at every step, so each step's AdamW would see its gradients scaled by another factor.
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def run_deepspeed(workload: Workload, weights: str) -> dict:
    """DeepSpeed ZeRO-3 with offload_param and offload_optimizer to pinned CPU memory and
    DeepSpeedCPUAdam (AdamW mode), bf16 compute. The model is built under `deepspeed.zero.Init`:
    each module's parameters are partitioned to the host as it is built, so the whole model is
    never on the GPU. zero.Init initialises them in bf16 on the GPU; the bf16 parameters and the
    fp32 masters are then set from the fp32 weights in `weights` (bench/weights.py), as every
    other system starts. The CPUAdam op is built (or loaded) first, timed on its own."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param
    out = {"cpu_adam_op_s": build_cpu_adam()}
    say(f"DeepSpeedCPUAdam op ready in {out['cpu_adam_op_s']:.1f} s")
    _one_rank_group("nccl")
    config = deepspeed_config(workload)
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = workload.model()
    say("model built under zero.Init")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    say("deepspeed.initialize done")
    params = dict(engine.module.named_parameters())
    for name, value in read(weights, list(params)):
        p = params[name]
        with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(value)                 # the bf16 copy the forward reads
        safe_set_full_fp32_param(p, value)      # the fp32 master on the host
    say("bf16 parameters and fp32 masters set from the weights")
    device = engine.device
    steps = itertools.count(1)

    def step(ids, labels):
        loss = engine(ids.to(device), labels.to(device))
        engine.backward(loss)
        # ZeRO's optimizer hands its groups on to DeepSpeedCPUAdam, which reads lr at each step.
        set_lr(engine.optimizer.param_groups, workload.lr_at(next(steps)))
        engine.step()
        return loss.detach().float().cpu()
    out.update(timed(workload, step))
    out.update(memory(workload.device))
    return out


def build_cpu_adam() -> float:
    """Seconds to build DeepSpeedCPUAdam's op, or to load it when a build is cached
    (TORCH_EXTENSIONS_DIR): a first build takes about a minute."""
    from deepspeed.ops.op_builder import CPUAdamBuilder
    start = time.perf_counter()
    CPUAdamBuilder().load()
    return time.perf_counter() - start
