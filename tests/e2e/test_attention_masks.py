"""Parity on every mask path capture takes for Hugging Face decoders: no mask (SDPA with
is_causal), a sliding window and packed documents in the caller's position_ids (no mask either:
megacompile::window_attention with the window as a number and each token's document start) and a
padding mask (the caller's [B, S] attention_mask, read by every block as the keys it keeps)."""
from __future__ import annotations

import pytest
import torch

import megacompile
from tests import models
from tests.e2e.harness import BETAS, EPS, LR, WD, assert_same_weights, clone, float64_noise

STEPS, B, T = 3, 2, 24


def _train_both(model, batches: list[dict]):
    """Eager torch.optim.AdamW and megacompile at its smallest budget (every block recomputed),
    on the same batches."""
    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        losses = []
        for inputs in batches:
            opt.zero_grad(set_to_none=True)
            loss = m(**inputs).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    reference = clone(model)
    eager = train(reference)
    optimizer = megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch")
    probe = megacompile.compile(clone(model), hbm_budget=64, device="cpu", optimizer=optimizer)
    smallest = probe.prepare(**batches[0]).minimum_budget_bytes
    engine = megacompile.compile(clone(model), hbm_budget=smallest / 2 ** 30, device="cpu", optimizer=optimizer)
    ours = [engine.step(**inputs) for inputs in batches]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(_in_float64(train), model, reference))
    return engine


def _in_float64(train):
    """`train` for the float64 copy: routed experts through transformers' loop, as torch's grouped
    GEMM takes no float64 (tests/e2e/harness.py weight_noise does the same)."""
    def exact(m):
        if getattr(m.config, "_experts_implementation", None) == "grouped_mm":
            m.config._experts_implementation = "eager"
        return train(m)
    return exact


def _block(engine):
    """The block as captured, whichever variant the plan runs."""
    template = next(s.template for s in engine.plan.captured.stages if s.template.kind == "block")
    return template.full or template


def _square(template) -> list[tuple]:
    return [m.shape for m in template.saved if sum(d == T for d in m.shape) >= 2]


def _ids(seed: int) -> torch.Tensor:
    return models.batch(96, b=B, t=T, seed=seed)


@pytest.mark.slow   # test_parity trains these models without a mask too; this one also reads the graph
def test_llama_without_a_mask_trains_on_is_causal_attention_as_eager():
    torch.manual_seed(0)
    engine = _train_both(models.hf_llama(layers=4, d=128), [{"input_ids": _ids(i), "labels": _ids(i)} for i in range(STEPS)])
    block = _block(engine)
    attention = [n for n in block.forward.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert attention and all(n.args[4] for n in attention)   # is_causal; no mask among the inputs
    assert all(len(m.shape) < 4 for m in block.acts)


def test_a_sliding_window_trains_as_eager_with_no_mask_at_all():
    torch.manual_seed(0)
    engine = _train_both(_mistral(8), [{"input_ids": _ids(i), "labels": _ids(i)} for i in range(STEPS)])
    block = _block(engine)
    assert not [m.shape for m in block.acts if len(m.shape) == 4]     # no mask reaches the block ...
    assert not _square(block) and not _square(block.selective)       # ... nor does it save one
    ops = [str(n.target) for n in block.forward.gm.graph.nodes if n.op == "call_function"]
    assert "megacompile.window_attention.default" in ops and not any("scaled_dot_product" in op for op in ops)


@pytest.mark.parametrize("side", [pytest.param("right", marks=pytest.mark.slow), "left"])
def test_a_padding_mask_trains_as_eager_with_no_square_mask(side):
    """Left padding leaves the first queries of a row no key to see: o = 0 and no gradient there,
    as torch's SDPA gives them."""
    torch.manual_seed(0)
    batches = []
    for i in range(STEPS):
        ids = _ids(i)
        mask = torch.ones(B, T, dtype=torch.long)
        if side == "right":
            mask[1, T - 5 - i:] = 0                        # a different length each step
        else:
            mask[1, :5 + i] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    engine = _train_both(models.hf_llama(layers=4, d=128), batches)
    block = _block(engine)
    assert not [m.shape for m in block.acts if len(m.shape) == 4]
    assert not _square(block) and not _square(block.selective)


def test_a_model_loaded_with_eager_attention_trains_as_eager_with_no_square_mask():
    """attn_implementation="eager": transformers builds an additive [B, 1, S, S] mask and every layer
    holds [B, Hq, S, S] probabilities; captured, the layers run the operator, and on the cpu it
    computes as the model's eager function (scores, mask, float32 softmax), so the weights agree
    with eager's to the float64 noise floor as SDPA models' do."""
    torch.manual_seed(0)
    model = models.hf_llama(layers=4, d=128)
    model.config._attn_implementation = "eager"
    batches = []
    for i in range(STEPS):
        ids = _ids(i)
        mask = torch.ones(B, T, dtype=torch.long)
        mask[1, :3 + i] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    engine = _train_both(model, batches)
    block = _block(engine)
    nodes = [n for n in block.forward.gm.graph.nodes if n.op == "call_function"]
    attention = [n for n in nodes if "window_attention" in str(n.target)]
    assert attention and all(n.args[9] for n in attention)           # told the model ran eager
    assert not _square(block) and not [m.shape for m in block.acts if len(m.shape) == 4]


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def _mistral(window: int):
    from transformers import MistralConfig, MistralForCausalLM
    return MistralForCausalLM(MistralConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, sliding_window=window,
                                            max_position_embeddings=64, use_cache=False))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    return GptOssForCausalLM(GptOssConfig(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                                          max_position_embeddings=64, use_cache=False))


