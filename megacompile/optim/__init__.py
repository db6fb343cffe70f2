"""The host optimizer: AdamW over float32 masters, one stage's flat buffers at a time."""
from .adamw import AdamW

__all__ = ["AdamW"]
