"""The systems the peers bench trains with, each run in a process of its own (runner.py): the same
Workload, warmup steps, then timed steps back to back. Each returns its losses, its time and the
memory it held; megacompile adds the plan's prediction beside the measurement."""
from __future__ import annotations

import gc
import os
import resource
import tempfile
import time

import torch

from .workload import Workload

GiB = 2**30


_STARTED = time.perf_counter()


def _say(what: str) -> None:
    """A timestamped line in the system's log (bench/peers.py keeps it): a system stopped at its
    time limit shows how far it got."""
    print(f"[{time.perf_counter() - _STARTED:8.1f} s] {what}", flush=True)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(workload: Workload, step) -> dict:
    """Warmup steps, then the timed ones back to back with one synchronize at the end (as a training
    loop runs them); losses of every step."""
    batches = workload.batches()
    _say("first step")
    losses = [step(ids, labels) for ids, labels in batches[:workload.warmup]]
    _say(f"{workload.warmup} warmup steps done")
    _sync(workload.device)
    start = time.perf_counter()
    losses += [step(ids, labels) for ids, labels in batches[workload.warmup:]]
    _sync(workload.device)
    seconds = (time.perf_counter() - start) / workload.steps
    losses = [float(x) for x in losses]
    return {"losses": losses, "step_s": seconds, "tokens_per_s": workload.tokens_per_step / seconds,
            "tflops_6nd": 6 * workload.parameters * workload.tokens_per_step / seconds / 1e12}


def _memory(device: str) -> dict:
    out = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.startswith("cuda"):
        stats = torch.cuda.memory_stats()
        out.update(max_memory_reserved_bytes=torch.cuda.max_memory_reserved(),
                   max_memory_allocated_bytes=torch.cuda.max_memory_allocated(),
                   num_alloc_retries=stats.get("num_alloc_retries", 0))
    return out


def run_megacompile(workload: Workload, budget: str, calibrated: str | None = None) -> dict:
    """budget: "resident" (the default budget: most of the device), or a fraction of the model's
    bf16 weights ("0.5", "0.34"), raised to the smallest budget the plan fits in when it is below."""
    import json

    from .. import AdamW
    from .. import compile as compile_model
    from ..cost import predict
    from ..cost.backend_profile import profile_for
    from ..cost.hardware import HardwareProfile
    from ..errors import BudgetTooSmallError
    from ..settings import default_hbm_budget
    cuda = workload.device.startswith("cuda")
    if budget == "resident":
        gib = default_hbm_budget(workload.device) if cuda else 64.0
    else:
        gib = float(budget) * workload.parameters * 2 / GiB
    asked, raised = gib, False
    batches = workload.batches()
    model = workload.model()
    optimizer = dict(lr=workload.lr, weight_decay=workload.weight_decay)
    while True:
        engine = compile_model(model, hbm_budget=gib, device=workload.device, compute_dtype=workload.compute_dtype,
                               optimizer=AdamW(**optimizer))
        try:
            plan = engine.prepare(input_ids=batches[0][0], labels=batches[0][1])
            break
        except BudgetTooSmallError as e:
            engine.close()
            del engine
            gc.collect()        # the refused engine's host buffers go before the next one takes its own
            if raised:
                raise
            gib, raised = e.minimum_bytes / GiB, True
    del model
    _say(f"planned at {gib:.3f} GiB")
    backend = "cuda" if cuda else "cpu"
    out = {"hbm_budget_gib": gib, "asked_budget_gib": asked, "budget_raised_to_minimum": raised,
           "budget_share_of_bf16_weights": gib * GiB / (2 * workload.parameters),
           "recomputed_blocks": len(plan.recomputed), "predicted_device_peak_bytes": plan.predicted_peak_bytes}
    profiles = {"datasheet": profile_for(backend)}
    if calibrated:
        profiles["calibrated"] = HardwareProfile(**json.loads(open(calibrated).read()))
    for name, profile in profiles.items():
        p = predict(plan.program, plan.captured, profile)
        out[f"predicted_step_s_{name}"] = p.step_s
        out[f"predicted_exposed_transfer_s_{name}"] = p.exposed_s
        out[f"predicted_host_optimizer_s_{name}"] = p.host_s
    try:
        out.update(_timed(workload, lambda ids, labels: engine.step(input_ids=ids, labels=labels)))
        engine.timeline.clear()
        engine.step(input_ids=batches[-1][0], labels=batches[-1][1])      # one more, alone: its host AdamW
        engine.synchronize()
        out["measured_host_optimizer_s"] = sum(s.end - s.start for s in engine.timeline.on("host"))
        out["ledger_device_peak_bytes"] = engine.memory_stats()["device_peak_bytes"]
        out.update(_memory(workload.device))
    finally:
        engine.close()
    return out


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


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_fsdp2(workload: Workload) -> dict:
    """FSDP2 (`fully_shard`) on one rank: on a GPU with CPUOffloadPolicy, fp32 parameters and AdamW
    state on the host, torch's AdamW stepping them there, bf16 compute; on the cpu half over gloo."""
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
        _say("model built and sharded")
        optimizer = torch.optim.AdamW(model.parameters(), lr=workload.lr, weight_decay=workload.weight_decay)
        device = torch.device(workload.device)

        def step(ids, labels):
            loss = model(ids.to(device), labels.to(device))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach().float().cpu()
        out = _timed(workload, step)
        out.update(_memory(workload.device))
        return out
    finally:
        dist.destroy_process_group()


def run_deepspeed(workload: Workload) -> dict:
    """DeepSpeed ZeRO-3 with offload_param and offload_optimizer to pinned CPU memory and
    DeepSpeedCPUAdam (AdamW mode), bf16 compute: DeepSpeed's fp32 masters live on the host."""
    import deepspeed
    _one_rank_group("nccl")
    config = {
        "train_micro_batch_size_per_gpu": workload.batch, "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                              "offload_param": {"device": "cpu", "pin_memory": True},
                              "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "AdamW", "params": {"lr": workload.lr, "weight_decay": workload.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }
    model = workload.model()
    _say("model built")
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    device = engine.device
    _say("deepspeed.initialize done")

    def step(ids, labels):
        loss = engine(ids.to(device), labels.to(device))
        engine.backward(loss)
        engine.step()
        return loss.detach().float().cpu()
    out = _timed(workload, step)
    out.update(_memory(workload.device))
    return out


SYSTEMS = {"megacompile": run_megacompile, "fsdp2": run_fsdp2, "deepspeed": run_deepspeed}
