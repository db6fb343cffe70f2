"""Sequence-chunked blocks (capture/chunk.py): the chunked block graph computes what the whole one
does, outputs and gradients, and a submodule that mixes positions is never chunked."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from megacompile.capture import capture
from megacompile.capture import chunk
from megacompile.capture.chunk import token_wise
from megacompile.models.llama import LlamaConfig, TinyLlama
from tests import models


def _noop(*_):
    return None


def _capture(model, ids):
    return capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)


def _block(captured, n=1):
    c = captured.rechunk(n) if n > 1 else captured
    return next(st.template for st in c.stages if st.template.kind == "block")


def _run(t, seed=0):
    """The block's forward then backward on random real tensors: outputs, then gradients."""
    g = torch.Generator().manual_seed(seed)

    def rand(m):
        return torch.randn(m.shape, generator=g, dtype=m.dtype) if m.dtype.is_floating_point else \
            torch.zeros(m.shape, dtype=m.dtype)
    params = [rand(p.meta) for p in t.params]
    acts = [rand(a) for a in t.acts]
    outs = t.forward.run(params + acts, _noop, _noop)
    n_out = len(t.outputs)
    tangents = [rand(t.outputs[i]) for i in t.tangent_outputs]
    grads = t.backward.run([params[i] for i in t.bwd_params] + [acts[i] for i in t.bwd_acts]
                           + list(outs[n_out:]) + tangents, _noop, _noop)
    return list(outs[:n_out]) + list(grads)


def _same(a, b):
    """Each tensor within 1e-5 of the other, relative to its largest entry."""
    return len(a) == len(b) and all(
        x.shape == y.shape and (x - y).abs().max() <= 1e-5 * y.abs().max() for x, y in zip(a, b))


def _hf():
    torch.manual_seed(0)
    return models.hf_llama(layers=2, d=32), models.batch(96, 2, 24)


def _bundled():
    torch.manual_seed(0)
    return TinyLlama(LlamaConfig(vocab=96, dim=32, heads=4, kv_heads=2, ffn=64, layers=2)), models.batch(96, 2, 24)


@pytest.mark.parametrize("make, parts", [
    (_hf, {"mlp", "input_layernorm", "post_attention_layernorm"}),
    pytest.param(_bundled, {"attn_norm", "mlp_norm"}, marks=pytest.mark.slow),
])
def test_a_chunked_block_computes_the_whole_blocks_outputs_and_gradients(make, parts, monkeypatch):
    captured = _capture(*make())
    whole, part = _block(captured), _block(captured, 4)
    assert whole.chunked == () and part.chunks == 4 and set(part.chunked) == parts
    assert part.saved_bytes < whole.saved_bytes
    reference = _run(whole)
    assert _same(_run(part), reference)
    # The comparison sees a chunk boundary gone wrong: slices one token off their place.
    right = chunk._slices
    monkeypatch.setattr(chunk, "_slices", lambda x, n: [c.roll(1, dims=1) for c in right(x, n)])
    assert not _same(_run(_block(_capture(*make()), 4)), reference)     # a capture keeps what it traced: a new one


class _Mixer(nn.Module):
    """Token-wise in shape, but each output row reads other positions."""

    def __init__(self, how: str, d: int = 32):
        super().__init__()
        self.how, self.proj = how, nn.Linear(d, d)

    def forward(self, x):
        h = self.proj(x)
        if self.how == "cumsum":
            return h.cumsum(dim=1)
        if self.how == "mean":
            return h - h.mean(dim=1, keepdim=True)
        if self.how == "shift":
            return F.pad(h, (0, 0, 1, 0))[:, :-1]
        if self.how == "transpose":
            return (h.transpose(1, 2) @ h).sum(-1).unsqueeze(1).expand_as(h)
        if self.how == "dropout":
            return F.dropout(h, 0.1, training=True)
        return F.silu(h) * h


@pytest.mark.parametrize("how", ["cumsum", "mean", "shift", "transpose", "dropout"])
def test_a_submodule_that_mixes_positions_is_not_chunked(how):
    with FakeTensorMode():
        m = _Mixer(how)
        x = torch.empty(2, 16, 32)
        names = [k for k, _ in m.named_parameters()]
        state = [torch.empty(p.shape) for p in m.parameters()]
        assert token_wise(_Mixer("silu"), names, x, state, 4) is None
        assert token_wise(m, names, x, state, 4) is not None


class _Block(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.norm, self.mix, self.mlp = nn.LayerNorm(d), _Mixer("cumsum", d), _Mixer("silu", d)

    def forward(self, x):
        return x + self.mlp(self.norm(x + self.mix(x)))


class _Model(nn.Module):
    def __init__(self, d: int = 32, vocab: int = 96):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(vocab, d), nn.ModuleList(_Block() for _ in range(2)), \
            nn.Linear(d, vocab)

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for b in self.blocks:
            x = b(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


@pytest.mark.slow
def test_a_block_that_mixes_positions_outside_attention_chunks_only_its_token_wise_parts():
    torch.manual_seed(0)
    captured = _capture(_Model(), models.batch(96, 2, 24))
    whole, part = _block(captured), _block(captured, 4)
    assert set(part.chunked) == {"norm", "mlp"}
    assert _same(_run(part), _run(whole))


def test_a_module_that_fails_on_a_slice_is_refused_without_an_error_log():
    # Tokens in the first dim only ([tokens, features], as an MoE MLP sees them): a slice of dim 1
    # cuts the features and the matmul's meta kernel raises. That is the answer "not token-wise";
    # torch's ERROR line with its traceback would read as a crash in `megacompile plan`.
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)
    log = logging.getLogger("torch._subclasses.fake_tensor")
    keep = Keep()
    log.addHandler(keep)
    try:
        linear = torch.nn.Linear(16, 8)
        names, state = zip(*((n, p.detach()) for n, p in linear.named_parameters()))
        why = token_wise(linear, list(names), torch.randn(32, 16), list(state), 2)
    finally:
        log.removeHandler(keep)
    assert why == "it does not trace on a slice (RuntimeError)"
    assert not records, [r.getMessage() for r in records]
    assert not log.disabled
