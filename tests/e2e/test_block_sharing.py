"""Blocks that share tensors train exactly: one block module repeated in the list
(nn.ModuleList([b, b, b])), a weight tied across blocks, and a parameter or buffer of the model
handed as it is to every block (a shared scale, a causal mask kept as a buffer). Each shared
trainable tensor is one master whose gradient sums what every block that reads it gives, as
eagerly. And the user's module comes out of a refused capture as it went in."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import megacompile
from megacompile.errors import CaptureError
from tests.e2e.harness import BETAS, EPS, LR, WD, clone, float64_noise

V, D, T, B = 96, 32, 16, 2
GiB = 2 ** 30


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.q, self.k = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x, scale=None, mask=None, x0=None):       # x: (B, T, D)
        h = self.norm(x)
        if scale is not None:
            h = h * scale
        if x0 is not None:
            h = h + x0
        scores = self.q(h) @ self.k(h).transpose(1, 2) / D ** 0.5   # (B, T, T)
        if mask is not None:
            scores = scores + mask
        return x + torch.softmax(scores, -1) @ h + self.fc2(F.gelu(self.fc1(h)))


class Model(nn.Module):
    def __init__(self, sharing: str, layers: int = 3):
        super().__init__()
        self.sharing = sharing
        self.emb = nn.Embedding(V, D)
        if sharing == "one block repeated":
            block = Block()
            self.blocks = nn.ModuleList([block] * layers)
        else:
            self.blocks = nn.ModuleList([Block() for _ in range(layers)])
        if sharing == "a weight tied across blocks":
            for block in self.blocks[1:]:
                block.fc1.weight = self.blocks[0].fc1.weight
        self.scale = nn.Parameter(torch.full((D,), 1.1))
        self.register_buffer("causal", torch.full((T, T), -1e9).triu(1))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for block in self.blocks:
            if self.sharing == "a parameter handed to every block":
                x = block(x, scale=self.scale)
            elif self.sharing == "a buffer handed to every block":
                x = block(x, mask=self.causal)
            else:
                x = block(x, mask=torch.full((T, T), -1e9).triu(1))
        return F.cross_entropy(self.head(x).reshape(-1, V), labels.reshape(-1))


SHARINGS = ["one block repeated", "a weight tied across blocks", "a parameter handed to every block",
            "a buffer handed to every block"]


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [dict(input_ids=torch.randint(0, V, (B, T), generator=g), labels=torch.randint(0, V, (B, T), generator=g))
            for _ in range(n)]


def _eager(model, batches, grad_accum=1):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for i, batch in enumerate(batches):
        loss = model(**batch)
        (loss / grad_accum).backward()
        losses.append(loss.item())
        if (i + 1) % grad_accum == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


def _engine(model, budget, **kw):
    adamw = megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch")
    return megacompile.compile(model, hbm_budget=budget, device="cpu", optimizer=adamw, **kw)


def _assert_weights(engine, reference, tol=0.0):
    ours, theirs = engine.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, want in theirs.items():
        err = (ours[name] - want).abs().max().item() / (want.abs().max().item() or 1.0)
        assert err <= tol, f"{name}: {err:.3g} relative to its largest entry (tolerance {tol:.3g})"


@pytest.mark.parametrize("budget", ["ample", "smallest"])
@pytest.mark.parametrize("sharing", SHARINGS)
def test_blocks_sharing_tensors_train_as_eagerly(sharing, budget):
    torch.manual_seed(0)
    model = Model(sharing)
    batches = _batches(3)
    reference = clone(model)
    losses = _eager(reference, batches)
    gib = 1.0
    if budget == "smallest":
        probe = _engine(clone(model), 1.0)
        probe.step(**batches[0])
        gib = probe.plan.minimum_budget_bytes / GiB
    engine = _engine(model, gib)
    assert [engine.step(**b) for b in batches] == losses
    _assert_weights(engine, reference)
    with torch.no_grad():
        assert engine(**batches[0]).item() == reference(**batches[0]).item()     # the forward alone, too
    assert isinstance(model.blocks[0].fc1.weight, nn.Parameter) and model.blocks[0].fc1.weight.device.type == "cpu"


@pytest.mark.parametrize("sharing", ["one block repeated", "a weight tied across blocks"])
def test_blocks_sharing_a_weight_accumulate_layer_by_layer(sharing):
    """Layer-major accumulation sums a shared weight's gradients in another order than eagerly:
    the weights agree to the float32 noise floor (a key bias's true gradient is zero: softmax
    ignores it, and AdamW steps it by the rounding noise)."""
    torch.manual_seed(0)
    model = Model(sharing)
    batches = _batches(4)
    reference = clone(model)
    _eager(reference, batches, grad_accum=2)
    noise = float64_noise(lambda exact: _eager(exact, batches, grad_accum=2), model, reference)
    engine = _engine(model, 1.0, grad_accum=2, accumulation="layer")
    for batch in batches:
        engine.step(**batch)
    _assert_weights(engine, reference, tol=max(1e-5, 2 * noise))


def _parameters(model):
    return [(n, p, p.detach().clone()) for n, p in model.named_parameters()]


def _assert_intact(model, before, batch, loss):
    for (name, p, value), (name_now, now) in zip(before, model.named_parameters()):
        assert name == name_now and now is p and type(p) is nn.Parameter and torch.equal(p.detach(), value), name
    assert all("forward" not in vars(m) for m in model.modules())
    with torch.no_grad():
        assert model(**batch).item() == loss


class _ReadsAValue(Model):
    def forward(self, input_ids, labels):
        loss = super().forward(input_ids, labels)
        if loss.item() > 0:         # a Python branch on a tensor's value: fake tensors have none
            return loss
        return -loss


class _ResidualToTheEmbedding(Model):
    def forward(self, input_ids, labels):
        x0 = self.emb(input_ids)
        x = x0
        for block in self.blocks:
            x = block(x, x0=x0)     # every block reads the embedding: a gradient around the chain
        return F.cross_entropy(self.head(x).reshape(-1, V), labels.reshape(-1))


@pytest.mark.parametrize("model_class, refused", [(_ReadsAValue, "failed while tracing"),
                                                  (_ResidualToTheEmbedding, "does not come from the previous block")])
def test_a_refused_capture_leaves_the_users_module_as_it_was(model_class, refused):
    """The trace fails (a value read in Python) or the stages are refused (a gradient around the
    chain), after fake tensors were swapped into a block module the list holds three times."""
    torch.manual_seed(0)
    model = model_class("one block repeated")
    batch = _batches(1)[0]
    with torch.no_grad():
        loss = model(**batch).item()
    before = _parameters(model)
    engine = _engine(model, 1.0)
    with pytest.raises(CaptureError, match=refused):
        engine.step(**batch)
    _assert_intact(model, before, batch, loss)


class _ScaleMadeBeforeTheBlocks(Model):
    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        scale = self.scale.view(1, 1, D) * 2        # computed once, outside the blocks, needing a gradient
        for block in self.blocks:
            x = block(x, scale=scale)
        return F.cross_entropy(self.head(x).reshape(-1, V), labels.reshape(-1))


def test_a_value_made_from_a_parameter_before_the_blocks_is_refused_naming_the_parameter():
    torch.manual_seed(0)
    engine = _engine(_ScaleMadeBeforeTheBlocks("none"), 1.0)
    with pytest.raises(CaptureError, match=r"input 1 of block blocks.1 needs a gradient.*computed from the model's "
                                           r"scale outside the blocks. Hand each block the parameter itself"):
        engine.step(**_batches(1)[0])
