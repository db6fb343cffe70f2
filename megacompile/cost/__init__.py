"""The cost model: hardware profiles, per-graph roofline estimates, and step-time prediction."""
from .estimate import GraphCost, graph_cost, recomputed_bytes, recomputed_region
from .hardware import PROFILES, HardwareProfile
from .profiles import get_profile
from .backend_profile import profile_for
from .decode import cache_bytes_per_token, cache_shape
from .generation_memory import forward_transient_bytes, generate_transient_bytes, prefill_chunk
from .host_memory import default_host_budget_bytes, process_ram
from .predict import StepPrediction, predict

__all__ = ["GraphCost", "cache_bytes_per_token", "cache_shape", "default_host_budget_bytes",
           "forward_transient_bytes", "generate_transient_bytes", "HardwareProfile", "PROFILES", "StepPrediction",
           "get_profile", "graph_cost", "predict", "prefill_chunk", "process_ram", "profile_for", "recomputed_bytes",
           "recomputed_region"]
