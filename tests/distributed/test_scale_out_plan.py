"""`megacompile plan --gpus N [--nodes M]`: per-rank memory and the data-parallel prediction."""
from __future__ import annotations

import json

import pytest
import torch

import megacompile
from megacompile.cli import main
from megacompile.cost.host_memory import owner_sizes
from megacompile.distributed.cost import scale_out
from megacompile.errors import ArgumentError, HostMemoryError
from megacompile.planner.search import place_host_state

from ..e2e.test_cost_model import SMALL_LLAMA


@pytest.fixture(scope="module")
def plan():
    return megacompile.plan(SMALL_LLAMA, hbm_budget=1.0, hardware="h100", batch=2, seq=64)


def test_each_rank_holds_its_share_of_the_host_state(plan):
    params = sum(e.numel for e in plan.captured.state.values() if e.trainable)
    buffers = sum(e.numel * e.dtype.itemsize for e in plan.captured.state.values() if e.is_buffer)
    eight = scale_out(plan, 8, nodes=2)
    # per node of 4: one bf16 copy (2 B) and buffers per rank; 4/8 of master + moments (12 B) and
    # of the fp32 gradient sums (4 B, cut per owner)
    sizes, _, _ = owner_sizes(plan.captured)
    grads = sum(n * 4 // 8 for n in sizes.values())
    node = 2 * params + 4 * (grads + buffers) + 12 * params * 4 // 8
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
    captured = capsys.readouterr()      # --json: the document on stdout, the text on stderr
    data, out = json.loads(captured.out)["data_parallel"], captured.err.splitlines()
    assert data["gpus"] == 16 and data["nodes"] == 2 and data["host_bytes_per_rank"] > 0
    assert data["host_bytes_per_rank"] * 8 >= data["host_bytes_per_node"] > data["host_bytes_per_rank"]
    assert any(line.strip().startswith("per rank") for line in out)
    assert any("tok/s in all" in line for line in out)


def test_gpus_that_do_not_split_over_the_nodes_are_refused(plan):
    with pytest.raises(ArgumentError, match="multiple of --nodes"):
        scale_out(plan, 3, nodes=2)


def test_the_gradients_reduce_on_a_network_stream_beside_the_backward(plan):
    from megacompile.cost.predict import predict
    from megacompile.ir.program import Op
    program, bw = plan.program, 50e9
    spans: list = []
    prediction = predict(program, plan.captured, plan.hardware, spans=spans, ranks=8, network_bw=bw)
    grads = {i: program.values[n.reads[0]].nbytes for i, n in enumerate(program.nodes)
             if n.op is Op.OFFLOAD and program.values[n.reads[0]].kind == "grads"}
    # every byte of every stage's gradients, once: a reduce to each tensor's holder
    assert prediction.network_s == pytest.approx(sum(grads.values()) / bw)
    network = {i: (start, end) for i, stream, start, end in spans if stream == "network"}
    assert set(network) == set(grads)
    d2h = {i: (start, end) for i, stream, start, end in spans if stream == "d2h" and i in grads}
    assert all(d2h[i][0] >= network[i][1] for i in grads), "the shard goes to the host after its sum"
    # 1/8 of each stage's gradient crosses to the host
    assert all(d2h[i][1] - d2h[i][0] == pytest.approx(grads[i] / 8 / plan.hardware.d2h_bw) for i in grads)
    backward_ends = [end for i, stream, start, end in spans
                     if stream == "compute" and program.nodes[i].op is Op.BACKWARD]
    first = min(network)
    assert network[first][0] < max(backward_ends), "the first reduce runs while later stages' backward does"
    one = predict(program, plan.captured, plan.hardware)
    assert one.network_s == 0.0 and one.d2h_s > prediction.d2h_s