@pytest.mark.parametrize("layout", ["left padding", pytest.param("packed documents", marks=pytest.mark.slow)])
def test_gpt_oss_trains_as_its_eager_attention_with_sinks_and_no_square_mask(layout):
    """GPT-OSS runs eager attention (scores, an additive [B, 1, S, S] mask, the sinks as one more
    column, [B, Hq, S, S + 1] probabilities saved for the backward); captured, its sliding-window
    and full layers alike run megacompile::window_attention with the sinks, and train as eager does."""
    torch.manual_seed(0)
    batches = []
    for i in range(STEPS):
        ids = _ids(i)
        if layout == "left padding":
            mask = torch.ones(B, T, dtype=torch.long)
            mask[1, :5 + i] = 0
            batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
        else:
            rows = [[10, T - 10], [1, 7, T - 8]] if i % 2 else [[T], [3, 3, T - 6]]
            batches.append({"input_ids": ids, "position_ids": torch.stack([_positions(r) for r in rows]), "labels": ids})
    engine = _train_both(_gpt_oss(), batches)
    block = _block(engine)
    assert not [m.shape for m in block.acts if len(m.shape) == 4]
    assert not _square(block) and not _square(block.selective)
    nodes = [n for n in block.forward.gm.graph.nodes if n.op == "call_function"]
    assert "megacompile.window_attention.default" in [str(n.target) for n in nodes]
    made = [n.meta["val"] for n in nodes if isinstance(n.meta.get("val"), torch.Tensor)]
    assert not [t.shape for t in made if sum(d == T for d in t.shape) >= 2]     # nothing of S x S, saved or not


@pytest.mark.parametrize("model", ["llama", pytest.param("mistral window 6", marks=pytest.mark.slow)])
def test_packed_sequences_in_the_callers_position_ids_train_as_eager_with_no_mask(model):
    """Documents of other lengths in every row and step (one of a single token, one longer than
    the window): the blocks read each token's document start, not a mask."""
    torch.manual_seed(0)
    layouts = [[[10, T - 10], [1, 7, T - 8]], [[T], [3, 3, T - 6]], [[T - 1, 1], [12, 12]]]
    batches = [{"input_ids": _ids(i), "position_ids": torch.stack([_positions(row) for row in layouts[i]]),
                "labels": _ids(i)} for i in range(STEPS)]
    engine = _train_both(models.hf_llama(layers=4, d=128) if model == "llama" else _mistral(6), batches)
    block = _block(engine)
    assert not [m.shape for m in block.acts if len(m.shape) == 4]
    assert not _square(block) and not _square(block.selective)
    ops = [str(n.target) for n in block.forward.gm.graph.nodes if n.op == "call_function"]
    assert "megacompile.window_attention.default" in ops
