"""Partial fine-tuning: with any subset of parameters frozen, megacompile trains the rest as
eager torch.optim.AdamW does (frozen weights stay as they were, gradients still flow through
frozen stages to earlier trainable ones), and frozen parameters get no host AdamW state and no
gradient offload.
"""
from __future__ import annotations

import pytest
import torch

from megacompile.ir.program import Op
from megacompile.cost.host_memory import host_costs
from megacompile.acceptance.parity import moment_error
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_bytes, weight_noise
from tests.families import FAMILIES, LAYERS, batch

GiB = 2 ** 30
STEPS = 3

# name -> (family, which parameters to freeze, by name)
FREEZE = {
    "embeddings": ("llama", lambda n: "embed_tokens" in n),
    "first half of the blocks": ("llama", lambda n: any(f"layers.{i}." in n for i in range(LAYERS // 2))),
    "head": ("llama", lambda n: n.startswith("lm_head")),
    "all but the norms": ("llama", lambda n: "norm" not in n),
    "embeddings and first half": ("llama", lambda n: "embed_tokens" in n or "layers.0." in n or "layers.1." in n),
    "biases": ("gpt2", lambda n: n.endswith(".bias")),
}
# The last test below trains "embeddings and first half" in the default tier too.
DEFAULT = {"embeddings"}


def frozen_model(mode: str):
    family, frozen = FREEZE[mode]
    torch.manual_seed(0)
    model = FAMILIES[family]()
    for name, p in model.named_parameters():
        p.requires_grad_(not frozen(name))
    return model


@pytest.mark.parametrize("mode", [m if m in DEFAULT else pytest.param(m, marks=pytest.mark.slow) for m in FREEZE])
def test_partial_fine_tuning_parity(mode):
    model = frozen_model(mode)
    batches = [batch(seed=i) for i in range(STEPS)]
    reference = clone(model)
    eager_moments = {}
    losses = eager_losses(reference, batches, "hf", first_moments=eager_moments)
    noise = weight_noise(model, batches, "hf", reference)
    budget_bytes = 2 * weight_bytes(model)
    for _ in range(2):   # twice the weights, then the smallest budget that plan reports
        moments = {}
        run = megacompile_run(clone(model), batches, "hf", budget_bytes / GiB, first_moments=moments)
        torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
        assert moment_error(moments, eager_moments) <= 1e-5
        assert_same_weights(run.engine, reference, noise=noise)
        assert max(run.peaks) <= budget_bytes
        budget_bytes = run.engine.plan.minimum_budget_bytes


def test_frozen_parameters_get_no_optimizer_state_and_no_gradient_offload():
    model = frozen_model("embeddings and first half")
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    batches = [batch(seed=i) for i in range(STEPS)]
    reference = clone(model)
    eager_moments = {}
    losses = eager_losses(reference, batches, "hf", first_moments=eager_moments)
    moments = {}
    run = megacompile_run(clone(model), batches, "hf", 2 * weight_bytes(model) / GiB, first_moments=moments)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(moments, eager_moments) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, batches, "hf", reference))
    host, plan = run.engine.host, run.engine.plan
    assert frozen and not frozen & set(host.slots)          # no master, exp_avg, exp_avg_sq, grad
    assert sum(b.master.numel() for b in host.owners.values()) == sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    assert host.nbytes == host_costs(plan.captured, torch.float32)[0].ram_bytes   # what planning reports before the run
    stages = plan.captured.stages
    fully_frozen = {s for s, st in enumerate(stages) if not any(n in host.slots for n in st.params)}
    assert {st.name for s, st in enumerate(stages) if s in fully_frozen} == {"prologue", "block.0", "block.1"}
    ops = [(n.op, n.stage) for n in plan.program.nodes]
    for s in fully_frozen:
        assert (Op.OFFLOAD, s) not in ops and (Op.OPTIMIZER_STEP, s) not in ops
        # nothing before them trains, so they have no backward either
        assert (Op.BACKWARD, s) not in ops
    # block.2 trains but its input needs no gradient: it is not the template block.3 runs
    assert stages[3].template is not stages[4].template
    assert not stages[3].template.grad_acts and stages[4].template.grad_acts
