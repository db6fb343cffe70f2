
from .printer import fmt_bytes

__all__ = ["fmt_bytes"]
