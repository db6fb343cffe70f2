"""What a training run owns besides its plans: the model, the fp32 masters and AdamW moments (the
host state), the optimizer and its LR handle, where weights wait before the host state exists,
and the step counters. The engine holds one; io/ and distributed/ read it and change it through
its transitions (training.py), and never see the engine."""
from .counters import Counters
from .training import TrainingState

__all__ = ["Counters", "TrainingState"]
