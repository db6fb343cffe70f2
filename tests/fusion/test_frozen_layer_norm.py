"""A frozen LayerNorm (LoRA's norms, or finetuning_type freeze with the norms left out of
freeze_trainable_modules) gets the fused backward too: its native_layer_norm_backward asks for dx
alone (output mask [True, False, False]), so the kernel runs without the dw and db sums
(`weight_grad=False`), and the model trains through it as eager does."""
from __future__ import annotations

import pytest
import torch

from megacompile.acceptance.parity import moment_error
from megacompile.capture import capture
from megacompile.fusion import fuse, fusion_report
from megacompile.train.methods.lora import with_adapters
from tests import models
from tests.e2e.harness import clone, eager_losses, make_inputs, megacompile_run
from tests.families import _common, _hf
from tests.fusion.training import BUILDERS, VOCAB, batches, counts, torch_attention

aten = torch.ops.aten


def frozen_norms_gpt2() -> torch.nn.Module:
    """GPT-2 with its LayerNorms frozen, weight and bias (ln_1, ln_2, ln_f): freeze fine-tuning of
    the attention and MLP modules."""
    torch.manual_seed(0)
    model = BUILDERS["gpt2"]()
    for name, p in model.named_parameters():
        p.requires_grad_(".ln_" not in name)
    return model


def lora_phi() -> torch.nn.Module:
    """A 2-block Phi with adapters on every Linear of its blocks: the LayerNorms and the head frozen."""
    torch.manual_seed(0)
    model = _hf("PhiConfig", "PhiForCausalLM", **_common(num_hidden_layers=2, resid_pdrop=0.0, embd_pdrop=0.0,
                                                         attention_dropout=0.0, partial_rotary_factor=0.5))
    model = with_adapters(model, 4, 8, 0.0, "all")
    for name, p in model.named_parameters():     # B starts at zero: move it, so A gets a gradient
        if "lora_B" in name:
            p.data.normal_(0.0, 0.02)
    return model


def _norm_backwards(after) -> list:
    return [n for t in after.templates for n in t.backward.gm.graph.nodes
            if n.meta.get("kernel") == "layer_norm_backward"]


@pytest.mark.parametrize("build", [frozen_norms_gpt2, lora_phi])
def test_a_frozen_layer_norm_runs_the_kernel_without_dw_and_db(build):
    torch.manual_seed(0)
    ids = models.batch(VOCAB, b=2, t=16)
    after = fuse(capture(build(), (), make_inputs("hf", ids), device=torch.device("cpu"),
                         compute_dtype=torch.float32))
    for t in after.templates:
        targets = {n.target for n in t.backward.gm.graph.nodes}
        assert aten.native_layer_norm_backward.default not in targets, f"{t.kind}:\n{fusion_report(after)}"
    norms = _norm_backwards(after)
    # two per block template (GPT-2's ln_1, ln_2) or one (Phi's shared input norm), and the final norm
    assert len(norms) == (3 if build is frozen_norms_gpt2 else 2), fusion_report(after)
    for n in norms:
        assert n.args[5] is False                                        # weight_grad
        assert [u.args[1] for u in n.users] == [0] and len(n.meta["val"]) == 1   # dx alone
    if build is frozen_norms_gpt2:
        assert counts(after, "block")[1]["layer_norm_backward"] == 2


@pytest.mark.parametrize("build", [frozen_norms_gpt2, pytest.param(lora_phi, marks=pytest.mark.slow)])
def test_a_frozen_layer_norm_trains_as_eager(build):
    """fp32, through megacompile.compile on the cpu backend: losses and first-step gradients of the
    trained parameters within 1e-5 of eager torch.optim.AdamW."""
    model = build()
    data = batches(steps=2)
    eager_first: dict = {}
    losses = eager_losses(clone(model), data, "hf", first_moments=eager_first)
    first: dict = {}
    with torch_attention():
        run = megacompile_run(clone(model), data, "hf", 1.0, fuse=True, first_moments=first)
    norms = _norm_backwards(run.engine.plan.captured)
    assert norms and all(n.args[5] is False for n in norms)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(first, eager_first) <= 1e-5
