"""Train the same model eagerly (torch.optim.AdamW, float32) and through megacompile, and compare.

The tests' parity harness (tests/e2e/harness.py) and `python -m megacompile.acceptance` share this:
the tests run it on the cpu backend, the validation on the GPU. Tolerances: float32 compute agrees
with eager float32 on the same device to 1e-5 (relative) in the losses and in the first step's
gradients (read as AdamW's first moment, (1 - beta1) * g, on both sides); the weights after
several steps agree to 1e-5, or, on a GPU, to within WEIGHT_NOISE_FACTOR times how far eager
float32 on the GPU lands from eager float32 on the host (the tests, on the host, take that factor
of how far it lands from eager float64: float64_noise). AdamW's first steps move every weight by
about lr * sign(g): a weight whose true gradient is zero (a key bias under softmax, a token no
batch holds) moves by lr in a direction set by rounding noise, which differs between any two
devices or kernels, eager ones included (docs/gpu.md). bfloat16 compute (fp32 masters, bf16
weights and activations on the device) is held to BF16_LOSS_RTOL in the losses of 10 steps
against the same eager float32 run, which is about ten bf16 ulps: rounding, not a wrong gradient
(a wrong scale or a dropped term moves the loss by far more within a few steps).

A first gradient that sums heavily cancelling terms (a gated delta-net's decay parameters in a
tiny model: a largest entry 1e-5 of the step's largest gradient) is not defined to 1e-5 in float32
at all: rounding every weight by one ulp moves eager float32's own gradient there by 1e-3. Such a
tensor is held to GRADIENT_FLOOR_FACTOR times that move (`rounding_floor`), measured in the same
test; every other tensor to FP32_RTOL.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch

from .. import AdamW, Engine
from .. import compile as compile_model

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
FP32_RTOL = 1e-5
BF16_LOSS_RTOL = 2e-2
WEIGHT_NOISE_FACTOR = 2.0
GRADIENT_FLOOR_FACTOR = 2.0


def make_inputs(model_kind: str, ids: torch.Tensor) -> dict:
    return {"idx": ids, "targets": ids} if model_kind == "nanogpt" else {"input_ids": ids, "labels": ids}


def loss_of(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[-1] if isinstance(out, tuple) else out.loss


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def eager_losses(model, batches, kind: str, device: str | torch.device = "cpu",
                 first_moments: dict | None = None) -> list[float]:
    """Train `model` in place on `device` (and leave it there); with `first_moments`, fill it with
    each parameter's exp_avg after the first step, on the host."""
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    names = {p: n for n, p in model.named_parameters()}
    losses = []
    for i, ids in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(**make_inputs(kind, ids.to(device))))
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i == 0 and first_moments is not None:
            first_moments.update({names[p]: s["exp_avg"].detach().cpu().clone() for p, s in opt.state.items()})
    return losses


@dataclass
class Run:
    engine: Engine
    losses: list[float]
    peaks: list[int]           # measured device peak per step (the ledger's)
    predicted: int
    seconds: float = 0.0


def megacompile_run(model, batches, kind: str, budget_gib: float, kernel: str = "torch", device="cpu",
                    first_moments: dict | None = None, **kw) -> Run:
    """kernel="torch": the host AdamW that rounds as torch.optim.AdamW does (docs/decisions.md).
    With `first_moments`, fill it with each trainable parameter's exp_avg after the first step."""
    engine = compile_model(model, hbm_budget=budget_gib, device=device, **kw,
                           optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel=kernel))
    losses, peaks = [], []
    start = time.perf_counter()
    for i, ids in enumerate(batches):
        losses.append(engine.step(**make_inputs(kind, ids)))
        peaks.append(engine.memory_stats()["device_peak_bytes"])
        if i == 0 and first_moments is not None:
            engine.synchronize()
            # torch holds AdamW state only for the parameters a step gave a gradient
            first_moments.update({name: engine.host.view("exp_avg", name).clone() for name in engine.host.slots
                                  if engine.state.adamw_step(name) > 0})
    engine.synchronize()
    return Run(engine, losses, peaks, engine.plan.predicted_peak_bytes, time.perf_counter() - start)


