"""The bf16 generation copy (posttrain/hf_generator.py): built from the policy's config, filled from
the engine's masters, sampled by transformers' generate. In fp32 its completions equal
EngineGenerator's, greedy and sampled with the same seed; after a step and sync() they follow the
new weights."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from megacompile import AdamW, compile
from megacompile.errors import ArgumentError
from megacompile.models.llama import LlamaConfig as OwnConfig, TinyLlama
from megacompile.posttrain import GRPOLoss, GRPOObjective
from megacompile.posttrain.hf_generator import HFGenerator
from megacompile.posttrain.rollout import EngineGenerator
from megacompile.posttrain.rollout_batch import rollout_batch

V, EOS = 32, 3
PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def _engine(tied=False):
    torch.manual_seed(0)
    # a wide initialisation: completions that depend on the weights, not a repeat of the last token
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          initializer_range=0.3, tie_word_embeddings=tied, use_cache=False))
    return compile(GRPOObjective(policy, GRPOLoss()), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32,
                   optimizer=AdamW(lr=3e-2, weight_decay=0.0))


def _policy_masters(engine):
    return {k[len("policy."):]: v for k, v in engine.state_dict().items() if k.startswith("policy.")}


def test_fp32_copy_generates_what_the_engine_generates_and_follows_each_step():
    engine = _engine()
    ours = EngineGenerator(engine, eos_id=EOS, seed=1)
    copy = HFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    greedy = ours.generate(PROMPTS, 2, 6, temperature=0)
    assert copy.generate(PROMPTS, 2, 6, temperature=0) == greedy
    assert len({c.tokens for c in greedy}) > 1 and any(len(set(c.tokens)) > 2 for c in greedy)
    sampled = ours.generate(PROMPTS, 3, 6, temperature=1.0)
    assert copy.generate(PROMPTS, 3, 6, temperature=1.0) == sampled      # the same draws from the same seed
    assert len({c.tokens for c in sampled}) > 3

    for _ in range(2):     # a step on the sampled completions moves the masters; the copy follows on sync()
        batch = rollout_batch(sampled, torch.arange(9.0), 3, width=4 + 6)
        engine.step(**batch, old_logps=torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"])))
    stale = copy.generate(PROMPTS, 2, 6, temperature=0)
    after = ours.generate(PROMPTS, 2, 6, temperature=0)
    assert stale != after
    copy.sync()
    assert copy.generate(PROMPTS, 2, 6, temperature=0) == after
    masters = _policy_masters(engine)
    for name, p in copy.model.state_dict().items():
        assert torch.equal(p, masters[name]), name
    engine.close()


def test_bf16_copy_holds_each_master_cast_with_ties_kept():
    engine = _engine(tied=True)
    copy = HFGenerator(engine, eos_id=EOS)
    model = copy.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    masters = _policy_masters(engine)
    params = dict(model.named_parameters())
    assert set(params) == set(masters) - {"lm_head.weight"}
    for name, p in params.items():
        assert p.dtype == torch.bfloat16 and torch.equal(p, masters[name].to(torch.bfloat16)), name
    state = copy.state()
    first = copy.generate(PROMPTS, 4, 5, temperature=1.0)
    assert all(c.tokens[-1] == EOS or len(c.tokens) == 5 for c in first)
    assert all(EOS not in c.tokens[:-1] for c in first)
    copy.set_state(state)
    assert copy.generate(PROMPTS, 4, 5, temperature=1.0) == first
    with pytest.raises(ArgumentError, match="temperature"):
        copy.generate(PROMPTS, 1, 4, temperature=-1.0)
    engine.close()


def test_a_model_without_a_hugging_face_config_is_refused():
    torch.manual_seed(0)
    policy = TinyLlama(OwnConfig(vocab=V, dim=32, layers=1, heads=4, kv_heads=2, ffn=64))
    engine = compile(GRPOObjective(policy, GRPOLoss()), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32)
    with pytest.raises(ArgumentError, match="EngineGenerator"):
        HFGenerator(engine)
    with pytest.raises(ArgumentError, match="dtype"):
        HFGenerator(_engine(), dtype=torch.int8)
    engine.close()


def _lora_engine(**lora):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3,
                                          use_cache=False))
    # no adapter dropout: the engine's own forward would mask at random, the merged copy does not
    adapted = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                target_modules=["q_proj", "v_proj", "down_proj"], **lora))
    return compile(GRPOObjective(adapted, GRPOLoss()), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32,
                   optimizer=AdamW(lr=5e-2, weight_decay=0.0))


@pytest.mark.parametrize("kind", ["lora", "dora", "rslora"])
def test_a_lora_policys_copy_holds_its_weights_merged_and_generates_what_the_engine_generates(kind):
    """Plain LoRA; DoRA (its magnitudes scale each merged row, as PEFT's merge does); rank-stabilised
    LoRA (B A scaled by alpha / sqrt(r))."""
    dora, rslora = kind == "dora", kind == "rslora"
    engine = _lora_engine(use_dora=dora, use_rslora=rslora)
    ours = EngineGenerator(engine, eos_id=EOS, seed=1)
    copy = HFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    assert not any("lora_" in n or "base_layer" in n for n, _ in copy.model.named_parameters())
    for _ in range(2):      # B starts at zero: steps make the adapters count
        sampled = ours.generate(PROMPTS, 3, 6, temperature=1.0)
        batch = rollout_batch(sampled, torch.arange(9.0), 3, width=4 + 6)
        engine.step(**batch, old_logps=torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"])))
    copy.sync()
    # the merge, W + s B A (s = alpha / r = 2, or alpha / sqrt(r) = 4), by hand from the engine's own
    # tensors; DoRA's rows scaled to m
    state = engine.state_dict()
    pre = "policy.base_model.model.model.layers.0.self_attn.q_proj."
    b, a = state[pre + "lora_B.default.weight"], state[pre + "lora_A.default.weight"]
    assert b.abs().sum() > 0
    merged = state[pre + "base_layer.weight"] + (4.0 if rslora else 2.0) * (b @ a)
    if dora:
        magnitude = state[pre + "lora_magnitude_vector.default.weight"]
        assert not torch.allclose(magnitude, merged.norm(dim=1))      # trained away from the norm it started at
        merged = merged * (magnitude / merged.norm(dim=1)).unsqueeze(1)
    torch.testing.assert_close(copy.model.model.layers[0].self_attn.q_proj.weight, merged, rtol=0, atol=1e-6)
    assert copy.generate(PROMPTS, 2, 6, temperature=0) == ours.generate(PROMPTS, 2, 6, temperature=0)
    fresh = EngineGenerator(engine, eos_id=EOS, seed=5)
    copy.set_state(fresh.state())                   # the same draws from the same sampler state
    assert copy.generate(PROMPTS, 3, 6, temperature=1.0) == fresh.generate(PROMPTS, 3, 6, temperature=1.0)
    engine.close()


def test_a_peft_layer_other_than_one_lora_adapter_or_on_a_tied_weight_is_refused():
    from peft import LoraConfig, get_peft_model
    engine = _lora_engine()
    engine.model.policy.add_adapter("second", LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj"]))
    engine.model.policy.base_model.set_adapter(["default", "second"])
    with pytest.raises(ArgumentError, match="other than one LoRA adapter"):
        HFGenerator(engine)
    engine.close()
    policy = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                          use_cache=False))
    adapted = get_peft_model(policy, LoraConfig(r=2, lora_dropout=0.0, target_modules=["q_proj", "lm_head"]))
    engine = compile(GRPOObjective(adapted, GRPOLoss()), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32)
    with pytest.raises(ArgumentError, match="lm_head carries a LoRA adapter on a weight tied to another"):
        HFGenerator(engine)
    engine.close()


def test_a_completion_stops_at_any_of_several_stop_ids_in_both_generators():
    """eos_id as a generation config's eos_token_id, a list (Gemma's <eos> and <end_of_turn>): each
    completion ends at the first of them it samples, the same in the engine and the copy."""
    from megacompile.posttrain.rollout_batch import truncated
    from megacompile.posttrain.vllm_generator import completion_tokens, sampling
    engine = _engine()
    free = EngineGenerator(engine, eos_id=None, seed=1).generate(PROMPTS, 1, 8, temperature=0)
    stop = free[0].tokens[2]                    # the third token of the first prompt's completion
    never = next(t for t in range(V) if all(t not in c.tokens for c in free))
    stops = (never, stop)
    want = [c.tokens[:c.tokens.index(stop) + 1] if stop in c.tokens else c.tokens for c in free]
    ours = EngineGenerator(engine, eos_id=stops, seed=1).generate(PROMPTS, 1, 8, temperature=0)
    assert [c.tokens for c in ours] == want and len(want[0]) == 3
    assert [c.tokens for c in HFGenerator(engine, eos_id=stops, dtype=torch.float32).generate(
        PROMPTS, 1, 8, temperature=0)] == want
    assert truncated(ours, stops, None) == [stop not in c for c in want]
    assert completion_tokens([4, 5], stop, stops) == (4, 5, stop) and completion_tokens([4, 5], 9, stops) == (4, 5)
    assert sampling(1, 8, 1.0, 0, stops)["stop_token_ids"] == sorted(stops)
    engine.close()
