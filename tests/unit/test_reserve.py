"""The device reserve: what a plan for a real GPU keeps free for memory its ledger cannot see."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megacompile
from megacompile.cost import get_profile
from megacompile.cost.hardware import replace
from megacompile.cost.reserve import attention_backward_scratch

GiB, MiB = 2 ** 30, 2 ** 20
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def test_flash_attention_backward_reserves_its_fp32_dq_accumulator():
    """16 x 4096 tokens, 40 heads of 128: a float32 dq is 1.25 GiB, plus one float per query row."""
    query = torch.empty(16, 40, 4096, 128, dtype=torch.bfloat16, device="meta")
    node = SimpleNamespace(op="call_function", target="aten._scaled_dot_product_flash_attention_backward.default",
                           args=(None, SimpleNamespace(meta={"val": query})))
    assert attention_backward_scratch(node) == int(1.25 * GiB) + 16 * 40 * 4096 * 4
    node.target = "aten.mm.default"
    assert attention_backward_scratch(node) == 0


def test_a_gpu_plan_keeps_the_reserve_free_and_says_so():
    h100 = get_profile("h100")
    plan = megacompile.plan(LLAMA, 1.0, hardware=h100, batch=2, seq=64)
    r = plan.reserve
    assert r.workspace_bytes == h100.workspace_bytes
    # the caching allocator serves only what the arena does not hold: its share is of those bytes
    assert r.fragmentation_bytes == int(h100.fragmentation * (r.workspace_bytes + r.scratch_bytes))
    assert plan.arena.size + r.workspace_bytes + r.scratch_bytes <= plan.budget_bytes
    assert r.scratch_bytes > 0 and "attention" in r.scratch_op
    assert plan.predicted_peak_bytes + r.total <= plan.budget_bytes
    assert plan.to_json()["reserve_bytes"] == r.total
    line, = [x for x in plan.summary().splitlines() if x.lstrip("# ").startswith("reserve")]
    assert "5% of what the caching allocator still serves beside the arena" in line and "of the budget;" not in line
    # the smallest fit includes the reserve: planning there succeeds, just below it fails
    smallest = megacompile.plan(LLAMA, plan.minimum_budget_bytes / GiB, hardware=h100, batch=2, seq=64)
    assert smallest.fits and smallest.predicted_peak_bytes + smallest.reserve.total <= smallest.budget_bytes
    with pytest.raises(megacompile.BudgetTooSmallError, match="device reserve"):
        megacompile.plan(LLAMA, plan.minimum_budget_bytes * 0.99 / GiB, hardware=h100, batch=2, seq=64)


def test_the_reserve_is_calibratable_and_the_simulated_device_has_none():
    h100 = get_profile("h100")
    bigger = replace(h100, workspace_bytes=256 * MiB, fragmentation=0.1)
    base = megacompile.plan(LLAMA, 1.0, hardware=h100, batch=2, seq=64)
    more = megacompile.plan(LLAMA, 1.0, hardware=bigger, batch=2, seq=64)
    scratch = base.reserve.scratch_bytes
    assert more.reserve.total - base.reserve.total == (192 * MiB + int(0.1 * (256 * MiB + scratch))
                                                       - int(0.05 * (64 * MiB + scratch)))
    assert more.minimum_budget_bytes > base.minimum_budget_bytes
    simulated = megacompile.plan(LLAMA, 1.0, hardware="cpu", batch=2, seq=64)
    assert simulated.reserve.total == 0
