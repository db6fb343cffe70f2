"""Gemma 2's final logit softcapping (logits = c * tanh(logits / c) before the loss) in the fused
cross-entropy: the kernel caps each logit tile as it reads it, the epilogue saves dh and dW instead
of the [N, V] tanh and log-softmax, and training equals the unfused graphs step by step."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megacompile.capture import capture
from megacompile.fusion import fuse
from megacompile.fusion.cross_entropy import linear_cross_entropy_forward
from tests.families import FAMILIES, VOCAB, batch
from tests.fusion.test_parity import assert_steps_match
from tests.fusion.training import train, train_forced

aten = torch.ops.aten
CAP = 30.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_launcher_is_the_capped_loss_and_its_gradients(dtype):
    """Logits well past the cap, so tanh bends them; chunks that do not divide the tokens."""
    gen = torch.Generator().manual_seed(0)
    n, hidden, vocab = 40, 16, 300
    h = (torch.randn(n, hidden, generator=gen) * 4).to(dtype)
    w = (torch.randn(vocab, hidden, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[::7] = -100
    loss, dh, dw, _, _ = linear_cross_entropy_forward(h, w, labels, -100, 16, CAP)
    hd, wd = (t.detach().double().requires_grad_() for t in (h, w))
    logits = hd @ wd.T
    assert logits.abs().max() > 3 * CAP
    want = F.cross_entropy(torch.tanh(logits / CAP) * CAP, labels, ignore_index=-100)
    want_dh, want_dw = torch.autograd.grad(want, (hd, wd))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loss.double(), want, rtol=tol, atol=0)
    for got, exact in ((dh, want_dh), (dw, want_dw)):
        assert (got.double() - exact).abs().max() <= tol * exact.abs().max()
    uncapped = linear_cross_entropy_forward(h, w, labels, -100, 16)[0]
    assert (uncapped - loss).abs() > 0.1                      # the cap is what the loss computes


def test_gemma2s_epilogue_is_fused_with_its_cap():
    torch.manual_seed(0)
    ids = batch(t=16)
    before = capture(FAMILIES["gemma2"](), (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                     compute_dtype=torch.float32)
    old, new = (next(t for t in c.templates if t.kind == "epilogue") for c in (before, fuse(before)))
    logits = (2 * 16, VOCAB)
    assert {(2, 16, VOCAB), logits} <= {tuple(m.shape) for m in old.saved}      # the tanh, the log-softmax
    assert not {(2, 16, VOCAB), logits} & {tuple(m.shape) for m in new.saved}
    forward = [n for n in new.forward.gm.graph.nodes if n.op == "call_function"]
    fused = [n for n in forward if getattr(n.target, "__name__", "") == "linear_cross_entropy_forward"]
    assert len(fused) == 1 and fused[0].kwargs["softcap"] == CAP
    for graph in (new.forward.gm.graph, new.backward.gm.graph):
        assert not {aten.tanh.default, aten.tanh_backward.default, aten._log_softmax.default} & {
            n.target for n in graph.nodes}


def test_gemma2_trains_fused_as_unfused_step_by_step():
    torch.manual_seed(0)
    model = FAMILIES["gemma2"]()
    steps = [batch(seed=i) for i in range(3)]
    plain = train(model, "hf", steps, fuse=False)
    assert_steps_match(train_forced(model, "hf", steps, plain), plain)
