"""The fused linear cross-entropy never makes the [N, V] logits: the plan predicts less device memory,
the runtime measures less, both by at least the logits' bytes, and the two agree."""
from __future__ import annotations

import torch

from megacompile.ir.stage_program import tensors_of
from tests import models
from tests.fusion.training import batches, train

VOCAB, WIDTH, B, T = 4096, 32, 2, 32        # a vocabulary 128x the width; N = 64 tokens


def test_fused_cross_entropy_lowers_predicted_and_measured_peaks():
    torch.manual_seed(0)
    model = models.hf_llama(layers=2, d=WIDTH, vocab=VOCAB)
    data = batches(b=B, t=T, steps=2, vocab=VOCAB)
    plain, fused = train(model, "llama", data, fuse=False), train(model, "llama", data, fuse=True)
    logits = B * T * VOCAB * 4
    predicted = (plain.engine.plan.predicted_peak_bytes, fused.engine.plan.predicted_peak_bytes)
    measured = tuple(run.engine.memory_stats()["device_peak_bytes"] for run in (plain, fused))
    print(f"logits {logits} B; predicted peak {predicted[0]} -> {predicted[1]} B; "
          f"measured {measured[0]} -> {measured[1]} B")
    assert predicted[0] - predicted[1] >= logits
    assert measured[0] - measured[1] >= logits
    assert measured[1] == predicted[1], "the fused graphs' fake values must describe what the kernels allocate"
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(plain.losses), rtol=1e-5, atol=0)

    # no value of the fused epilogue holds N x V elements; the largest is the weight (V x H) or its grads
    epilogue = next(t for t in fused.engine.plan.captured.templates if t.kind == "epilogue")
    n_tokens = B * T
    for gm in (epilogue.forward.gm, epilogue.backward.gm):
        for node in gm.graph.nodes:
            for t in tensors_of(node.meta.get("val")):
                assert t.numel() < n_tokens * VOCAB, f"{node.name} holds {tuple(t.shape)}"
