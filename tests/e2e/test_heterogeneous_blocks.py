"""Blocks that differ in something other than their tensors train exactly as eager.

Each model here has a block stack whose layers differ where a template traced from block 0 would
not see it: a Python flag read in forward, a per-layer scalar, GELU against GELU(tanh), another
module class in one layer, an extra module in one layer, Hugging Face GPT-2's per-layer attention
scale, a custom autograd.Function or a gradient hook whose backward reads a per-layer number. Each trains through
megacompile as eager torch.optim.AdamW does, to 1e-5 in losses and weights, with an unlimited and
a small budget, and runs the number of block templates it needs: one per distinct block.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import megacompile
from megacompile.capture import capture
from tests import models
from tests.e2e.harness import (BETAS, EPS, LR, WD, assert_same_weights, clone, eager_losses, float64_noise,
                               megacompile_run)

GiB = 2 ** 30
STEPS = 3
VOCAB, D, T = 96, 32, 16


class _Scale(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by a Python number of the layer's."""

    @staticmethod
    def forward(ctx, x, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class Block(nn.Module):
    """A pre-norm MLP block, rotated by the side inputs (cos, sin) when `rope` is on."""

    def __init__(self, act: nn.Module | None = None, alpha: float = 1.0, rope: bool = True,
                 grad_factor: float | None = None, hook_factor: float | None = None):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.act = act if act is not None else nn.GELU()
        self.alpha, self.rope = alpha, rope
        self.grad_factor, self.hook_factor = grad_factor, hook_factor

    def mix(self, h, cos, sin):                          # h: (B, T, D); cos, sin: (T, D)
        if self.rope:
            h = h * cos + torch.roll(h, 1, dims=-1) * sin
        return h

    def forward(self, x, cos, sin):
        h = self.mix(self.ln(x), cos, sin)
        if self.grad_factor is not None:
            h = _Scale.apply(h, self.grad_factor)
        if self.hook_factor is not None and h.requires_grad:
            h.register_hook(lambda g: g * self.hook_factor)
        return x + self.alpha * self.down(self.act(self.up(h)))


class ReluBlock(Block):
    """Same parameters as Block, another class and another activation."""

    def forward(self, x, cos, sin):
        h = self.mix(self.ln(x), cos, sin)
        return x + F.relu(self.down(self.up(h)))


class NormedBlock(Block):
    """Block with one more module: a norm on its output."""

    def __init__(self):
        super().__init__()
        self.post = nn.LayerNorm(D)

    def forward(self, x, cos, sin):
        return self.post(super().forward(x, cos, sin))


class ConstantBlock(Block):
    """Scales its output by a tensor it makes in forward: a new tensor object in every call."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c

    def forward(self, x, cos, sin):
        return super().forward(x, cos, sin) * torch.tensor(self.c)


class Stack(nn.Module):
    """Embedding, the given blocks, a head; returns the mean cross-entropy."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.h = nn.ModuleList(blocks)
        self.ln_f, self.head = nn.LayerNorm(D), nn.Linear(D, VOCAB, bias=False)

    def forward(self, input_ids, labels):
        angle = torch.arange(input_ids.shape[1], dtype=torch.float32)[:, None] / (1 + torch.arange(D))  # (T, D)
        cos, sin = angle.cos(), angle.sin()
        x = self.emb(input_ids)
        for block in self.h:
            x = block(x, cos, sin)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _gpt2_inverse_layer_idx(layers: int = 4):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=layers, n_head=4, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      scale_attn_by_inverse_layer_idx=True))


def _module_hook_in_one_layer():
    model = Stack([Block() for _ in range(4)])
    model.h[2].down.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 3.0,))
    return model


# kind -> (builder, block templates it needs)
MODELS = {
    # rotary off in every fourth layer, as some small Llama-style models configure it
    "flag": (lambda: Stack([Block(rope=i % 4 != 3) for i in range(8)]), 2),
    "scalar": (lambda: Stack([Block(alpha=i + 1) for i in range(4)]), 4),
    "gelu_tanh": (lambda: Stack([Block(nn.GELU() if i % 2 == 0 else nn.GELU(approximate="tanh"))
                                 for i in range(4)]), 2),
    "class": (lambda: Stack([ReluBlock() if i == 2 else Block() for i in range(4)]), 2),
    "extra_module": (lambda: Stack([NormedBlock() if i == 1 else Block() for i in range(4)]), 2),
    "backward_only": (lambda: Stack([Block(grad_factor=0.5 if i == 3 else 2.0) for i in range(4)]), 2),
    "hook": (lambda: Stack([Block(hook_factor=0.5 if i == 3 else 2.0) for i in range(4)]), 2),
    "module_hook": (_module_hook_in_one_layer, 2),
    "gpt2_inverse_layer_idx": (_gpt2_inverse_layer_idx, 4),
    "tensor_constant": (lambda: Stack([ConstantBlock(3.0 if i == 2 else 1.0) for i in range(4)]), 2),
}


