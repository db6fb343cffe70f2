"""Hugging Face decoder families at tiny sizes, random init (nothing is downloaded).

Each builder returns a causal LM taking input_ids and labels. Sizes are the smallest that still
exercise each family's own code path: 4 layers (so alternating patterns and a frozen half
exist), hidden 32, 4 heads, vocab 128.
"""
from __future__ import annotations

import torch

VOCAB = 128
LAYERS = 4
D = 32


def _hf(config_name: str, model_name: str, **kw):
    import transformers
    config = getattr(transformers, config_name)(**kw)
    config.use_cache = False
    return getattr(transformers, model_name)(config)


_AUX = dict(output_router_logits=True, router_aux_loss_coef=0.1)


def _common(**extra) -> dict:
    base = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=LAYERS,
                num_attention_heads=4, max_position_embeddings=64)
    base.update(extra)
    return base


FAMILIES = {
    "llama": lambda: _hf("LlamaConfig", "LlamaForCausalLM", **_common(num_key_value_heads=2)),
    "qwen2": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **_common(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen3": lambda: _hf("Qwen3Config", "Qwen3ForCausalLM", **_common(num_key_value_heads=2, head_dim=8)),
    "mistral": lambda: _hf("MistralConfig", "MistralForCausalLM", **_common(num_key_value_heads=2, sliding_window=None)),
    "gemma": lambda: _hf("GemmaConfig", "GemmaForCausalLM", **_common(num_key_value_heads=1, head_dim=8)),
    "gemma2": lambda: _hf("Gemma2Config", "Gemma2ForCausalLM", **_common(num_key_value_heads=2, head_dim=8,
                                                                         sliding_window=8)),
    "gemma3": lambda: _hf("Gemma3TextConfig", "Gemma3ForCausalLM", **_common(num_key_value_heads=2, head_dim=8,
                                                                             sliding_window=8,
                                                                             layer_types=["sliding_attention", "full_attention"] * 2)),
    "phi": lambda: _hf("PhiConfig", "PhiForCausalLM", **_common(resid_pdrop=0.0, embd_pdrop=0.0,
                                                               attention_dropout=0.0, partial_rotary_factor=0.5)),
    "phi3": lambda: _hf("Phi3Config", "Phi3ForCausalLM", **_common(num_key_value_heads=2, pad_token_id=0)),
    "gpt2": lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=4,
                        n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "gpt_neox": lambda: _hf("GPTNeoXConfig", "GPTNeoXForCausalLM", **_common(rotary_pct=0.5, hidden_dropout=0.0,
                                                                             attention_dropout=0.0)),
    "gptj": lambda: _hf("GPTJConfig", "GPTJForCausalLM", vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=4,
                        rotary_dim=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "falcon": lambda: _hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=D,
                          num_hidden_layers=LAYERS, num_attention_heads=4, hidden_dropout=0.0,
                          attention_dropout=0.0),
    "bloom": lambda: _hf("BloomConfig", "BloomForCausalLM", vocab_size=VOCAB, hidden_size=D, n_layer=LAYERS,
                         n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "opt": lambda: _hf("OPTConfig", "OPTForCausalLM", vocab_size=VOCAB, hidden_size=D, ffn_dim=2 * D,
                       num_hidden_layers=LAYERS, num_attention_heads=4, max_position_embeddings=64,
                       word_embed_proj_dim=D, dropout=0.0, attention_dropout=0.0, pad_token_id=1),
    "stablelm": lambda: _hf("StableLmConfig", "StableLmForCausalLM", **_common(num_key_value_heads=2,
                                                                              partial_rotary_factor=0.25)),
    "olmo2": lambda: _hf("Olmo2Config", "Olmo2ForCausalLM", **_common(num_key_value_heads=2)),
    "cohere": lambda: _hf("CohereConfig", "CohereForCausalLM", **_common(num_key_value_heads=2)),
    "granite": lambda: _hf("GraniteConfig", "GraniteForCausalLM", **_common(num_key_value_heads=2,
                                                                            embedding_multiplier=2.0,
                                                                            residual_multiplier=0.5,
                                                                            attention_multiplier=0.2,
                                                                            logits_scaling=4.0)),
    "starcoder2": lambda: _hf("Starcoder2Config", "Starcoder2ForCausalLM", **_common(num_key_value_heads=2,
                                                                                    residual_dropout=0.0,
                                                                                    embedding_dropout=0.0)),
    "gpt_bigcode": lambda: _hf("GPTBigCodeConfig", "GPTBigCodeForCausalLM", vocab_size=VOCAB, n_embd=D,
                               n_layer=LAYERS, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0),
    "codegen": lambda: _hf("CodeGenConfig", "CodeGenForCausalLM", vocab_size=VOCAB, n_embd=D, n_layer=LAYERS,
                           n_head=4, rotary_dim=4, n_positions=64, n_ctx=64, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0),
    "olmo": lambda: _hf("OlmoConfig", "OlmoForCausalLM", **_common(num_key_value_heads=2)),
    "helium": lambda: _hf("HeliumConfig", "HeliumForCausalLM", **_common(num_key_value_heads=2, head_dim=8)),
    "glm": lambda: _hf("GlmConfig", "GlmForCausalLM", **_common(num_key_value_heads=2, head_dim=8, pad_token_id=0)),
    "nemotron": lambda: _hf("NemotronConfig", "NemotronForCausalLM", **_common(num_key_value_heads=2,
                                                                              head_dim=8)),
    "smollm3": lambda: _hf("SmolLM3Config", "SmolLM3ForCausalLM", **_common(num_key_value_heads=2,
                                                                            no_rope_layer_interval=2, pad_token_id=0)),
    "cohere2": lambda: _hf("Cohere2Config", "Cohere2ForCausalLM", **_common(num_key_value_heads=2, sliding_window=8,
                                                                           layer_types=["sliding_attention", "full_attention"] * 2)),
    "exaone4": lambda: _hf("Exaone4Config", "Exaone4ForCausalLM", **_common(num_key_value_heads=2, sliding_window=8,
                                                                           layer_types=["sliding_attention", "full_attention"] * 2)),
    "olmo3": lambda: _hf("Olmo3Config", "Olmo3ForCausalLM", **_common(num_key_value_heads=2, sliding_window=8)),
    "apertus": lambda: _hf("ApertusConfig", "ApertusForCausalLM", **_common(num_key_value_heads=2)),
    "arcee": lambda: _hf("ArceeConfig", "ArceeForCausalLM", **_common(num_key_value_heads=2)),
    "ernie4_5": lambda: _hf("Ernie4_5Config", "Ernie4_5ForCausalLM", **_common(num_key_value_heads=2, head_dim=8)),
    "persimmon": lambda: _hf("PersimmonConfig", "PersimmonForCausalLM", **_common(hidden_dropout=0.0,
                                                                                 attention_dropout=0.0)),
    "falcon_new": lambda: _hf("FalconConfig", "FalconForCausalLM", vocab_size=VOCAB, hidden_size=D,
                              num_hidden_layers=LAYERS, num_attention_heads=4, num_kv_heads=2,
                              new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0),
    "gpt2_layer_scaled": lambda: _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=VOCAB, n_embd=D, n_layer=LAYERS,
                                     n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     scale_attn_by_inverse_layer_idx=True),
    "qwen2_sliding": lambda: _hf("Qwen2Config", "Qwen2ForCausalLM", **_common(num_key_value_heads=2, use_sliding_window=True,
                                                                             sliding_window=8, max_window_layers=2)),
    # Mixture-of-experts: 4 experts, top-2, the load-balancing loss on (router logits reach the epilogue).
    "mixtral": lambda: _hf("MixtralConfig", "MixtralForCausalLM", **_common(num_key_value_heads=2, num_local_experts=4,
                                                                           num_experts_per_tok=2, **_AUX)),
    "qwen2_moe": lambda: _hf("Qwen2MoeConfig", "Qwen2MoeForCausalLM", **_common(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
        shared_expert_intermediate_size=48, mlp_only_layers=[0], **_AUX)),
    "qwen3_moe": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
        norm_topk_prob=True, **_AUX)),
    "qwen3_moe_unnormalised": lambda: _hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
        norm_topk_prob=False, decoder_sparse_step=2, **_AUX)),
    "gpt_oss": lambda: _hf("GptOssConfig", "GptOssForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, **_AUX)),
    "deepseek_v3": lambda: _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", **_common(
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=D, n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, **_AUX)),
    # Hybrid: three gated delta-net (linear attention) layers, then a full-attention one; MoE with a shared expert.
    "qwen3_next": lambda: _hf("Qwen3NextConfig", "Qwen3NextForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=D,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, **_AUX)),
    # Qwen3.5: Qwen3-Next's hybrid with the gated delta-net's projections apart (qkv, z, b, a)
    # and a dense MLP; its MoE text model with a shared expert. Wider MLPs than the others': the
    # chunked delta rule's activations outweigh twice the weights of the common tiny config, the
    # parity test's first budget.
    "qwen3_5": lambda: _hf("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, intermediate_size=8 * D, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8)),
    "qwen3_5_moe": lambda: _hf("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=2 * D,
        shared_expert_intermediate_size=4 * D, linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, **_AUX)),
    # Hybrid with Mamba mixers (refused, docs/families.md).
    "jamba": lambda: _hf("JambaConfig", "JambaForCausalLM", **_common(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=2, mamba_expand=2)),
    "llama4": lambda: _hf("Llama4TextConfig", "Llama4ForCausalLM", **_common(
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=2 * D)),
}


def batch(b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (b, t), generator=g)
