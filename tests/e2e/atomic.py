"""What the reliability tests share: a model whose loss or one gradient turns non-finite on
demand, and a bit-exact picture of everything a step may change."""
from __future__ import annotations

import torch
import torch.nn as nn

import megacompile
from tests import models


class Poisoned(nn.Module):
    """A tiny nanoGPT whose loss is scaled by `loss_scale` (inf or NaN poisons the loss), plus a
    term that is exactly 0 in the forward and whose gradient for ln_f.weight alone is NaN when
    `grad_poison` is 0 (sqrt's derivative at 0 times 0) and exactly 0 otherwise."""

    def __init__(self, layers: int = 2, d: int = 32):
        super().__init__()
        self.gpt = models.NanoGPT(vocab=96, d=d, layers=layers, heads=2)

    def forward(self, idx, targets, loss_scale, grad_poison):
        _, loss = self.gpt(idx, targets)
        w = self.gpt.transformer.ln_f.weight
        return loss * loss_scale + 0.0 * torch.sqrt(grad_poison * w.abs().sum())


def inputs(seed: int, loss_scale: float = 1.0, grad_poison: float = 1.0) -> dict:
    ids = models.batch(96, 2, 16, seed=seed)
    return {"idx": ids, "targets": ids, "loss_scale": torch.tensor(loss_scale),
            "grad_poison": torch.tensor(grad_poison)}


def engine(model: nn.Module, *, clip: bool = False, grad_accum: int = 1, **kw) -> megacompile.Engine:
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=grad_accum,
                               optimizer=megacompile.AdamW(lr=1e-2, max_grad_norm=0.5 if clip else None), **kw)


def snapshot(engine: megacompile.Engine) -> dict:
    """Masters, moments, the committed gradient sum, compute copies, counters and the device
    ledger, as bits."""
    engine.synchronize()
    host = engine.host
    out = {}
    for s, b in host.owners.items():
        for field in ("master", "exp_avg", "exp_avg_sq", "grad", "compute"):
            out[f"{field}{s}"] = getattr(b, field).clone()
    out["counters"] = (engine.steps_done, engine.micro_batches)
    ledger = engine.backend.memory.ledger
    out["ledger"] = (ledger.live_bytes, {storage: frozenset(h) for storage, h in ledger._holders.items()})
    return out


def assert_same_state(before: dict, after: dict, grads: bool = True) -> None:
    """grads=False: a dropped step's gradient sum is not state (the next step overwrites it)."""
    assert before.keys() == after.keys()
    for key, value in before.items():
        if not grads and key.startswith("grad"):
            continue
        if isinstance(value, torch.Tensor):
            # bits, so that a NaN kept as it was counts as unchanged
            same = value.view(torch.int32).equal(after[key].view(torch.int32)) if value.dtype == torch.float32 \
                else value.equal(after[key])
            assert same, f"{key} changed"
        else:
            assert value == after[key], f"{key}: {value} -> {after[key]}"


def masters(engine: megacompile.Engine) -> dict[str, torch.Tensor]:
    return {k: v for k, v in engine.state_dict().items()}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs by {(a[k].float() - b[k].float()).abs().max().item():.3g}"


def assert_poisoned_step_skipped(engine: megacompile.Engine, seed: int) -> dict:
    """Poisoned's NaN gradient of ln_f.weight in step `seed`: the step is skipped whole, with a
    warning and a record naming it, and nothing of the state changed; the state, as it stands."""
    import pytest
    before = snapshot(engine)
    with pytest.warns(RuntimeWarning, match="skipped"):
        engine.step(**inputs(seed, grad_poison=0.0))
    assert engine.last_step.skipped == "gradient" and "transformer.ln_f.weight" in engine.last_step.reason
    assert_same_state(before, snapshot(engine), grads=False)
    return before
