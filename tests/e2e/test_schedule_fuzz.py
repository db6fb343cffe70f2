"""Schedule fuzz: 200 random small models x budgets from the reported minimum to twice the weights
(the first 6 seeds in the slow tier, all of them with `-m long`).

Each seed draws a model (Hugging Face Llama, Qwen2 or GPT-2, nanoGPT, or megacompile's own
TinyLlama; 1-3 layers, hidden 16-64, heads and KV heads, tied or untied embeddings), an odd
sequence length, a batch of 1-3 and a budget. Where the budget is below what the model needs,
the planner must say so (BudgetTooSmallError naming a minimum above the budget) and a budget
between that minimum and twice the weights is drawn instead. Then: the plan verifies, two
steps run with the measured device peak equal to the predicted one and within the budget, and
the losses agree with eager torch.optim.AdamW to 1e-5.
"""
from __future__ import annotations

import random

import pytest
import torch

import megacompile
from megacompile.ir.verify import verify
from megacompile.models import LlamaConfig, TinyLlama
from tests import models
from tests.e2e.harness import BETAS, EPS, LR, WD, clone, eager_losses, make_inputs, weight_bytes

GiB = 2 ** 30
SEEDS = 200
CI_SEEDS = 6        # in the slow tier (about 5 s a seed on two cores); the other seeds with -m long
STEPS = 2


def draw_model(rng: random.Random) -> tuple[str, torch.nn.Module, int, str]:
    """(harness kind, model, vocabulary, description) for one seed."""
    family = rng.choice(["llama", "qwen2", "gpt2", "nanogpt", "tinyllama"])
    layers, vocab = rng.randint(1, 3), rng.randint(32, 128)
    heads = rng.choice([1, 2, 4])
    # rotary embeddings need an even head size; hidden lands in 16..64
    head_dim = rng.choice([d for d in range(4, 65, 2) if 16 <= heads * d <= 64])
    hidden = heads * head_dim
    kv = rng.choice([k for k in (1, 2, 4) if heads % k == 0])
    ffn = rng.randint(16, 128)
    tied = rng.random() < 0.5
    desc = f"{family} layers={layers} hidden={hidden} heads={heads} kv={kv} ffn={ffn} vocab={vocab} tied={tied}"
    if family in ("llama", "qwen2"):
        from transformers import LlamaConfig as HFLlama, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
        config, cls = (HFLlama, LlamaForCausalLM) if family == "llama" else (Qwen2Config, Qwen2ForCausalLM)
        model = cls(config(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                           tie_word_embeddings=tied, use_cache=False))
        return "hf", model, vocab, desc
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads,
                                           n_inner=ffn, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                           attn_pdrop=0.0, use_cache=False, tie_word_embeddings=tied))
        return "hf", model, vocab, desc
    if family == "nanogpt":
        return "nanogpt", models.NanoGPT(vocab=vocab, d=hidden, layers=layers, heads=heads, block=32), vocab, desc
    return "hf", TinyLlama(LlamaConfig(vocab=vocab, dim=hidden, layers=layers, heads=heads, kv_heads=kv,
                                       ffn=ffn)), vocab, desc


def draw_budget(rng: random.Random, low: int, high: int) -> int:
    """Bytes in [low, high]: exactly `low` one time in four, else log-uniform."""
    if rng.random() < 0.25 or high <= low:
        return low
    return int(low * (high / low) ** rng.random())


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow if s < CI_SEEDS else pytest.mark.long)
                                  for s in range(SEEDS)])
def test_random_config_under_random_budget(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    kind, model, vocab, desc = draw_model(rng)
    batch, seq = rng.randint(1, 3), rng.randrange(3, 32, 2)
    batches = [models.batch(vocab, b=batch, t=seq, seed=seed * 10 + i) for i in range(STEPS)]
    weights = weight_bytes(model)
    # One seed in four starts far below the weights, where most models do not fit; the rest start
    # where most do (each refusal costs a second trace).
    low = weights // 50 if rng.random() < 0.25 else weights // 4
    budget = draw_budget(rng, max(1, low), 2 * weights)

    optimizer = megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch")
    engine = megacompile.compile(clone(model), budget / GiB, device="cpu", optimizer=optimizer)
    try:
        minimum = engine.prepare(**make_inputs(kind, batches[0])).minimum_budget_bytes
        assert minimum <= budget, f"{desc}: planned at {budget} B though its minimum is {minimum} B"
    except megacompile.BudgetTooSmallError as e:
        minimum = e.minimum_bytes
        assert minimum > budget, f"{desc}: refused {budget} B, yet names a minimum of {minimum} B"
        budget = draw_budget(rng, minimum, max(minimum, 2 * weights))
        refused, engine = engine, megacompile.compile(clone(model), budget / GiB, device="cpu", optimizer=optimizer)
        # The trace does not depend on the budget: the second engine starts from the first one's
        # (a trace is most of a seed's time).
        engine._captured.update(refused._captured)
        refused.close()

    losses, peaks = [], []
    for ids in batches:
        losses.append(engine.step(**make_inputs(kind, ids)))
        peaks.append(engine.memory_stats()["device_peak_bytes"])
    plan = engine.plan
    verify(plan.program, budget_bytes=engine.budget_bytes)
    assert plan.minimum_budget_bytes >= minimum, f"{desc}: a plan fits below the minimum named"
    if plan.minimum_budget_bytes != minimum:
        # A refusal names the lowest smallest budget over the sequence-chunk counts; a plan names
        # that of its own blocks (whole, or in its chunks). Then the named minimum must plan, chunked.
        at_minimum = megacompile.compile(clone(model), minimum / GiB, device="cpu", optimizer=optimizer)
        at_minimum._captured.update(engine._captured)
        chunked = at_minimum.prepare(**make_inputs(kind, batches[0]))
        at_minimum.close()
        assert max(t.chunks for t in chunked.captured.block_templates) > 1, f"{desc}: the minimum moved"
        verify(chunked.program, budget_bytes=at_minimum.budget_bytes)
    predicted = plan.predicted_peak_bytes
    for peak in peaks:
        assert peak == predicted, f"{desc}: measured peak {peak} B, predicted {predicted} B"
        assert peak <= engine.budget_bytes, f"{desc}: peak {peak} B over the budget {engine.budget_bytes} B"
    expected = eager_losses(clone(model), batches, kind)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=0, msg=desc)
    engine.close()
