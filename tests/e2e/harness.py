"""Train the same model eagerly (torch.optim.AdamW, float32) and through megacompile."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

import megacompile

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def make_inputs(model_kind: str, ids: torch.Tensor) -> dict:
    return {"idx": ids, "targets": ids} if model_kind == "nanogpt" else {"input_ids": ids, "labels": ids}


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def eager_losses(model, batches, kind: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        out = model(**make_inputs(kind, ids))
        loss = out if isinstance(out, torch.Tensor) else out[-1] if isinstance(out, tuple) else out.loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@dataclass
class Run:
    engine: megacompile.Engine
    losses: list[float]
    peaks: list[int]           # measured device peak per step
    predicted: int


def megacompile_run(model, batches, kind: str, budget_gib: float, kernel: str = "torch", **kw) -> Run:
    """kernel="torch": the host AdamW that rounds as torch.optim.AdamW does (docs/decisions.md)."""
    engine = megacompile.compile(model, hbm_budget=budget_gib, device="cpu", **kw,
                                 optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                             kernel=kernel))
    losses, peaks = [], []
    for ids in batches:
        losses.append(engine.step(**make_inputs(kind, ids)))
        peaks.append(engine.memory_stats()["device_peak_bytes"])
    return Run(engine, losses, peaks, engine.plan.predicted_peak_bytes)


def assert_same_weights(engine: megacompile.Engine, reference: torch.nn.Module, rtol: float = 1e-5) -> None:
    """Every tensor agrees to rtol, relative to its largest entry."""
    ours = engine.state_dict()
    theirs = reference.state_dict()
    assert set(ours) == set(theirs)
    for name, ref in theirs.items():
        err = (ours[name].float() - ref.float()).abs().max().item()
        scale = ref.float().abs().max().item() or 1.0
        assert err <= rtol * scale, f"{name}: max error {err:.3g} vs scale {scale:.3g}"


def clone(model):
    return copy.deepcopy(model)
