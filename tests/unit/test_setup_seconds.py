"""engine.setup_seconds: where a first step's wait went (capture, host state, plan), counted once per
input shape and not again by the steps after it."""
import time

import torch

import megacompile
from megacompile.models.llama import LlamaConfig, TinyLlama


def test_the_set_up_is_timed_by_phase_once_per_input_shape():
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=2, heads=2, kv_heads=1, ffn=64))
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", retrace=True)
    try:
        assert engine.setup_seconds == {}
        ids = torch.randint(0, 64, (1, 8))
        start = time.perf_counter()
        engine.step(input_ids=ids, labels=ids)
        first = time.perf_counter() - start
        spent = dict(engine.setup_seconds)
        assert set(spent) == {"capture", "host state", "plan"} and all(s > 0 for s in spent.values())
        assert sum(spent.values()) <= first
        engine.step(input_ids=ids, labels=ids)
        assert engine.setup_seconds == spent                  # the same shape: nothing set up again
        longer = torch.randint(0, 64, (1, 12))
        engine.step(input_ids=longer, labels=longer)          # a new shape: captured and planned, host kept
        assert engine.setup_seconds["capture"] > spent["capture"] and engine.setup_seconds["plan"] > spent["plan"]
        assert engine.setup_seconds["host state"] == spent["host state"]
    finally:
        engine.close()
