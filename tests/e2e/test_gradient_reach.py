"""What a step trains is what eager autograd reaches: the loss the model returns (not a metric beside
it), the parameters the loss depends on (an unused or detached one keeps master and moments, as
torch.optim.AdamW skips a parameter whose .grad is None), whatever the caller's grad mode, and the
module as it is now (a block put in eval(), a parameter frozen after the first step)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import megacompile
from megacompile.acceptance.parity import BETAS, EPS, LR, WD
from tests.e2e.harness import clone

V, D = 64, 16


class Block(nn.Module):
    def __init__(self, dropout: float = 0.0, unused: bool = False):
        super().__init__()
        self.norm, self.fc, self.drop = nn.LayerNorm(D), nn.Linear(D, D), nn.Dropout(dropout)
        self.unused = nn.Linear(D, D) if unused else None     # built, never called

    def forward(self, x):
        return x + self.drop(self.fc(self.norm(x)))


class Model(nn.Module):
    """returns: "loss", "loss_accuracy", "loss_z" (two scalars with gradients), "accuracy" (only a
    metric), "hf_tuple" (transformers' return_dict=False: (loss, logits)), "dict" ({"loss": ..., "logits": ...},
    which transformers' Trainer reads as outputs["loss"]). detach: "embedding" (the
    blocks' input), "head" (the head's input)."""

    def __init__(self, returns: str = "loss", detach: str = "", dropout: float = 0.0, unused: bool = False):
        super().__init__()
        self.returns, self.detach = returns, detach
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(dropout, unused) for _ in range(3)])
        self.head = nn.Linear(D, V)
        self.spare = nn.Linear(D, D) if unused else None

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        if self.detach == "embedding":
            x = x.detach()
        for block in self.blocks:
            x = block(x)
        if self.detach == "head":
            x = x.detach()
        logits = self.head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        accuracy = (logits.argmax(-1) == labels).float().mean()
        return {"loss": loss, "loss_accuracy": (loss, accuracy), "loss_z": (loss, logits.logsumexp(-1).square().mean()),
                "accuracy": (logits, accuracy), "hf_tuple": (loss, logits),
                "dict": {"loss": loss, "logits": logits}}[self.returns]


def batches(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, V, (2, 8), generator=g), "labels": torch.randint(0, V, (2, 8), generator=g)}
            for _ in range(n)]


def engine_for(model: nn.Module) -> megacompile.Engine:
    return megacompile.compile(model, hbm_budget=0.01, device="cpu",
                               optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))


def eager(model: nn.Module, steps: list[dict], loss_of=lambda out: out, between=None) -> list[float]:
    """torch.optim.AdamW over the parameters that train now (zero_grad(set_to_none=True): one whose
    .grad stays None is skipped); between(i, model) runs before step i."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for i, inputs in enumerate(steps):
        if between is not None:
            between(i, model)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(**inputs))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def ours(model: nn.Module, steps: list[dict], between=None) -> tuple[list[float], megacompile.Engine]:
    engine, losses = engine_for(model), []
    for i, inputs in enumerate(steps):
        if between is not None:
            between(i, model)
        losses.append(engine.step(**inputs))
    engine.synchronize()
    return losses, engine


def assert_same(engine, reference: nn.Module, losses, expected, tol: float = 1e-5) -> None:
    assert losses == pytest.approx(expected, rel=tol)
    state = engine.state_dict()
    for name, want in reference.state_dict().items():
        err = (state[name] - want).abs().max().item() / max(want.abs().max().item(), 1e-12)
        assert err <= tol, f"{name}: {err:.3g}"


@pytest.mark.parametrize("returns", ["loss_accuracy", "hf_tuple", "dict"])
def test_the_loss_is_the_scalar_with_a_gradient(returns):
    """(loss, accuracy) and transformers' (loss, logits) train on the loss wherever it sits; the last
    element used to be taken (the accuracy: every update weight decay alone). A dict trains on its
    "loss", as transformers' Trainer does."""
    model, steps = Model(returns), batches(3)
    reference = clone(model)
    expected = eager(reference, steps, loss_of=lambda out: out["loss"] if isinstance(out, dict) else out[0])
    losses, engine = ours(clone(model), steps)
    assert_same(engine, reference, losses, expected)


def test_a_loss_without_gradient_or_two_candidates_is_refused():
    with pytest.raises(megacompile.LossError, match="ambiguous"):
        engine_for(Model("loss_z")).step(**batches(1)[0])
    with pytest.raises(megacompile.LossError, match="does not depend on any trainable parameter"):
        engine_for(Model("accuracy")).step(**batches(1)[0])


def test_a_first_step_under_no_grad_trains_as_any_other():
    """Traced under the caller's no_grad, the backward came out as zeros, and every later step
    reused it: only weight decay moved the weights."""
    model, steps = Model(), batches(3)
    reference = clone(model)
    expected = eager(reference, steps)
    engine, losses = engine_for(clone(model)), []
    with torch.no_grad():
        losses.append(engine.step(**steps[0]))
    losses += [engine.step(**inputs) for inputs in steps[1:]]
    engine.synchronize()
    assert_same(engine, reference, losses, expected)
    with torch.no_grad():
        under = megacompile.minimum_budget(Model(), inputs=steps[0])
    assert under == megacompile.minimum_budget(Model(), inputs=steps[0])


def test_parameters_the_loss_does_not_reach_keep_their_state():
    """A layer built and never called (in a block and at the top) and an embedding read through
    .detach(): eagerly their .grad stays None and AdamW leaves them as they are; they used to take
    weight decay and a zero-gradient step."""
    for model, skipped in ((Model(unused=True), ("spare.", ".unused.")), (Model(detach="embedding"), ("embed.",))):
        steps = batches(3)
        reference = clone(model)
        expected = eager(reference, steps)
        losses, engine = ours(clone(model), steps)
        assert_same(engine, reference, losses, expected)
        untouched = [n for n, _ in model.named_parameters() if any(s in "." + n for s in skipped)]
        assert untouched
        for name in untouched:
            assert torch.equal(engine.state_dict()[name], model.state_dict()[name]), name
            assert engine.state.adamw_step(name) == 0, name


def test_a_gradient_cut_between_stages_is_refused():
    """The head's input detached: the blocks get no gradient eagerly; across stages megacompile
    would hand them zeros, so it refuses and says how to freeze them instead."""
    with pytest.raises(megacompile.CaptureError, match=r"without differentiating it.*requires_grad_\(False\)"):
        engine_for(Model(detach="head")).step(**batches(1)[0])


def test_changes_to_the_module_after_a_step_are_trained():
    """A parameter frozen after the first step stops training (eagerly its .grad stays None); a
    block put in eval() stops its dropout. Both were invisible to the plan made at the first step."""
    def change(i, model):
        if i == 2:
            model.blocks[1].fc.weight.requires_grad_(False)
            model.blocks[0].eval()
    model, steps = Model(dropout=0.5), batches(4)
    reference = clone(model)
    torch.manual_seed(1)
    expected = eager(reference, steps, between=change)
    torch.manual_seed(1)
    losses, engine = ours(clone(model), steps, between=change)
    assert_same(engine, reference, losses, expected)
