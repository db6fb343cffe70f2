"""The host optimizer: AdamW over float32 masters, one stage's flat buffers at a time."""
from .adamw import AdamW
from .adamw import MAX_LR

__all__ = ["AdamW", "MAX_LR"]
