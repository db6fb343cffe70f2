"""Each pattern is found where it should be, the ops it covers are gone, the contract between the
forward and backward graphs still holds, and a graph with nothing to fuse comes back unchanged."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from megacompile.capture import capture
from megacompile.fusion import fuse, fusion_report
from tests import models
from tests.e2e.harness import make_inputs
from tests.fusion.training import BUILDERS, counts

aten = torch.ops.aten

LLAMA = {
    # cos * 1.0, sin * 1.0 of the rotary table; the token embedding's weight gradient
    "prologue": ({"elementwise": 2}, {"embedding_backward": 1}),
    "block": ({"rms_norm": 2, "rope": 2, "attention": 1, "swiglu": 1},
              {"rms_norm_backward": 2, "rope_backward": 2, "attention_backward": 1, "swiglu_backward": 1,
               "elementwise": 1}),
    "epilogue": ({"rms_norm": 1, "fused_linear_cross_entropy": 1},
                 {"fused_linear_cross_entropy_backward": 1, "rms_norm_backward": 1}),
}
GPT2 = {
    "prologue": ({}, {"embedding_backward": 2}),              # the token and the position embeddings
    "block": ({"layer_norm": 2, "attention": 1, "gelu": 1},
              {"layer_norm_backward": 2, "attention_backward": 1, "gelu_backward": 1}),
    "epilogue": ({"layer_norm": 1, "fused_linear_cross_entropy": 1},
                 {"fused_linear_cross_entropy_backward": 1, "layer_norm_backward": 1}),
}
EXPECTED = {"llama": LLAMA, "qwen2": LLAMA, "gpt2": GPT2, "nanogpt": GPT2}
# ATen ops the rewrites must leave no trace of, per model
SDPA = {aten._scaled_dot_product_flash_attention_for_cpu.default,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
GONE = {
    "llama": {aten.rsqrt.default, aten.silu.default, aten.silu_backward.default, aten.cat.default,
              aten.slice_backward.default, aten._log_softmax.default, aten.nll_loss_forward.default,
              aten.nll_loss_backward.default, aten._log_softmax_backward_data.default, *SDPA},
    "gpt2": {aten.native_layer_norm.default, aten.native_layer_norm_backward.default, aten.tanh.default,
             aten.tanh_backward.default, aten._log_softmax.default, aten.nll_loss_backward.default, *SDPA},
    "nanogpt": {aten.native_layer_norm.default, aten.gelu.default, aten.gelu_backward.default,
                aten._log_softmax.default, *SDPA},
}
GONE["qwen2"] = GONE["llama"]


def captured(kind: str, dtype: torch.dtype = torch.float32, b: int = 2, t: int = 16):
    torch.manual_seed(0)
    model = BUILDERS[kind]() if kind in BUILDERS else kind()
    ids = models.batch(96, b=b, t=t)
    return capture(model, (), make_inputs(kind if isinstance(kind, str) else "", ids), device=torch.device("cpu"),
                   compute_dtype=dtype)


@pytest.mark.parametrize("kind,dtype", [(k, torch.float32) for k in EXPECTED] + [("llama", torch.bfloat16)])
def test_patterns_found_per_template(kind, dtype):
    before = captured(kind, dtype)
    after = fuse(before)
    for template_kind, (fwd, bwd) in EXPECTED[kind].items():
        assert counts(after, template_kind) == (fwd, bwd), f"{kind} {template_kind}:\n{fusion_report(after)}"
    for t in (t for t in after.templates if t.kind != "prologue"):   # the prologue's cat builds the rotary table
        targets = {n.target for gm in (t.forward.gm, t.backward.gm) for n in gm.graph.nodes}
        assert not targets & GONE[kind], f"{t.kind} still runs {targets & GONE[kind]}"
    # every block stage still shares one (new) template; the other stages keep theirs
    blocks = {id(s.template) for s in after.stages if s.template.kind == "block"}
    assert len(blocks) == 1 and not blocks & {id(t) for t in before.templates}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_contract_between_forward_and_backward_holds(kind):
    before = captured(kind)
    after = fuse(before)
    for old, new in zip(before.templates, after.templates):
        fwd_out = list(new.forward.output_node.args[0])
        assert len(fwd_out) == len(new.outputs) + len(new.saved)
        assert [tuple(n.meta["val"].shape) for n in fwd_out[len(new.outputs):]] == [m.shape for m in new.saved]
        n_in = len(new.bwd_params) + len(new.bwd_acts)
        placeholders = new.backward.placeholders
        assert len(placeholders) == n_in + len(new.saved) + len(new.tangent_outputs)
        for ph, meta in zip(placeholders[n_in:], new.saved):
            assert tuple(ph.meta["val"].shape) == meta.shape and ph.meta["val"].dtype == meta.dtype
        for ph, i in zip(placeholders, new.bwd_params + [len(new.params) + a for a in new.bwd_acts]):
            assert tuple(ph.meta["val"].shape) == tuple(new.forward.placeholders[i].meta["val"].shape)
        # a fused block saves less (xhat, silu(gate), GELU's tanh terms are gone); nanoGPT's ATen GELU
        # and LayerNorm already saved only what the kernels need
        if old.kind == "block":
            fewer = sum(m.nbytes for m in new.saved) - sum(m.nbytes for m in old.saved)
            assert fewer <= 0 if kind == "nanogpt" else fewer < 0


def test_epilogue_saves_gradients_not_log_softmax():
    before = captured("llama")
    after = fuse(before)
    old = next(t for t in before.templates if t.kind == "epilogue")
    new = next(t for t in after.templates if t.kind == "epilogue")
    n_tokens, vocab, width = 2 * 16, 96, 32
    assert (n_tokens, vocab) in [m.shape for m in old.saved]               # the log-softmax
    assert (n_tokens, vocab) not in [m.shape for m in new.saved]
    assert {(n_tokens, width), (vocab, width)} <= {m.shape for m in new.saved}   # dh, dW (fp32)


def _frozen_head():
    model = BUILDERS["llama"]()
    model.lm_head.weight.requires_grad_(False)        # finetuning_type freeze, the head among the frozen
    return model


def _lora():
    from megacompile.train.methods.lora import with_adapters
    return with_adapters(BUILDERS["llama"](), 4, 8, 0.0, "all")   # the head and every norm frozen


@pytest.mark.parametrize("build", [_frozen_head, _lora])
def test_a_frozen_head_and_frozen_norms_are_matched(build):
    """A head whose backward makes dh alone gets the fused loss without dW; a frozen norm's backward
    gets the norm kernel without dw."""
    after = fuse(captured(build))
    assert counts(after, "epilogue") == LLAMA["epilogue"], fusion_report(after)
    nodes = [n for t in after.templates if t.kind != "prologue"   # its cat builds the rotary table
             for gm in (t.forward.gm, t.backward.gm) for n in gm.graph.nodes]
    (loss,) = [n for n in nodes if n.meta.get("kernel") == "fused_linear_cross_entropy"]
    assert loss.kwargs["frozen_head"] is True
    norms = [n for n in nodes if n.meta.get("kernel") == "rms_norm_backward"]
    assert norms and all(n.args[4] is (build is _frozen_head) for n in norms)   # dw only where w is trained
    assert not {n.target for n in nodes} & GONE["llama"]


def test_a_frozen_bf16_norm_saves_no_fp32_copy_of_x():
    """Without dw the norm's backward still reads x in bf16: LoRA's blocks save no fp32 copy of it."""
    before = captured(_lora, torch.bfloat16)
    after = fuse(before)
    width = 32
    copies = lambda t: [m for m in t.saved if m.dtype == torch.float32 and m.shape[-1] == width]  # noqa: E731
    for old, new in zip(before.templates, after.templates):
        if old.kind == "block":
            assert copies(old) and not copies(new)
            assert sum(m.nbytes for m in new.saved) < sum(m.nbytes for m in old.saved)


def test_bf16_norm_backward_reads_x_not_its_fp32_copy():
    """HF's RMSNorm saves x.float() for its backward; the kernel reads x in bf16, so the fused block
    keeps x itself (its input, or the residual sum at half the bytes) instead."""
    before = captured("llama", torch.bfloat16)
    after = fuse(before)
    old, new = (next(t for t in c.templates if t.kind == "block") for c in (before, after))
    width = 32
    copies = lambda t: [m for m in t.saved if m.dtype == torch.float32 and m.shape[-1] == width]  # noqa: E731
    assert len(copies(old)) == 2 and not copies(new)
    # the backward reads the block's input x, and otherwise only inputs that need no gradient
    # (the rotary tables, which capture recomputes from rather than saves)
    assert 0 in new.bwd_acts and all(not new.acts[i].requires_grad for i in new.bwd_acts if i != 0)
    assert sum(m.nbytes for m in new.saved) < sum(m.nbytes for m in old.saved)


def test_softmax_of_eager_attention():
    from transformers import GPT2Config, GPT2LMHeadModel

    def eager_gpt2():
        return GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                          use_cache=False, attn_implementation="eager"))
    after = fuse(captured(eager_gpt2))
    fwd, _ = counts(after, "block")
    assert fwd.get("softmax") == 1, fusion_report(after)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))


class _Plain(nn.Module):
    """Linear layers and single relus: no pattern, no chain of two elementwise ops."""

    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 4)
        self.layers = nn.ModuleList([_Layer() for _ in range(2)])

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h).sum()


def test_nothing_to_fuse_leaves_graphs_unchanged():
    before = capture(_Plain(), (torch.randn(4, 8),), {}, device=torch.device("cpu"), compute_dtype=torch.float32)
    after = fuse(before)
    for old, new in zip(before.templates, after.templates):
        assert new.forward.gm.code == old.forward.gm.code
        assert new.backward.gm.code == old.backward.gm.code
        assert new.saved == old.saved and new.fwd_memory == old.fwd_memory and new.bwd_memory == old.bwd_memory
    assert "no fused kernels" in fusion_report(after) and "<-" not in fusion_report(after)


def test_report_names_kernels_and_the_nodes_they_cover():
    report = fusion_report(fuse(captured("llama")))
    assert "block, shared by 2 stages:" in report
    line = next(x for x in report.splitlines() if "forward" in x and " rms_norm " in x)
    assert line.split("<-")[1].split(", ")[0].strip() == "pow_1"
    assert "fused_linear_cross_entropy" in report and "nll_loss_forward" in report


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_the_selective_variant_is_fused_too(kind):
    after = fuse(captured(kind))
    block = next(t for t in after.templates if t.kind == "block")
    variant = block.selective
    assert variant is not None and variant.full is block
    kernels = {n.meta["kernel"] for gm in (variant.forward.gm, variant.backward.gm) for n in gm.graph.nodes
               if "kernel" in n.meta}
    assert kernels, "the selective variant runs unfused graphs"
    assert not {n.target for n in variant.forward.gm.graph.nodes} & GONE[kind]
    # the forward ops its backward redoes are covered too (test_recompute_path.py counts them)
    left = {n.target for n in variant.backward.gm.graph.nodes} & GONE[kind]
    assert not left, f"the variant's backward still runs {left}"
    assert variant.saved_bytes < block.saved_bytes
