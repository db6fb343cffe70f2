"""The parity models: small Hugging Face Llama, Qwen2 and GPT-2 with random weights, and token batches.

Shared by the tests (tests/models.py re-exports them) and `python -m megacompile.acceptance`.
transformers is imported when a model is built, so the package does not depend on it.
"""
from __future__ import annotations

import torch


def hf_llama(layers: int = 6, d: int = 64, vocab: int = 96):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, use_cache=False))


def hf_qwen2(layers: int = 6, d: int = 64, vocab: int = 96):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=64, use_cache=False, tie_word_embeddings=False))


def hf_gpt2(layers: int = 6, d: int = 64, vocab: int = 96, dropout: float = 0.0):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=d, n_layer=layers, n_head=4, n_positions=64,
                                      resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False))


def batch(vocab: int = 96, b: int = 2, t: int = 16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (b, t), generator=g)
