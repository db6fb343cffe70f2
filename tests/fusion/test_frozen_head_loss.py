"""A frozen lm head (LoRA, or finetuning_type freeze with the head frozen) gets the fused cross-entropy
too: its backward makes dh alone, so the launcher computes the loss and dh in chunks of tokens and
saves dh, with no dW matmul and no [V, H] dW; the [N, V] log-softmax leaves the saved values, and a
LoRA model trains through it as eager does."""
from __future__ import annotations

import pytest
import torch

from megacompile.acceptance.parity import moment_error
from megacompile.capture import capture
from megacompile.fusion import fuse
from megacompile.fusion.cross_entropy import linear_cross_entropy_forward
from megacompile.kernels.check import TOLERANCE, lm_inputs, relative_error
from megacompile.kernels.gpu_compile import FAST_ARCHS, compile_launches, record_launches
from megacompile.kernels.reference import fused_linear_cross_entropy_ref
from megacompile.train.methods.lora import with_adapters
from tests import models
from tests.e2e.harness import clone, eager_losses, make_inputs, megacompile_run
from tests.fusion.training import BUILDERS, VOCAB, batches, torch_attention

aten = torch.ops.aten
N, H = 2 * 16, 32


def lora_llama() -> torch.nn.Module:
    """The parity Llama with adapters on every Linear of its blocks: the head and the norms frozen."""
    torch.manual_seed(0)
    model = with_adapters(BUILDERS["llama"](), 4, 8, 0.0, "all")
    for name, p in model.named_parameters():     # B starts at zero: move it, so A gets a gradient
        if "lora_B" in name:
            p.data.normal_(0.0, 0.02)
    return model


def frozen_head_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    model = BUILDERS["llama"]()
    model.lm_head.weight.requires_grad_(False)
    return model


def epilogue(model: torch.nn.Module, fused: bool = True):
    ids = models.batch(VOCAB, b=2, t=16)
    captured = capture(model, (), make_inputs("llama", ids), device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    return next(t for t in (fuse(captured) if fused else captured).templates if t.kind == "epilogue")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_size", [8, 1000])
def test_the_launcher_makes_the_loss_and_dh_alone(dtype, chunk_size):
    """Exact to eager's loss and dh (the kernel tests' tolerances), chunks that do not divide the
    tokens among them; and bit for bit what the trainable head's launcher makes of them."""
    h, w, labels = lm_inputs(dtype, {"lm": (67, 33, 257)}, torch.Generator().manual_seed(0))
    out = linear_cross_entropy_forward(h, w, labels, -100, chunk_size, frozen_head=True)
    assert len(out) == 3 and tuple(out[2].shape) == (min(chunk_size, 67), 257)   # loss, dh, the tile: no dW
    loss, dh = out[:2]
    hr = h.clone().requires_grad_()
    want = fused_linear_cross_entropy_ref(hr, w, labels)
    (want_dh,) = torch.autograd.grad(want, hr)
    assert relative_error(loss, want) <= TOLERANCE[dtype] and relative_error(dh, want_dh) <= TOLERANCE[dtype]
    trainable = linear_cross_entropy_forward(h, w, labels, -100, chunk_size)
    assert torch.equal(loss, trainable[0]) and torch.equal(dh, trainable[1])


@pytest.mark.slow
def test_the_frozen_head_launches_compile_for_sm80_and_sm90():
    h, w, labels = lm_inputs(torch.bfloat16, {"lm": (19, 16, 4099)}, torch.Generator().manual_seed(1))
    with record_launches() as launches:
        linear_cross_entropy_forward(h, w, labels, -100, 8, frozen_head=True)
        linear_cross_entropy_forward(h.float(), w.float(), labels, -100, 8, 30.0, frozen_head=True)
    assert {x.kernel for x in launches.values()} == {"cross_entropy_grad_kernel"} and len(launches) == 2
    results = compile_launches(launches.values(), archs=FAST_ARCHS)
    assert all(r == "ok" for per in results.values() for r in per.values()), results


@pytest.mark.parametrize("build", [lora_llama, frozen_head_llama])
def test_a_frozen_head_saves_dh_not_the_log_softmax_nor_dw(build):
    old, new = epilogue(build(), fused=False), epilogue(build())
    assert (N, VOCAB) in [m.shape for m in old.saved]                      # eager's log-softmax
    assert (N, VOCAB) not in [m.shape for m in new.saved] and (VOCAB, H) not in [m.shape for m in new.saved]
    assert (N, H) in [m.shape for m in new.saved]                          # dh
    (fused,) = [n for n in new.forward.gm.graph.nodes if n.meta.get("kernel") == "fused_linear_cross_entropy"]
    assert fused.kwargs["frozen_head"] is True
    assert fused.args[1].op == "placeholder"                                # the head's W
    # nothing of [N, V] or [V, H] is left in either graph, and the backward no longer reads W
    for graph in (new.forward.gm.graph, new.backward.gm.graph):
        assert not {aten._log_softmax.default, aten.nll_loss_backward.default,
                    aten._log_softmax_backward_data.default, aten.mm.default} & {n.target for n in graph.nodes}
    assert len(new.bwd_params) == len(old.bwd_params) - 1


@pytest.mark.parametrize("build", [lora_llama, frozen_head_llama])
def test_a_frozen_head_trains_as_eager(build):
    """fp32, through megacompile.compile on the cpu backend: losses and first-step gradients of the
    trained parameters within 1e-5 of eager torch.optim.AdamW."""
    model = build()
    data = batches(steps=2)
    eager_first: dict = {}
    losses = eager_losses(clone(model), data, "llama", first_moments=eager_first)
    first: dict = {}
    with torch_attention():
        run = megacompile_run(clone(model), data, "llama", 1.0, fuse=True, first_moments=first)
    kernels = [n.meta.get("kernel") for t in run.engine.plan.captured.templates if t.kind == "epilogue"
               for n in t.forward.gm.graph.nodes]
    assert "fused_linear_cross_entropy" in kernels
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(first, eager_first) <= 1e-5
