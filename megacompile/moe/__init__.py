"""Mixture-of-experts layers: the static-shape grouped matmul the captured graphs run."""
from .grouped_mm import grouped_mm, grouped_mm_reference, grouped_mm_weight_grad, grouped_mm_weight_grad_reference

__all__ = ["grouped_mm", "grouped_mm_weight_grad", "grouped_mm_reference", "grouped_mm_weight_grad_reference"]
