"""The host optimizer: AdamW over float32 masters, one stage's flat buffers at a time."""
from .adamw import AdamW
from .adamw import MAX_LR, check_step_lr
from .lr_ratio import MAX_RATIO
from .weight_decay import hf_no_decay

__all__ = ["AdamW", "MAX_LR", "MAX_RATIO", "check_step_lr", "hf_no_decay"]
