"""A frozen lm head (LoRA, the common way to run DPO and GRPO on a big model) gets the post-training
losses' fused head too: its backward makes dh alone, so the backward launcher makes each chunk's
logits again and their rows of dh, with no dW matmul and no [V, H] dW, accumulator or partial; the
[N, V] fp32 logits leave the saved values as they do for a trained head."""
from __future__ import annotations

import pytest
import torch

from megacompile.capture import capture
from megacompile.fusion import fuse
from megacompile.fusion.logprobs import _backward_meta, linear_logprobs_backward, linear_logprobs_forward
from megacompile.kernels.check import TOLERANCE, lm_inputs, relative_error
from megacompile.kernels.gpu_compile import FAST_ARCHS, compile_launches, record_launches
from megacompile.kernels.reference import linear_logprobs_ref
from megacompile.posttrain import DPOLoss, DPOObjective
from megacompile.train.methods.lora import with_adapters
from tests import models
from tests.fusion.test_cross_entropy_launchers import _undeclared

aten = torch.ops.aten
ROWS, T, WIDTH, VOCAB = 4, 16, 32, 512
N = ROWS * T


def lora_dpo() -> DPOObjective:
    """DPO over a Llama with adapters on every Linear of its blocks: the head and the norms frozen."""
    torch.manual_seed(0)
    policy = with_adapters(models.hf_llama(layers=2, d=WIDTH, vocab=VOCAB), 4, 8, 0.0, "all")
    for name, p in policy.named_parameters():     # B starts at zero: move it, so A gets a gradient
        if "lora_B" in name:
            p.data.normal_(0.0, 0.02)
    return DPOObjective(policy, DPOLoss(beta=0.1))


def dpo_inputs(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[:, :3] = -100
    labels[1, -4:] = -100
    return dict(input_ids=ids[:, :-1].contiguous(), labels=labels, ref_logps=torch.linspace(-40.0, -30.0, ROWS))


def _launch(h, w, labels, g, chunk_size, frozen_head, temperature=0.0):
    picked, lse, _ = linear_logprobs_forward(h, w, labels, chunk_size, temperature)
    return linear_logprobs_backward(g, -g, h, w, labels, lse, chunk_size, temperature, frozen_head=frozen_head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [8, 1000])
def test_the_backward_launcher_makes_dh_alone(dtype, chunk_size):
    """Eager's dh within the kernel tests' tolerances, chunks that do not divide the tokens among
    them; bit for bit the trainable head's dh; and nothing allocated that the meta does not declare."""
    gen = torch.Generator().manual_seed(0)
    h, w, labels = lm_inputs(dtype, {"lm": (67, 33, 257)}, gen)
    labels = labels.clamp(min=0)
    g = torch.randn(67, generator=gen)                    # each token's upstream gradient
    out = _launch(h, w, labels, g, chunk_size, frozen_head=True)
    assert len(out) == 2 and tuple(out[1].shape) == (min(chunk_size, 67), 257)   # dh, the tile: no dW
    hr = h.clone().requires_grad_()
    (want_dh,) = torch.autograd.grad((linear_logprobs_ref(hr, w, labels) * g).sum(), hr)
    assert relative_error(out[0], want_dh) <= TOLERANCE[dtype]
    assert torch.equal(out[0], _launch(h, w, labels, g, chunk_size, frozen_head=False)[0])
    _, lse, _ = linear_logprobs_forward(h, w, labels, chunk_size)
    args = (g, -g, h, w, labels, lse, chunk_size, 0.0, False, True)
    assert _undeclared(lambda *a: linear_logprobs_backward(*a), _backward_meta, args) == []


@pytest.mark.slow
def test_the_frozen_head_launches_compile_for_sm80_and_sm90():
    gen = torch.Generator().manual_seed(1)
    h, w, labels = lm_inputs(torch.bfloat16, {"lm": (19, 16, 4099)}, gen)
    labels, g = labels.clamp(min=0), torch.randn(19, generator=gen)
    with record_launches() as launches:
        _launch(h, w, labels, g, 8, frozen_head=True)
        _launch(h.float(), w.float(), labels, g, 8, frozen_head=True, temperature=0.7)
    assert {x.kernel for x in launches.values()} == {"logprob_forward_kernel", "logprob_grad_kernel"}
    results = compile_launches(launches.values(), archs=FAST_ARCHS)
    assert all(r == "ok" for per in results.values() for r in per.values()), results


def epilogue(objective, fused: bool = True):
    captured = capture(objective, (), dpo_inputs(0), device=torch.device("cpu"), compute_dtype=torch.float32)
    return next(t for t in (fuse(captured) if fused else captured).templates if t.kind == "epilogue")


def test_a_lora_policy_saves_no_logits_nor_dw():
    old, new = epilogue(lora_dpo(), fused=False), epilogue(lora_dpo())
    assert N * VOCAB * 4 in [m.nbytes for m in old.saved]                 # eager's fp32 logits
    assert max(m.nbytes for m in new.saved) < VOCAB * WIDTH * 4            # no logits, no dW
    (fused,) = [n for n in new.backward.gm.graph.nodes if n.meta.get("kernel") == "linear_logprobs_backward"]
    assert fused.kwargs["frozen_head"] is True
    # no head matmul, gather or logsumexp is left; nothing of [N, V] or [V, H] is made but the head's W
    for graph in (new.forward.gm.graph, new.backward.gm.graph):
        assert not {aten.logsumexp.default, aten.gather.default, aten.scatter_add.default,
                    aten.mm.default} & {n.target for n in graph.nodes}
        for node in graph.nodes:
            if node.op != "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
                assert node.meta["val"].numel() < VOCAB * WIDTH, node.name
