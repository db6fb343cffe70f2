"""The cost model: hardware profiles, per-graph roofline estimates, and step-time prediction."""
from .estimate import GraphCost, graph_cost
from .hardware import PROFILES, HardwareProfile
from .profiles import get_profile
from .predict import StepPrediction, predict

__all__ = ["GraphCost", "HardwareProfile", "PROFILES", "StepPrediction", "get_profile", "graph_cost", "predict"]
