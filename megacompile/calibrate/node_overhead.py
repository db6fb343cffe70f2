"""The cpu backend's cost per schedule node, fitted from a small model's measured steps."""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from ..cost.hardware import HardwareProfile
from ..cost.predict import predict
from ..engine import Engine
from ..models.llama import LlamaConfig, TinyLlama


def fit_node_overhead(profile: HardwareProfile, steps: int = 7) -> float:
    """Seconds per schedule node the cpu backend spends beyond the per-op model: Python dispatch,
    handoffs to the copy and host threads, and those threads competing with the compute thread
    for the cores. A small Llama (4 blocks, width 64, 2 x 32 tokens) trains a few steps; the gap
    between its median step and the prediction without node overhead is spread over its nodes.

    Its engine plans with `profile` itself, the measurement so far: planning for the cpu backend
    without a profile would ask for the one being measured here."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig(vocab=256, dim=64, layers=4, heads=4, kv_heads=2, ffn=128))
        ids = torch.randint(0, 256, (2, 32))
        engine = Engine(model, 1.0, device="cpu", hardware=profile)
        try:
            plan = engine.prepare(input_ids=ids, labels=ids)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                engine.step(input_ids=ids, labels=ids)
                engine.synchronize()
                times.append(time.perf_counter() - start)
        finally:
            engine.close()
    measured = statistics.median(times[1:])
    bare = predict(plan.program, plan.captured, replace(profile, node_overhead_s=0.0)).step_s
    return max(0.0, (measured - bare) / len(plan.program.nodes))
