"""`megacompile plan --gpus N [--nodes M]`: per-rank memory and the data-parallel prediction."""
from __future__ import annotations

import json

import pytest
import torch

import megacompile
from megacompile.cli import main
from megacompile.distributed.cost import scale_out
from megacompile.errors import ArgumentError, HostMemoryError
from megacompile.planner import place_host_state

from ..e2e.test_cost_model import SMALL_LLAMA


@pytest.fixture(scope="module")
def plan():
    return megacompile.plan(SMALL_LLAMA, hbm_budget=1.0, hardware="h100", batch=2, seq=64)


def test_each_rank_holds_its_share_of_the_host_state(plan):
    params = sum(e.numel for e in plan.captured.state.values() if e.trainable)
    buffers = sum(e.numel * e.dtype.itemsize for e in plan.captured.state.values() if e.is_buffer)
    eight = scale_out(plan, 8, nodes=2)
    # per node of 4: one bf16 copy (2 B), 4 fp32 gradients (4 B) and buffers, 4/8 of master + moments (12 B)
    node = 2 * params + 4 * (4 * params + buffers) + 12 * params * 4 // 8
    assert eight.node_host_bytes == node + 4 * plan.stash_bytes
    assert eight.host_bytes == -(-node // 4) + plan.stash_bytes
    assert eight.device_bytes == plan.predicted_peak_bytes


def test_the_host_check_of_a_rank_is_its_node_figure(plan):
    node = scale_out(plan, 8, nodes=2).node_host_bytes - 4 * plan.stash_bytes
    # a rank's budget is 1/4 of the node's
    cost = place_host_state(plan.captured, torch.bfloat16, 1, int(node * 1.001) // 4, None, ranks=(8, 4))
    assert cost.node_bytes == node and 4 * cost.ram_bytes >= node
    with pytest.raises(HostMemoryError, match="per node"):
        megacompile.plan(SMALL_LLAMA, hbm_budget=1.0, hardware="h100", batch=2, seq=64, ranks=(8, 4),
                         host_budget=node * 0.999 / 2**30)


def test_more_gpus_train_faster_and_a_slower_network_slower(plan):
    one = plan.prediction.tokens_per_s
    two, eight = scale_out(plan, 2), scale_out(plan, 8)
    assert one < two.tokens_per_s < eight.tokens_per_s <= 8 * one * 1.5   # AdamW shrinks per rank too
    across = scale_out(plan, 8, nodes=2)
    # this small model's collectives hide behind compute: they show on the host stream ...
    assert across.network_bw < eight.network_bw and across.prediction.host_s > eight.prediction.host_s
    assert across.tokens_per_s <= eight.tokens_per_s
    # ... until the network is slow enough
    assert scale_out(plan, 8, network_bw=1e6).tokens_per_s < across.tokens_per_s


def test_plan_command_prints_per_rank_memory_and_throughput(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    assert main(["plan", "--config", str(config), "--hbm-budget", "1", "--batch", "2", "--seq", "64",
                 "--gpus", "16", "--nodes", "2", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    data = json.loads(out[-1])["data_parallel"]
    assert data["gpus"] == 16 and data["nodes"] == 2 and data["host_bytes_per_rank"] > 0
    assert data["host_bytes_per_rank"] * 8 >= data["host_bytes_per_node"] > data["host_bytes_per_rank"]
    assert any(line.strip().startswith("per rank") for line in out)
    assert any("tok/s in all" in line for line in out)


def test_gpus_that_do_not_split_over_the_nodes_are_refused(plan):
    with pytest.raises(ArgumentError, match="multiple of --nodes"):
        scale_out(plan, 3, nodes=2)
