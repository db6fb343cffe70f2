"""Train a small model through megacompile with and without fusion, keeping what the tests compare."""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import pytest
import torch

import megacompile
from megacompile import fusion
from megacompile.fusion import kernel_counts
from tests import models
from tests.e2e.harness import BETAS, EPS, LR, WD, make_inputs

STEPS = 10


def torch_order_adamw() -> megacompile.AdamW:
    """The host AdamW in torch's operation order, so fused and unfused runs round the update alike
    and a comparison measures the graphs (docs/decisions.md)."""
    return megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch")
VOCAB = 96


@contextlib.contextmanager
def torch_attention():
    """Fusion with torch's attention ops left in place. Under the interpreter an attention kernel
    call costs about a quarter of a second (a program per head), so the runs of many steps whose
    subject is something else keep torch's attention; the step-by-step parity of every model, the
    arena and the pattern tests run the kernel."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fusion, "REWRITES", [(n, r) for n, r in fusion.REWRITES if not n.startswith("attention")])
        patch.setattr(fusion, "FORWARD_ONLY", {n: r for n, r in fusion.FORWARD_ONLY.items() if n != "attention"})
        yield

# the parity models, small enough for the Triton interpreter: 2 layers, width 32, batch 2 x 16
BUILDERS = {
    "llama": lambda: models.hf_llama(layers=2, d=32, vocab=VOCAB),
    "qwen2": lambda: models.hf_qwen2(layers=2, d=32, vocab=VOCAB),
    "gpt2": lambda: models.hf_gpt2(layers=2, d=32, vocab=VOCAB),
    "nanogpt": lambda: models.NanoGPT(vocab=VOCAB, d=32, layers=2, heads=2),
}


@dataclass
class Run:
    engine: megacompile.Engine
    losses: list[float]
    grads: list[dict[str, torch.Tensor]]   # the fp32 gradients the host optimizer got, per step
    weights: dict[str, torch.Tensor]
    before: list[dict[str, torch.Tensor]] | None = None   # the weights each step started from


def host_grads(engine: megacompile.Engine) -> dict[str, torch.Tensor]:
    engine.synchronize()      # the last micro-batch's gradients join the sum in its update
    host = engine.host
    return {n: host.view("grad", n).clone() for n in host.slots}


def train(model: torch.nn.Module, kind: str, batches: list[torch.Tensor], *, fuse: bool,
          compute_dtype: torch.dtype = torch.float32, grad_accum: int = 1) -> Run:
    engine = megacompile.compile(copy.deepcopy(model), hbm_budget=64.0, device="cpu", compute_dtype=compute_dtype,
                                 optimizer=torch_order_adamw(), fuse=fuse,
                                 grad_accum=grad_accum)
    losses, grads, before = [], [], [dict(model.state_dict())]
    for ids in batches:
        losses.append(engine.step(**make_inputs(kind, ids)))
        grads.append(host_grads(engine))
        before.append(engine.state_dict())
    return Run(engine, losses, grads, before[-1], before)


def batches(b: int = 2, t: int = 16, steps: int = STEPS, vocab: int = VOCAB) -> list[torch.Tensor]:
    return [models.batch(vocab, b=b, t=t, seed=i) for i in range(steps)]


def counts(captured, kind: str) -> tuple[dict, dict]:
    """Kernel nodes per kernel name in the forward and backward of the first `kind` template."""
    t = next(t for t in captured.templates if t.kind == kind)
    return dict(kernel_counts(t.forward.gm)), dict(kernel_counts(t.backward.gm))


def train_forced(model: torch.nn.Module, kind: str, batches: list[torch.Tensor], reference: Run,
                 compute_dtype: torch.dtype = torch.float32) -> Run:
    """A fused run that starts every step from the reference run's weights before that step, so
    each step's loss and gradients compare the graphs alone, not two drifting trajectories."""
    engine = megacompile.compile(copy.deepcopy(model), hbm_budget=64.0, device="cpu", compute_dtype=compute_dtype,
                                 optimizer=torch_order_adamw(), fuse=True)
    losses, grads = [], []
    for k, ids in enumerate(batches):
        if k:
            engine.load_state_dict(reference.before[k])
        losses.append(engine.step(**make_inputs(kind, ids)))
        grads.append(host_grads(engine))
    return Run(engine, losses, grads, engine.state_dict())
