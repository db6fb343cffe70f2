"""Weights that fit the budget twice over stay on the device from their forward to their
backward: each crosses the link once a step, not twice."""
from __future__ import annotations

import megacompile
from megacompile.cost import get_profile
from megacompile.ir.program import Op

LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def _weight_prefetches(plan) -> dict[int, int]:
    counts: dict[int, int] = {}
    for n in plan.program.nodes:
        if n.op is Op.PREFETCH and plan.program.values[n.writes[0]].kind == "weights":
            counts[n.stage] = counts.get(n.stage, 0) + 1
    return counts


def test_a_model_that_fits_twice_over_fetches_each_stage_once():
    plan = megacompile.plan(LLAMA, 8.0, hardware=get_profile("h100"), batch=2, seq=64)
    assert plan.program.facts["choice"].resident == frozenset(range(len(plan.captured.stages)))
    assert set(_weight_prefetches(plan).values()) == {1}


def test_a_tight_budget_streams_blocks_twice():
    roomy = megacompile.plan(LLAMA, 8.0, hardware=get_profile("h100"), batch=2, seq=64)
    tight = megacompile.plan(LLAMA, roomy.minimum_budget_bytes / 2 ** 30, hardware=get_profile("h100"), batch=2, seq=64)
    assert max(_weight_prefetches(tight).values()) == 2
