"""Training with fusion on equals training with it off: 10 AdamW steps on the small parity models.

float32, two ways:
  step by step   the fused run starts each step from the unfused run's weights: every step's loss
                 within 1e-5 relative and every gradient within 1e-5 of its tensor's largest entry.
                 This holds the fused graphs to the unfused ones at 10 different points.
  free running   two independent 10-step runs: losses within 1e-5 relative at every step; weights
                 within 1e-5 of each tensor's largest entry, except for at most 0.5% of the elements,
                 which stay within the bound AdamW itself guarantees (|step| <= lr). Those are elements
                 whose gradient is tiny next to the rest of its tensor (GPT-2's key bias has an exactly
                 zero gradient): AdamW divides it by sqrt(v) and turns a last-bit difference between
                 the runs into a visible step, in any two runs that do not round identically.
bfloat16: the fused run's losses are within BF16_LOSS_TOL of the float32 run's, as the unfused bf16
run's are. docs/fusion.md has the measured numbers. The attention kernel runs in the step-by-step
runs; the others leave torch's attention in place (training.torch_attention). The default tier
runs the step-by-step and bf16 comparisons on nanoGPT, the slow tier on the other models.
"""
from __future__ import annotations

import pytest
import torch

from megacompile.fusion import kernel_counts
from tests.e2e.harness import LR
from tests.fusion.training import BUILDERS, STEPS, Run, batches, torch_attention, train, train_forced

RTOL = 1e-5
DRIFT_FRACTION = 0.005          # of the weights, allowed only the AdamW bound in the free-running runs
BF16_LOSS_TOL = 2.0 ** -7       # two bf16 ulps of the loss


@pytest.fixture(scope="module")
def runs():
    cache = {}

    def get(kind: str, mode: str = "plain", dtype: torch.dtype = torch.float32) -> Run:
        key = (kind, mode, dtype)
        if key not in cache:
            torch.manual_seed(0)
            model = BUILDERS[kind]()
            if mode == "forced":        # the attention kernel included
                cache[key] = train_forced(model, kind, batches(), get(kind, "plain", dtype), dtype)
            else:
                with torch_attention():
                    cache[key] = train(model, kind, batches(), fuse=mode == "fused", compute_dtype=dtype)
        return cache[key]
    return get


def assert_steps_match(fused: Run, plain: Run, rtol: float = RTOL) -> None:
    """Per step: the loss within rtol, every gradient within rtol of its tensor's largest entry."""
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses), rtol=rtol, atol=0)
    for step, (fg, pg) in enumerate(zip(fused.grads, plain.grads)):
        for name, g in pg.items():
            err = (fg[name] - g).abs().max().item()
            assert err <= rtol * g.abs().max().item(), f"step {step}, gradient of {name}: max error {err:.3g}"


def drifted_weights(fused: Run, plain: Run, rtol: float = RTOL) -> int:
    """Elements beyond rtol of their tensor's largest entry (each must still be within 2 lr * steps)."""
    drifted = 0
    for name, w in plain.weights.items():
        err = (fused.weights[name].float() - w.float()).abs()
        over = err > rtol * (w.float().abs().max().item() or 1.0)
        assert not over.any() or err[over].max().item() <= 2 * LR * STEPS, name
        drifted += int(over.sum())
    return drifted


def _kernels(run: Run):
    total = kernel_counts(None)
    for t in run.engine.plan.captured.templates:
        total += kernel_counts(t.forward.gm) + kernel_counts(t.backward.gm)
    return total


def _slow_but_nanogpt(kinds):
    return [k if k == "nanogpt" else pytest.param(k, marks=pytest.mark.slow) for k in kinds]


@pytest.mark.parametrize("kind", _slow_but_nanogpt(BUILDERS))
def test_float32_every_step_matches_unfused(kind, runs):
    forced = runs(kind, "forced")
    counts = _kernels(forced)
    assert counts["fused_linear_cross_entropy"] == 1 and sum(counts.values()) >= 8, counts
    assert counts["attention"] == counts["attention_backward"] == 1, counts
    assert_steps_match(forced, runs(kind, "plain"))


@pytest.mark.parametrize("kind", [k if k in ("llama", "nanogpt") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in BUILDERS])
def test_float32_training_matches_unfused(kind, runs):
    plain, fused = runs(kind, "plain"), runs(kind, "fused")
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses), rtol=RTOL, atol=0)
    drifted = drifted_weights(fused, plain)
    total = sum(w.numel() for w in plain.weights.values())
    print(f"{kind}: {drifted} of {total} weights beyond {RTOL} after {STEPS} steps")
    assert drifted <= DRIFT_FRACTION * total


@pytest.mark.parametrize("kind", _slow_but_nanogpt(["llama", "gpt2", "nanogpt"]))
def test_bfloat16_training_tracks_float32(kind, runs):
    reference = torch.tensor(runs(kind).losses)
    plain = torch.tensor(runs(kind, "plain", torch.bfloat16).losses)
    fused = torch.tensor(runs(kind, "fused", torch.bfloat16).losses)
    fused_err = ((fused - reference).abs() / reference).max().item()
    plain_err = ((plain - reference).abs() / reference).max().item()
    print(f"{kind}: bf16 loss error vs fp32: fused {fused_err:.3g}, unfused {plain_err:.3g}")
    assert fused_err <= BF16_LOSS_TOL, f"fused bf16 {fused_err:.3g} (unfused bf16 {plain_err:.3g}) from fp32"


def test_gradient_accumulation_scales_the_saved_loss_gradients():
    """With grad_accum=2 the loss tangent is 0.5: the fused backward must scale the dh and dW its
    forward saved (the only place the tangent enters the fused cross-entropy)."""
    torch.manual_seed(0)
    model, data = BUILDERS["llama"](), batches(steps=4)
    plain = train(model, "llama", data, fuse=False, grad_accum=2)
    with torch_attention():
        fused = train(model, "llama", data, fuse=True, grad_accum=2)
    assert_steps_match(fused, plain)
    assert drifted_weights(fused, plain) == 0


def test_the_step_check_catches_a_wrong_kernel(runs, monkeypatch):
    """The per-step comparison fails when one replacement is slightly wrong: RMSNorm's output off
    by one part in 1e4, in the forward only (its backward kernel is still right)."""
    from megacompile.fusion import norms
    from megacompile.fusion.graph import launcher

    right = norms.rms_norm_fwd

    @launcher(right.kernel, right.meta)
    def wrong(x, w, eps):
        y, rstd = right(x, w, eps)
        return y * (1 + 1e-4), rstd

    monkeypatch.setattr(norms, "rms_norm_fwd", wrong)
    torch.manual_seed(0)
    plain = runs("llama")
    with torch_attention():
        broken = train(BUILDERS["llama"](), "llama", batches(steps=1), fuse=True)
    with pytest.raises(AssertionError):
        assert_steps_match(broken, Run(plain.engine, plain.losses[:1], plain.grads[:1], plain.weights))