def _eager(model, batches, kind: str) -> list[float]:
    if kind.startswith("gpt2"):
        return eager_losses(model, batches, "hf")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _block_templates(engine) -> int:
    return len({id(s.template.full or s.template) for s in engine.plan.captured.stages if s.template.kind == "block"})


# The default tier keeps two; the slow tier (-m slow) trains the rest.
FAST = {"scalar", "gelu_tanh"}


def _tiered(kinds, fast):
    return [k if k in fast else pytest.param(k, marks=pytest.mark.slow) for k in kinds]


@pytest.mark.parametrize("kind", _tiered(MODELS, FAST))
def test_heterogeneous_blocks_train_as_eager_on_their_own_templates(kind):
    build, n_templates = MODELS[kind]
    torch.manual_seed(0)
    model = build()
    batches = [models.batch(VOCAB, b=2, t=T, seed=i) for i in range(STEPS)]
    reference = clone(model)
    losses = _eager(reference, batches, kind)
    noise = float64_noise(lambda m: _eager(m, batches, kind), model, reference)

    run = megacompile_run(clone(model), batches, "hf", 64.0)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert_same_weights(run.engine, reference, noise=noise)
    assert _block_templates(run.engine) == n_templates
    assert len(run.engine.plan.captured.template_notes) == n_templates - 1

    # A small budget: halfway between the smallest plan and the unlimited one less its resident
    # weights (a roomy plan keeps every weight for the step), so some blocks must be recomputed,
    # offloaded or saved selectively, across the templates.
    plan = run.engine.plan
    weights = sum(st.template.weight_bytes for st in plan.captured.stages)
    budget = max(plan.minimum_budget_bytes, (plan.minimum_budget_bytes + plan.predicted_peak_bytes - weights) // 2)
    small = megacompile_run(clone(model), batches, "hf", budget / GiB)
    torch.testing.assert_close(torch.tensor(small.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert_same_weights(small.engine, reference, noise=noise)
    choice = small.engine.plan.program.facts["choice"]
    assert choice.recompute or choice.offload or choice.selective
    assert max(small.peaks) <= budget
    assert _block_templates(small.engine) == n_templates


def test_a_backward_hook_on_a_block_module_itself_is_refused():
    model = Stack([Block() for _ in range(4)])
    model.h[2].register_full_backward_hook(lambda module, grad_in, grad_out: None)
    ids = models.batch(VOCAB, b=2, t=T)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.CaptureError, match=r"h\.2 has a backward hook on the block module itself"):
        engine.step(input_ids=ids, labels=ids)


def test_the_plan_names_the_layer_and_what_differs():
    torch.manual_seed(0)
    model = MODELS["gelu_tanh"][0]()
    ids = models.batch(VOCAB, b=2, t=T)
    run = megacompile_run(model, [ids], "hf", 64.0)
    text = run.engine.plan.summary()
    assert "4 blocks of h run 2 templates" in text
    assert "h.1 has its own template" in text and "approximate='tanh'" in text
    blocks = run.engine.plan.to_json()["blocks"]
    assert [b["template"] for b in blocks] == [0, 1, 0, 1]


def test_a_frozen_embedding_gives_the_first_layer_a_template_named_in_words():
    """The first layer's input comes from a frozen embedding and needs no gradient; the second's
    does: the note says so by input, not as two lists of booleans."""
    torch.manual_seed(0)
    model = Stack([Block() for _ in range(3)])
    model.emb.weight.requires_grad_(False)
    notes = _capture(model, models.batch(VOCAB, b=2, t=T)).template_notes
    assert notes == {"block.1": "h.1 has its own template: it differs from h.0 in which inputs need a gradient and "
                                "which outputs are read (its input 0 needs a gradient and h.0's does not)"}


def _capture(model, ids):
    return capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)


def _count_traces(monkeypatch) -> list[str]:
    """The kinds of the stages traced from here on (prologue, block, epilogue), in order."""
    import megacompile.capture.segment as segment
    traced: list[str] = []
    real = segment.trace_stage

    def counting(kind, *args, **kwargs):
        traced.append(kind)
        return real(kind, *args, **kwargs)
    monkeypatch.setattr(segment, "trace_stage", counting)
    return traced


@pytest.mark.parametrize("kind,layers", [("flag", 8), ("flag", 64), pytest.param("llama", 8, marks=pytest.mark.slow),
                                         pytest.param("llama", 64, marks=pytest.mark.slow)])
def test_one_trace_per_block_template_whatever_the_depth(kind, layers, monkeypatch):
    """Capture traces one template per distinct block: its cost does not grow with depth."""
    torch.manual_seed(0)
    if kind == "llama":
        model, expected = models.hf_llama(layers=layers, d=32), 1
    else:
        model, expected = Stack([Block(rope=i % 4 != 3) for i in range(layers)]), 2
    traced = _count_traces(monkeypatch)
    captured = _capture(model, models.batch(VOCAB, b=2, t=T))
    assert traced.count("block") == expected
    assert len(captured.block_templates) == expected
    assert sum(s.template.kind == "block" for s in captured.stages) == layers


@pytest.mark.parametrize("kind", _tiered(["llama", "qwen2", "gpt2", "nanogpt", "tensor_constant"],
                                         {"llama", "tensor_constant"}))
def test_identical_layers_share_one_template(kind):
    """Per-layer attributes that change nothing computed (Hugging Face's layer_idx) split nothing,
    nor do equal constants each block makes anew."""
    torch.manual_seed(0)
    build = {"llama": models.hf_llama, "qwen2": models.hf_qwen2, "gpt2": models.hf_gpt2}.get(kind)
    ids = models.batch(VOCAB, b=2, t=T)
    if kind == "tensor_constant":
        captured = _capture(Stack([ConstantBlock(2.0) for _ in range(4)]), ids)
    elif build is None:
        captured = capture(models.NanoGPT(vocab=VOCAB, d=32, layers=8), (), {"idx": ids, "targets": ids},
                           device=torch.device("cpu"), compute_dtype=torch.float32)
    else:
        captured = _capture(build(layers=8, d=32), ids)
    assert len(captured.block_templates) == 1
    assert captured.template_notes == {}


@pytest.mark.slow
def test_fusion_rewrites_each_block_template_on_its_own():
    """GELU and GELU(tanh) blocks, fused: each template gets its own kernels, and the weights
    after two steps agree with the unfused run, which agrees with eager (above)."""
    from megacompile.fusion import kernel_counts
    from tests.fusion.training import batches, train
    torch.manual_seed(0)
    model = Stack([Block(nn.GELU() if i % 2 == 0 else nn.GELU(approximate="tanh")) for i in range(2)])
    steps = batches(steps=2)
    fused, unfused = train(model, "hf", steps, fuse=True), train(model, "hf", steps, fuse=False)
    templates = fused.engine.plan.captured.block_templates
    assert len(templates) == 2
    for t in templates:
        assert kernel_counts(t.forward.gm)["gelu"] == 1 and kernel_counts(t.backward.gm)["gelu_backward"] == 1
    torch.testing.assert_close(torch.tensor(fused.losses), torch.tensor(unfused.losses), rtol=1e-5, atol=0)
    for name, ref in unfused.weights.items():
        err = (fused.weights[name] - ref).abs().max().item()
        assert err <= 1e-5 * ref.abs().max().item(), name


@pytest.mark.slow
def test_baselines_and_exact_resume_with_several_templates(tmp_path):
    torch.manual_seed(0)
    model = MODELS["scalar"][0]()
    batches = [models.batch(VOCAB, b=2, t=T, seed=i) for i in range(4)]
    inputs = {"input_ids": batches[0], "labels": batches[0]}
    for style in ("megatrain", "zero3"):
        plan = megacompile.plan(clone(model), 1.0, hardware="cpu", inputs=inputs, style=style,
                                compute_dtype=torch.float32)
        assert "4 blocks of h run 4 templates" in plan.summary()
        assert {b["template"] for b in plan.blocks()} == {0, 1, 2, 3}

    def engine():
        return megacompile.compile(clone(model), hbm_budget=64.0, device="cpu",
                                   optimizer=megacompile.AdamW(lr=1e-3, max_grad_norm=1.0))
    straight, first = engine(), engine()
    expected = [straight.step(input_ids=ids, labels=ids) for ids in batches]
    for ids in batches[:2]:
        first.step(input_ids=ids, labels=ids)
    path = str(tmp_path / "ckpt.pt")
    first.save_checkpoint(path)
    resumed = engine()
    resumed.prepare(input_ids=batches[0], labels=batches[0])
    resumed.load_checkpoint(path)
    assert [resumed.step(input_ids=ids, labels=ids) for ids in batches[2:]] == expected[2:]
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
