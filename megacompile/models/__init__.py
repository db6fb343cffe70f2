"""Models megacompile ships for its own main job and benchmarks."""
from .llama import LlamaConfig, TinyLlama

__all__ = ["LlamaConfig", "TinyLlama"]