def weight_errors(engine: Engine | torch.nn.Module, reference: torch.nn.Module) -> dict[str, float]:
    """Per tensor: max |ours - eager| relative to the tensor's largest entry."""
    ours, theirs = engine.state_dict(), reference.state_dict()
    if set(ours) != set(theirs):
        raise AssertionError(f"state_dict keys differ: {sorted(set(ours) ^ set(theirs))}")
    errors = {}
    for name, ref in theirs.items():
        ref = ref.detach().float().cpu()
        scale = ref.abs().max().item() or 1.0
        errors[name] = (ours[name].float().cpu() - ref).abs().max().item() / scale
    return errors


def float64_noise(train, model: torch.nn.Module, reference: torch.nn.Module) -> float:
    """The weights' noise floor: how far `reference` (`model` trained in float32 by `train`, a
    function that trains a model in place) lands from the same training in float64, the largest
    over tensors relative to each tensor's largest entry. AdamW's first steps move a weight whose
    gradient is rounding noise by about lr in the direction the noise picks, so a float32 run that
    sums in another order (other threads, chunks, blocks) lands this far away, correct or not."""
    exact = clone(model).double()
    train(exact)
    return max(weight_errors(exact, reference).values())


def moment_errors(ours: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: the error of the first step's exp_avg, relative to the tensor's largest entry:
    the first gradients compared, through the same (1 - beta1) scaling on both sides."""
    if set(ours) != set(eager):
        raise AssertionError(f"trainable parameters differ: {sorted(set(ours) ^ set(eager))}")
    return {n: (ours[n].float().reshape(e.shape) - e.float()).abs().max().item() / (e.abs().max().item() or 1.0)
            for n, e in eager.items()}


def moment_error(ours: dict[str, torch.Tensor], eager: dict[str, torch.Tensor]) -> float:
    """The largest of moment_errors."""
    return max(moment_errors(ours, eager).values())


def rounding_floor(first_gradients, model: torch.nn.Module, draws: int = 3) -> dict[str, float]:
    """Per tensor: how far eager float32's own first gradient moves, relative to its largest entry,
    when every weight is rounded by one ulp (each entry up or down at random), the largest over
    `draws`; `first_gradients(model)` gives a copy's gradients by name. A reordered sum changes the
    values a gradient is made from by about as much, so no float32 computation of that gradient,
    eager's on other hardware included, is defined more closely than this."""
    base = first_gradients(clone(model))
    floor = dict.fromkeys(base, 0.0)
    for k in range(draws):
        rounded, g = clone(model), torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in rounded.parameters():
                if p.is_floating_point():
                    up = torch.randn(p.shape, generator=g) > 0
                    p.copy_(torch.nextafter(p, torch.where(up, torch.inf, -torch.inf).to(p)))
        moved = first_gradients(rounded)
        for n, b in base.items():
            floor[n] = max(floor[n], (moved[n] - b).abs().max().item() / (b.abs().max().item() or 1.0))
    return floor


def assert_first_gradients(ours: dict[str, torch.Tensor], eager: dict[str, torch.Tensor],
                           floor: dict[str, float] | None = None) -> None:
    """First-step moments (the gradients) per tensor to FP32_RTOL, or GRADIENT_FLOOR_FACTOR times
    its rounding floor where that is larger."""
    for n, err in moment_errors(ours, eager).items():
        tol = max(FP32_RTOL, GRADIENT_FLOOR_FACTOR * (floor or {}).get(n, 0.0))
        if err > tol:
            raise AssertionError(f"{n}: first-step gradient off by {err:.3g} of its largest entry (tolerance {tol:.3g}"
                                 f"; one-ulp rounding of the weights moves eager float32's by "
                                 f"{(floor or {}).get(n, 0.0):.3g})")


def loss_error(ours: list[float], eager: list[float]) -> float:
    """Largest relative difference of the per-step losses."""
    return max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, eager, strict=True))


def clone(model):
    return copy.deepcopy(model)
