"""How the micro-batches of an optimizer step run: micro-batch-major (each step() call runs its
micro-batch through the whole model) or layer-major (the step's micro-batches go through each
block together, passes/layer_major.py). This room holds the engine's side of layer-major."""
from .layer_major import MODES, check_mode, layer_major_step

__all__ = ["MODES", "check_mode", "layer_major_step"]
