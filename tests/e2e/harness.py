"""Train the same model eagerly (torch.optim.AdamW, float32) and through megacompile: the shared
harness lives in the package (megacompile/validate/parity.py), which the GPU validation runs too."""
from __future__ import annotations

from megacompile.validate.parity import (BETAS, EPS, LR, WD, Run, clone, eager_losses,  # noqa: F401
                                         make_inputs, megacompile_run, weight_bytes, weight_errors)


def assert_same_weights(engine, reference, rtol: float = 1e-5) -> None:
    """Every tensor agrees to rtol, relative to its largest entry."""
    for name, err in weight_errors(engine, reference).items():
        assert err <= rtol, f"{name}: max error {err:.3g} relative to the tensor's largest entry"
