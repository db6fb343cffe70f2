"""The N of 6ND: the parameters whose matmuls a token runs. An input or position embedding is a
lookup and stays out; a head tied to the embedding runs a matmul and counts, once; a routed
experts layer counts top_k of its experts. Memory and transfers still count every parameter."""
from __future__ import annotations

import torch
import transformers

import megacompile
from megacompile.bench.workload import Workload

H, I, LAYERS, VOCAB, BATCH, SEQ = 64, 128, 2, 256, 2, 64


def _plan(model):
    return megacompile.plan(model, hbm_budget=1.0, batch=BATCH, seq=SEQ, hardware="h100")


def _llama(tied: bool):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                      max_position_embeddings=128, tie_word_embeddings=tied)
    return transformers.AutoModelForCausalLM.from_config(config)


def _all(model) -> int:
    return sum(p.numel() for p in model.parameters())      # a tied weight once


def _without_lookups(model, *lookups: torch.Tensor) -> int:
    """Every parameter but the tables that only embedding lookups read (the head's weight stays)."""
    head = model.get_output_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is head or all(p is not t for t in lookups))


def test_an_untied_input_embedding_is_left_out_and_the_head_counts():
    model = _llama(tied=False)
    plan = _plan(model)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is not head
    n = _without_lookups(model, embed)
    assert n == _all(model) - embed.numel()
    assert plan.captured.flop_params == n
    assert plan.prediction.model_flops == 6 * n * BATCH * SEQ
    assert plan.captured.active_params == _all(model)         # a dense model: every parameter a token uses
    state = plan.captured.state.values()
    assert sum(e.numel for e in state if e.trainable) == _all(model)      # host state holds every one


def test_a_forward_only_plan_counts_2nd_with_the_same_n():
    model = _llama(tied=False)
    plan = megacompile.plan(model, hbm_budget=1.0, batch=BATCH, seq=SEQ, hardware="h100", train=False)
    n = _all(model) - model.get_input_embeddings().weight.numel()
    assert plan.captured.flop_params == n
    assert plan.prediction.model_flops == 2 * n * BATCH * SEQ


def test_a_head_tied_to_the_embedding_counts_the_shared_weight_once():
    model = _llama(tied=True)
    plan = _plan(model)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert embed is head
    assert plan.captured.flop_params == _without_lookups(model, embed) == _all(model)
    assert plan.captured.flop_params == _all(_llama(tied=False)) - embed.numel()
    assert plan.prediction.model_flops == 6 * _all(model) * BATCH * SEQ


def test_learned_position_embeddings_are_lookups_too():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=H, n_layer=LAYERS, n_head=4, vocab_size=VOCAB, n_positions=128,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    positions = model.transformer.wpe.weight
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    plan = _plan(model)
    assert plan.captured.flop_params == _without_lookups(model, model.get_input_embeddings().weight, positions)
    assert plan.captured.flop_params == _all(model) - positions.numel()


def test_routed_experts_count_top_k_of_their_experts_and_the_embedding_none():
    torch.manual_seed(0)
    E, K = 4, 2
    config = transformers.Qwen2MoeConfig(hidden_size=H, intermediate_size=I, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=H, num_hidden_layers=LAYERS,
                                         num_attention_heads=4, num_key_value_heads=2, num_experts=E,
                                         num_experts_per_tok=K, vocab_size=VOCAB, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    assert routed > 0
    shared_and_dense = _without_lookups(model, embed) - routed
    plan = _plan(model)
    assert plan.captured.flop_params == shared_and_dense + routed * K // E
    assert plan.captured.active_params == shared_and_dense + embed.numel() + routed * K // E
    assert plan.prediction.model_flops == 6 * plan.captured.flop_params * BATCH * SEQ
    assert f"6ND counts the {plan.captured.flop_params:,} of them" in plan.summary()


def test_the_bench_counts_6nd_as_the_capture_does():
    workload = Workload(shape="tiny", device="cpu")
    model = workload.meta_model()
    assert workload.flop_parameters == sum(p.numel() for n, p in model.named_parameters() if n != "embed.weight")
    assert workload.flop_parameters == _plan(model).captured.flop_params


def test_frozen_weights_count_4nd_behind_the_first_trained_one_and_2nd_before_it():
    """A frozen weight runs its forward, and its input's gradient where something before it trains;
    counting only the trained ones made a LoRA plan's model FLOPs a sliver of the card's work."""
    model = _llama(tied=False)
    for p in model.parameters():
        p.requires_grad_(False)
    trained = model.model.layers[1]
    for p in trained.parameters():
        p.requires_grad_(True)
    plan = _plan(model)
    n_trained = sum(p.numel() for p in trained.parameters())
    before = sum(p.numel() for p in model.model.layers[0].parameters())
    behind = model.model.norm.weight.numel() + model.lm_head.weight.numel()
    assert plan.captured.flop_params == n_trained
    assert plan.prediction.model_flops == (6 * n_trained + 4 * behind + 2 * before) * BATCH * SEQ


def test_a_lora_plan_counts_its_frozen_base_so_hardware_flops_stay_near_model_flops():
    from megacompile.train.methods.lora import lora_for_plan
    model = lora_for_plan(_llama(tied=False), 4, "all", torch.float32)
    plan = _plan(model)
    assert plan.captured.flop_params < _all(model) / 10      # the adapters alone: a small share
    assert 0.9 < plan.prediction.hardware_flops_per_model_flop < 2.0


def test_a_lora_policys_decode_step_counts_the_matmuls_of_its_frozen_base(monkeypatch):
    """A kv_cache generator's decode step runs every weight's matmul, the frozen base's too."""
    import megacompile.planner.kv_generation as kv_generation
    from megacompile.train.methods.lora import lora_for_plan
    seen = []
    decode_step = kv_generation.decode_step
    monkeypatch.setattr(kv_generation, "decode_step",
                        lambda hw, **k: seen.append(k["flop_params"]) or decode_step(hw, **k))
    base = _llama(tied=False)
    n = _all(base) - base.get_input_embeddings().weight.numel()
    model = lora_for_plan(base, 4, "all", torch.float32)
    adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
    megacompile.plan_stage(model, 1.0, "grpo", hardware="h100", fuse=False, prompts=2, num_generations=2,
                           max_prompt_length=8, max_completion_length=8, generator="kv_cache")
    assert seen and all(f == n + adapters for f in seen)
