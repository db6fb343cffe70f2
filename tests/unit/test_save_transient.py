"""The plan says what a checkpoint or an export adds to the host state while it writes (one tensor
at a time in float32: tests/e2e/test_io_memory.py measures it), and when that goes past the host
budget the state itself fits; under data parallelism an export first gathers the masters."""
from __future__ import annotations

import megacompile

GiB = 2 ** 30
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
LARGEST = 512 * 128 * 4       # the embedding (and the untied head), in float32


def _saving(plan) -> str:
    line, = [x for x in plan.summary().splitlines() if x.lstrip("# ").startswith("saving")]
    return line


def test_the_plan_names_what_a_save_adds_beside_the_host_state():
    plan = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64)
    assert plan.to_json()["host_save_transient_bytes"] == LARGEST
    assert "at most 256.00 KiB more" in _saving(plan) and "embed_tokens" in _saving(plan)
    assert "over the host budget" not in _saving(plan)


def test_a_host_budget_the_state_fits_but_a_save_does_not_is_said():
    state = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64).host_bytes
    tight = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64, host_budget=(state + LARGEST // 2) / GiB)
    assert tight.host_bytes == state
    assert "over the host budget" in _saving(tight)
    roomy = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64, host_budget=(state + 2 * LARGEST) / GiB)
    assert "over the host budget" not in _saving(roomy)


def test_under_data_parallelism_an_export_gathers_every_master_on_every_rank():
    """With bf16 compute each rank holds a share of the masters, and an export gathers them all
    first (distributed/shard.py gather_masters): 4 B per parameter on every rank."""
    import torch
    plan = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64, ranks=(2, 1),
                            compute_dtype=torch.bfloat16)
    params = plan.host_cost.params
    assert plan.to_json()["host_save_transient_bytes"] == 4 * params > LARGEST
    assert "gathers every fp32 master on each of the 2 ranks" in _saving(plan)
    one = megacompile.plan(LLAMA, 1.0, hardware="h100", batch=2, seq=64, compute_dtype=torch.bfloat16)
    assert one.to_json()["host_save_transient_bytes"] == LARGEST
