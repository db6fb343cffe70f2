"""The reference model of a post-training stage that reads one at every step (GRPO with beta > 0,
DPO with sync_ref_model): the model as loaded, which the policy is at step 0, run forward only.

It is a second engine on the policy's device (compile(..., share_device=), engine/shared_device.py):
one budget and one device arena serve both, as they take turns, and its host state is placed in the
host budget the policy's leaves. Its parameters are frozen, so the host keeps its weights once, in
their own dtype (float32: the masters' precision, which sync_ref_model's mixing reads and writes),
with no AdamW moments, gradients or compute copies. It runs in eval mode, as TRL prepares its
reference (dropout off whatever disable_dropout says of the policy). Beside a LoRA policy the
frozen base is the policy's own host tensors (compile(..., share_frozen=True)): the reference adds
only its adapters (whose B is zero, so it is the base, as TRL's reference with the adapter
disabled). Its plan and host state are made before the first step, so a reference that does not fit
stops the run before it trains.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..engine import Engine
from ..ir import fmt_bytes
from . import methods
from .config import RunConfig
from .model import Setup, compile_module, make_module


def reference_engine(c: RunConfig, meta: nn.Module, setup: Setup, first_inputs, wrap) -> Engine:
    """The reference beside `setup`'s policy engine, planned on the first micro-batch's inputs."""
    policy = setup.engine
    # The same draws as the policy's module (a config's init, LoRA's adapters), from the run's seed,
    # leaving the run's random stream as the policy's build left it.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(c.seed)
        module = make_module(c, meta, wrap, quiet=True)
    module.requires_grad_(False)
    module.eval()
    engine = compile_module(c, module, policy.budget_bytes / 2 ** 30, wrap, compute_dtype=policy.compute_dtype,
                            host_budget=setup.host_budget, fuse=c.fuse, retrace=c.retrace, share_device=policy,
                            # a LoRA policy's base is frozen and the reference's own: held once, by the policy
                            share_frozen=bool(methods.adapters(c)))
    try:
        plan = engine.prepare(**first_inputs(setup.batch), train=False)
    except BaseException:
        engine.close()
        raise
    host = engine.host
    shared = sum(host.consts[n].untyped_storage().nbytes() for n in host.borrowed)
    print(f"  reference      the model as loaded, forward only, in eval mode: {fmt_bytes(engine.host_cost.ram_bytes)} "
          f"of frozen weights on the host beside the policy's state"
          + (f" (the {fmt_bytes(shared)} of frozen weights both hold are the policy's)" if shared else "")
          + f"; its plan's device peak {fmt_bytes(plan.predicted_peak_bytes)} within the policy's budget, on its "
          "device", flush=True)
    return engine
