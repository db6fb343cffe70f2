"""The run's budgets hold what stage grpo keeps beside the engine: on a GPU beside its plans (a
generator's copy and its key-value cache, colocated vLLM's share, a reward model's copy), in host
memory beside its state (the streamed copy's layers; on the cpu backend every copy). Each is sized
from the model's config, counted here by hand and against the copies the generators make, and taken
out of the budget first; too little left is refused, naming the parts. The GPU is a stand-in (its
properties alone are read)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoModelForSequenceClassification

from megacompile.cost import generate_transient_bytes
from megacompile.errors import BudgetTooSmallError, HostMemoryError
from megacompile.ir import fmt_bytes
from megacompile.train import beside

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
                steps_per_generation=2, seq=24, max_prompt_length=None, vllm_gpu_memory_utilization=0.3)
    return SimpleNamespace(**{**base, **keys})


# Llama's parameters, written out: per layer q, k, v, o, gate, up, down and two norms
HEAD = HIDDEN // HEADS
LAYER = HIDDEN * HIDDEN * 2 + HIDDEN * KV_HEADS * HEAD * 2 + 3 * HIDDEN * FFN + 2 * HIDDEN
PARAMS = 2 * VOCAB * HIDDEN + LAYERS * LAYER + HIDDEN
ROTARY = 2 * (HEAD // 2)     # the rotary inv_freq and original_inv_freq buffers: float32 in any copy


def test_generator_hf_holds_its_copy_the_rollouts_cache_and_what_generate_passes():
    parts = beside.generator_copy(_run(generator="hf"), _meta(), 80 * GiB)
    copy, cache, passing = parts
    assert copy.nbytes == 2 * PARAMS + 4 * ROTARY and "generator hf's bfloat16 copy" in copy.what
    # keys and values of every layer, kv heads x head size each, 2 bytes, for 4 x 2 rows of 24 tokens
    assert cache.nbytes == 8 * 24 * 2 * LAYERS * KV_HEADS * HEAD * 2 and "8 rows x 24 tokens" in cache.what
    wide = beside.generator_copy(_run(generator="hf", generator_dtype="float32"), _meta(), 80 * GiB)
    # the prefill of 8 rows x 24 prompt tokens (no max_prompt_length: the row's width; one chunk), per
    # token the MLP's gate, up and product, eight hidden-size tensors and a mask element per key, in
    # bf16; above a sampling step's 8 rows x VOCAB x (2 + 48)
    assert passing.nbytes == 8 * 24 * 2 * (3 * FFN + 8 * HIDDEN + 24) > 8 * VOCAB * 50
    assert "a prefill of 8 x 24 tokens" in passing.what
    (_, _, short) = beside.generator_copy(_run(generator="hf", max_prompt_length=4), _meta(), 80 * GiB)
    assert short.nbytes == 8 * VOCAB * 50 > 8 * 4 * 2 * (3 * FFN + 8 * HIDDEN + 4)      # sampling's, then
    assert [b.nbytes for b in wide] == [4 * (PARAMS + ROTARY), 2 * cache.nbytes,
                                        8 * 24 * 4 * (3 * FFN + 8 * HIDDEN + 24)]


def test_generator_hf_streamed_holds_its_resident_parts_and_two_layers():
    copy, cache, passing = beside.generator_copy(_run(generator="hf_streamed"), _meta(), 80 * GiB)
    assert copy.nbytes == 2 * (PARAMS - LAYERS * LAYER + 2 * LAYER) + 4 * ROTARY
    assert cache.nbytes == 8 * 24 * 2 * LAYERS * KV_HEADS * HEAD * 2
    assert passing == beside.generator_copy(_run(generator="hf"), _meta(), 80 * GiB)[2]


def test_colocated_vllm_holds_its_share_of_the_card_and_the_engine_generator_nothing():
    (vllm,) = beside.generator_copy(_run(use_vllm=True, vllm_gpu_memory_utilization=0.25), _meta(), 80 * GiB)
    assert vllm.nbytes == 20 * GiB
    assert beside.generator_copy(_run(), _meta(), 80 * GiB) == []
    assert beside.generator_copy(_run(use_vllm=True, vllm_mode="server"), _meta(), 80 * GiB) == []


def test_a_reward_models_copy_is_its_parameters_in_bfloat16(tmp_path):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, intermediate_size=FFN,
                                      num_labels=1, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path / "rm")
    (held,) = beside.reward_model(str(tmp_path / "rm"))
    copy = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", dtype=torch.bfloat16)   # as it is read
    real = sum(t.numel() * t.element_size() for t in list(copy.parameters()) + list(copy.buffers()))
    assert held.nbytes == real and "in bfloat16" in held.what
    # scoring 16 completions of 24 tokens at a time: per token the MLP's three, eight hidden-size
    # tensors and a mask element per key, in bf16 (cost/generation_memory.py)
    (same, passing) = beside.reward_model(str(tmp_path / "rm"), rows=16, tokens=24)
    assert same == held and passing.nbytes == 16 * 24 * 2 * (3 * FFN + 8 * HIDDEN + 24)
    assert "16 completions of 24 tokens" in passing.what


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GiB))


def test_the_engine_plans_in_what_the_parts_leave_of_the_run_budget(gpu, capsys):
    asked = []

    def beside_of(meta, card):
        asked.append(card)
        return [beside.Beside("a copy", 6 * GiB), beside.Beside("its cache", 2 * GiB)]
    left, parts = beside.for_engine("cuda", 72.0, _meta(), beside_of)
    assert left == 64.0 and asked == [80 * GiB] and len(parts) == 2
    assert "device budget  72.00 GiB: 64.00 GiB for the engine's plans, 8.00 GiB beside them (a copy: 6.00 GiB; " \
           "its cache: 2.00 GiB)" in capsys.readouterr().out
    # the cpu backend's copies live in host memory: the simulated device is the engine's alone
    assert beside.for_engine("cpu", 1.0, _meta(), beside_of) == (1.0, []) and len(asked) == 1
    assert beside.for_engine("cuda", 72.0, _meta(), lambda meta, card: []) == (72.0, [])
    assert beside.for_engine("cuda:1", 72.0, _meta(), beside_of)[0] == 64.0         # any GPU of the machine


def test_parts_that_leave_nothing_or_too_little_are_refused_naming_them(gpu):
    with pytest.raises(BudgetTooSmallError, match="leaves nothing for the engine's plans beside 30.00 GiB"):
        beside.for_engine("cuda", 24.0, _meta(), lambda meta, card: [beside.Beside("vLLM", 30 * GiB)])
    parts = [beside.Beside("generator hf's copy", 3 * GiB)]
    error = beside.too_small(BudgetTooSmallError("the budget is too small", 5 * GiB), parts)
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
    (copy, _, _) = beside.generator_copy(_run(generator=kind), _meta(), 80 * GiB)
    assert copy.nbytes == held
    engine.close()


def test_the_generator_in_host_memory_is_its_copy_and_cache_on_the_cpu_and_the_streamed_layers_on_a_gpu():
    meta = _meta()
    copy, cache, passing = beside.generator_host(_run(generator="hf"), meta, "cpu")
    assert copy.nbytes == 2 * PARAMS + 4 * ROTARY and cache.nbytes == 8 * 24 * 2 * LAYERS * KV_HEADS * HEAD * 2
    assert passing == beside.generator_copy(_run(generator="hf"), meta, 80 * GiB)[2]
    assert [b.nbytes for b in beside.generator_host(_run(generator="hf_streamed"), meta, "cpu")] == \
        [copy.nbytes, cache.nbytes, passing.nbytes]         # the simulated device is host memory: all of it
    assert beside.generator_host(_run(generator="hf"), meta, "cuda") == []
    (layers,) = beside.generator_host(_run(generator="hf_streamed"), meta, "cuda")
    assert layers.nbytes == 2 * LAYERS * LAYER and "pinned" in layers.what
    assert beside.generator_host(_run(), meta, "cpu") == [] == beside.generator_host(_run(use_vllm=True), meta, "cpu")


def test_the_engines_host_state_is_placed_in_what_the_parts_leave(capsys):
    assert beside.host_for_engine(10.0, []) == 10.0 and capsys.readouterr().out == ""
    held = [beside.Beside("a copy", 3 * GiB), beside.Beside("its cache", GiB)]
    assert beside.host_for_engine(10.0, held) == 6.0
    assert "host budget    10.00 GiB: 6.00 GiB for the engine's state, 4.00 GiB beside it (a copy: 3.00 GiB; its " \
           "cache: 1.00 GiB)" in capsys.readouterr().out
    with pytest.raises(HostMemoryError, match="leaves nothing for the engine's state beside 4.00 GiB"):
        beside.host_for_engine(3.5, held)
    error = beside.host_short(HostMemoryError("too little", {"smallest_host_budget_bytes": 5 * GiB}), held)
    assert "holds 4.00 GiB in host memory beside the engine's state (a copy; its cache): give host_budget >= 9.00" \
        in str(error)
    assert error.facts["smallest_host_budget_bytes"] == 9 * GiB and error.facts["beside_bytes"] == 4 * GiB


def test_a_cpu_run_with_generator_hf_places_the_engines_state_beside_the_copy(tmp_path, monkeypatch, capsys):
    from megacompile.train import load, loop, run
    from tests.posttrain import stage_files
    from tests.train import files
    work = stage_files.workspace(tmp_path)
    made = []
    build = loop.build

    def keep(*args, **kwargs):
        setup = build(*args, **kwargs)
        made.append(setup)
        return setup
    monkeypatch.setattr(loop, "build", keep)
    run(load(files.run_yaml(str(tmp_path / "hf.yaml"), **stage_files.grpo(work, str(tmp_path / "hf"), generator="hf",
                                                                           generator_dtype="float32", host_budget=2)),
             []))
    (setup,) = made
    said = capsys.readouterr().out
    line = next(x for x in said.splitlines() if x.startswith("  host budget    2.00 GiB: "))
    generator = setup.engine.model.policy      # the copy's architecture: the policy's
    copy = sum(t.numel() * t.element_size() for t in list(generator.parameters()) + list(generator.buffers()))
    config = generator.config
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads) * 4
    cache = 8 * (8 + 3) * per_token          # 2 prompts x 4 completions of 8 + 3 tokens, in float32
    passing = generate_transient_bytes(config, 8, 8, 4)     # the prefill of their prompts, a sampling step
    assert abs(setup.engine.host_budget_bytes - (2 * GiB - copy - cache - passing)) <= 1, line
    assert f"generator hf's float32 copy of the policy: {fmt_bytes(copy)}" in line
