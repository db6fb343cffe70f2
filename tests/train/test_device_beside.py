"""On a GPU the run's hbm_budget holds what stage grpo keeps there beside the engine's plans (a
generator's copy and its key-value cache, colocated vLLM's share, a reward model's copy): each is
sized from the model's config, counted here by hand, and taken out of the budget before planning;
too little left is refused, naming the parts. The GPU is a stand-in (its properties alone are read)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForSequenceClassification

from megacompile.errors import BudgetTooSmallError
from megacompile.train import device_beside

GiB = 2 ** 30
LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 3, 64, 4, 2, 128, 300


def _meta():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=FFN,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _run(**keys):
    base = dict(use_vllm=False, vllm_mode="colocate", generator="engine", generator_dtype="bfloat16", batch=4,
                steps_per_generation=2, seq=24, vllm_gpu_memory_utilization=0.3)
    return SimpleNamespace(**{**base, **keys})


# Llama's parameters, written out: per layer q, k, v, o, gate, up, down and two norms
HEAD = HIDDEN // HEADS
LAYER = HIDDEN * HIDDEN * 2 + HIDDEN * KV_HEADS * HEAD * 2 + 3 * HIDDEN * FFN + 2 * HIDDEN
PARAMS = 2 * VOCAB * HIDDEN + LAYERS * LAYER + HIDDEN
ROTARY = 2 * (HEAD // 2)     # the rotary inv_freq and original_inv_freq buffers: float32 in any copy


def test_generator_hf_holds_its_copy_and_the_rollouts_cache():
    beside = device_beside.generator_copy(_run(generator="hf"), _meta(), 80 * GiB)
    copy, cache = beside
    assert copy.nbytes == 2 * PARAMS + 4 * ROTARY and "generator hf's bfloat16 copy" in copy.what
    # keys and values of every layer, kv heads x head size each, 2 bytes, for 4 x 2 rows of 24 tokens
    assert cache.nbytes == 8 * 24 * 2 * LAYERS * KV_HEADS * HEAD * 2 and "8 rows x 24 tokens" in cache.what
    wide = device_beside.generator_copy(_run(generator="hf", generator_dtype="float32"), _meta(), 80 * GiB)
    assert [b.nbytes for b in wide] == [4 * (PARAMS + ROTARY), 2 * cache.nbytes]


def test_generator_hf_streamed_holds_its_resident_parts_and_two_layers():
    copy, cache = device_beside.generator_copy(_run(generator="hf_streamed"), _meta(), 80 * GiB)
    assert copy.nbytes == 2 * (PARAMS - LAYERS * LAYER + 2 * LAYER) + 4 * ROTARY
    assert cache.nbytes == 8 * 24 * 2 * LAYERS * KV_HEADS * HEAD * 2


def test_colocated_vllm_holds_its_share_of_the_card_and_the_engine_generator_nothing():
    (vllm,) = device_beside.generator_copy(_run(use_vllm=True, vllm_gpu_memory_utilization=0.25), _meta(), 80 * GiB)
    assert vllm.nbytes == 20 * GiB
    assert device_beside.generator_copy(_run(), _meta(), 80 * GiB) == []
    assert device_beside.generator_copy(_run(use_vllm=True, vllm_mode="server"), _meta(), 80 * GiB) == []


def test_a_reward_models_copy_is_its_parameters_in_bfloat16(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=FFN,
                                      num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path / "rm")
    held = device_beside.reward_model(str(tmp_path / "rm"))
    copy = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.bfloat16)   # as it is read
    real = sum(t.numel() * t.element_size() for t in list(copy.parameters()) + list(copy.buffers()))
    assert held.nbytes == real and "in bfloat16" in held.what


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))


def test_the_engine_plans_in_what_the_parts_leave_of_the_run_budget(gpu, capsys):
    asked = []

    def beside_of(meta, card):
        asked.append(card)
        return [device_beside.Beside("a copy", 6 * GiB), device_beside.Beside("its cache", 2 * GiB)]
    left, beside = device_beside.for_engine("cuda", 72.0, _meta(), beside_of)
    assert left == 64.0 and asked == [80 * GiB] and len(beside) == 2
    assert "device budget  72.00 GiB: 64.00 GiB for the engine's plans, 8.00 GiB beside them (a copy: 6.00 GiB; " \
           "its cache: 2.00 GiB)" in capsys.readouterr().out
    # the cpu backend's copies live in host memory: the simulated device is the engine's alone
    assert device_beside.for_engine("cpu", 1.0, _meta(), beside_of) == (1.0, []) and len(asked) == 1
    assert device_beside.for_engine("cuda", 72.0, _meta(), lambda meta, card: []) == (72.0, [])


def test_parts_that_leave_nothing_or_too_little_are_refused_naming_them(gpu):
    with pytest.raises(BudgetTooSmallError, match="leaves nothing for the engine's plans beside 30.00 GiB"):
        device_beside.for_engine("cuda", 24.0, _meta(), lambda meta, card: [device_beside.Beside("vLLM", 30 * GiB)])
    beside = [device_beside.Beside("generator hf's copy", 3 * GiB)]
    error = device_beside.too_small(BudgetTooSmallError("the budget is too small", 5 * GiB), beside)
    assert error.minimum_bytes == 8 * GiB
    assert "holds 3.00 GiB on the GPU beside the engine's plans (generator hf's copy), and the plans' smallest " \
           "needs 5.00 GiB: give hbm_budget >= 8.00" in str(error)
    assert str(error).endswith("The planner: the budget is too small")


@pytest.mark.parametrize("kind", ["hf", "hf_streamed"])
def test_the_generators_copy_is_what_it_holds(kind):
    # The figure against the copy the generator really makes (here in host memory: the cpu backend).
    import megacompile
    from megacompile.posttrain import HFGenerator, StreamedHFGenerator, decoder_layers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(_meta().config)
    engine = megacompile.compile(model, 1.0, device="cpu")
    generator = (HFGenerator if kind == "hf" else StreamedHFGenerator)(engine, dtype=torch.bfloat16)
    made = generator.model
    held = sum(t.numel() * t.element_size() for t in list(made.parameters()) + list(made.buffers()))
    if kind == "hf_streamed":      # two decoder layers at a time on the device, the rest resident
        layer = sum(p.numel() * p.element_size() for p in decoder_layers(made)[0].parameters())
        held += (2 - LAYERS) * layer
    (copy, _) = device_beside.generator_copy(_run(generator=kind), _meta(), 80 * GiB)
    assert copy.nbytes == held
    engine.close()
