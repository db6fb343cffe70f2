"""The disk tier: AdamW moments (and fp32 masters) of each owner in preallocated files on a fast
disk, streamed past the host AdamW in update order (tier.py), through aligned buffers
(aligned.py) and O_DIRECT state files (files.py)."""
from .tier import KINDS, MOMENTS, DiskTier, Piece

__all__ = ["DiskTier", "Piece", "KINDS", "MOMENTS"]
