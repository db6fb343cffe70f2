"""Captures of one model at several micro-batch sizes (plan_global_batch) run each block's forward
under the op log only at the first size; later sizes give a block its group's fingerprint."""
from __future__ import annotations

import torch

import megacompile.capture.top as top
from megacompile.capture import capture
from tests import models


def _capture(model, batch):
    ids = torch.empty(batch, 8, dtype=torch.long, device="meta")
    return capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)


def test_later_sizes_log_one_block_per_group_and_keep_the_groups(monkeypatch):
    model = models.hf_llama(layers=4, d=32).to("meta")
    model.model.layers[2].mlp.act_fn = torch.nn.GELU()     # block 2 computes something else
    logged: list[int] = []
    real = top.record

    def counting(block, *a, **k):
        logged.append(next(i for i, b in enumerate(model.model.layers) if b is block))
        return real(block, *a, **k)
    monkeypatch.setattr(top, "record", counting)
    with top.blocks_grouped_once():
        first = _capture(model, 4)
        n_first, logged[:] = list(logged), []
        second = _capture(model, 2)
    assert n_first == [0, 1, 2, 3] and logged == [0, 2]
    for c in (first, second):
        templates = [id(st.template) for st in c.stages if st.template.kind == "block"]
        assert templates[0] == templates[1] == templates[3] != templates[2]
    assert second.inputs[0].shape[0] == 2
    # Outside the context every capture logs every block again.
    logged[:] = []
    _capture(model, 2)
    assert logged == [0, 1, 2, 3]
