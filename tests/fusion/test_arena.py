"""Fused kernels write their results into the device arena as ATen ops do through out=: they take
them from the arena (kernels/outputs.py), nothing of theirs is copied in after, nothing is left
outside, and training is what the unfused graphs train."""
from __future__ import annotations

import torch

from megacompile.ir.program import Op
from megacompile.ir.stage_ops import copied_result_bytes
from megacompile.kernels import outputs
from tests import models
from tests.fusion.training import batches, train


def _copies(run) -> tuple[int, int]:
    stats = run.engine.memory_stats()
    assert stats["device_allocations_last_step"] == 0, stats["device_allocations_outside"]
    assert stats["device_peak_bytes"] <= stats["device_arena_bytes"]
    return stats["device_copies_into_arena_last_step"], stats["device_arena_bytes"]


def test_fused_kernels_write_their_results_where_the_plan_put_them(monkeypatch):
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=32, vocab=256)
    data = batches(b=2, t=16, steps=2, vocab=256)
    plain, fused = train(model, "llama", data, fuse=False), train(model, "llama", data, fuse=True)
    copied, _ = _copies(fused)
    # Attention and the embedding's backward included (kernels/attention.py, kernels/embedding.py), a
    # fused Llama's step copies in only the results of the ops whose out= form would allocate them
    # anyway (the embedding's lookup, clone, pad: ir/stage_ops.py allocates_inside); unfused, torch's
    # attention ops and the embedding's backward are copied in too.
    program, captured = fused.engine.plan.program, fused.engine.plan.captured
    graphs = {Op.FORWARD: "forward", Op.RECOMPUTE: "forward", Op.BACKWARD: "backward"}
    ran = [op for n in program.nodes if n.op in graphs
           for op in getattr(captured.stages[n.stage].template, graphs[n.op]).body]
    inside = [op for op in ran if op.op == "call_function" and copied_result_bytes(op) > 0]
    assert copied == len(inside) and not any("attention" in str(op.target) for op in inside)
    assert not any("embedding_dense_backward" in str(op.target) for op in inside)
    assert any(getattr(op.target, "kernel", None) == "embedding_backward" for op in ran)
    assert _copies(plain)[0] > copied
    # The same run with the kernels allocating their own results: each kernel call is copied in.
    monkeypatch.setattr(outputs, "_take", lambda *a, **k: None)
    unplaced = train(model, "llama", data, fuse=True)
    copied_without, _ = _copies(unplaced)
    # Every kernel call of the step: copied in when the kernels allocate, written in when they take.
    calls = sum(1 for op in ran if hasattr(op.target, "kernel"))
    assert copied_without - copied == calls > 0, (copied_without, copied, calls)
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(unplaced.losses), torch.tensor(fused.losses), rtol=0, atol=0)
