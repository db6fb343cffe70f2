"""Train the same model eagerly (torch.optim.AdamW, float32) and through megacompile: the shared
harness lives in the package (megacompile/acceptance/parity.py), which the GPU validation runs too."""
from __future__ import annotations

from megacompile.acceptance.parity import (BETAS, EPS, LR, WD, WEIGHT_NOISE_FACTOR, Run, clone,  # noqa: F401
                                         eager_losses, float64_noise, make_inputs, megacompile_run, weight_bytes,
                                         weight_errors)


def assert_same_weights(engine, reference, rtol: float = 1e-5, noise: float = 0.0) -> None:
    """Every tensor agrees to rtol, relative to its largest entry, or, after several AdamW steps,
    to WEIGHT_NOISE_FACTOR times `noise`, eager float32's own distance from float64 (float64_noise)."""
    tol = max(rtol, WEIGHT_NOISE_FACTOR * noise)
    for name, err in weight_errors(engine, reference).items():
        assert err <= tol, (f"{name}: max error {err:.3g} relative to the tensor's largest entry "
                            f"(tolerance {tol:.3g}, eager float32 vs float64 {noise:.3g})")


def weight_noise(model, batches, kind: str, reference) -> float:
    """float64_noise of `reference`, `model` trained by eager_losses on `batches`."""
    def train(exact):
        config = getattr(exact, "config", None)
        if getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "eager"     # torch's grouped GEMM takes no float64
        eager_losses(exact, batches, kind)
    return float64_noise(train, model, reference)
