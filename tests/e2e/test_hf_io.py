"""Hugging Face folders in and out: from_pretrained streams the shards into the masters of a
model built on meta, save_pretrained writes what transformers loads, with the same weights and
the same loss."""
from __future__ import annotations

import json
import os

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import megacompile
from tests import models

IDS = models.batch(96, 2, 16, seed=3)


def _llama(tied: bool):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


def _loss(model) -> float:
    with torch.no_grad():
        return model(input_ids=IDS, labels=IDS).loss.item()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tied-embedding Llama in 6 shards, with a tokenizer file to carry over."""
    folder = str(tmp_path_factory.mktemp("hf") / "src")
    model = _llama(tied=True)
    model.save_pretrained(folder, max_shard_size="20KB")
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    return folder, model


def test_round_trip_keeps_weights_and_loss(source, tmp_path):
    folder, eager = source
    assert len([f for f in os.listdir(folder) if f.endswith(".safetensors")]) >= 3
    engine = megacompile.from_pretrained(folder, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    assert engine(input_ids=IDS, labels=IDS).loss.item() == _loss(eager)     # rotary tables rebuilt, tied head
    assert torch.equal(engine.host.consts["model.rotary_emb.inv_freq"], eager.model.rotary_emb.inv_freq)
    for _ in range(3):
        engine.step(input_ids=IDS, labels=IDS)
    trained = engine.state_dict()
    out = str(tmp_path / "out")
    engine.save_pretrained(out, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))
    assert json.load(open(os.path.join(out, "tokenizer_config.json"))) == {"model_max_length": 64}
    back = AutoModelForCausalLM.from_pretrained(out)
    assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
    for key, value in back.state_dict().items():
        assert torch.equal(value, trained[key]), key
    assert _loss(back) == engine(input_ids=IDS, labels=IDS).loss.item()

    engine.save_pretrained(out, dtype=torch.bfloat16, max_shard_size="1MB", overwrite=True)    # replaces the fp32 export
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == ["model.safetensors"]
    half = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    for key, value in half.state_dict().items():
        assert torch.equal(value, trained[key].to(torch.bfloat16)), key
    # The bf16 weights, read back by both: the same loss.
    again = megacompile.from_pretrained(out, hbm_budget=1.0, device="cpu")
    assert again(input_ids=IDS, labels=IDS).loss.item() == _loss(half.float())


def test_an_untied_single_file_model_loads_and_resumes_from_a_checkpoint(tmp_path):
    torch.manual_seed(1)
    eager = Qwen2ForCausalLM(Qwen2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=False))
    eager.save_pretrained(str(tmp_path / "src"))
    file = str(tmp_path / "src" / "model.safetensors")
    # Older files hold each layer's rotary table, which the model computes and does not save.
    tensors = safetensors.torch.load_file(file)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.full((4,), 7.0)
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    engine = megacompile.from_pretrained(str(tmp_path / "src"), hbm_budget=1.0, device="cpu",
                                         compute_dtype=torch.bfloat16)
    assert torch.equal(engine(input_ids=IDS, labels=IDS).logits.float(),
                       megacompile.compile(eager, 1.0, device="cpu", compute_dtype=torch.bfloat16)(
                           input_ids=IDS, labels=IDS).logits.float())
    engine.step(input_ids=IDS, labels=IDS)
    engine.save_checkpoint(str(tmp_path / "ck"))
    expected = engine.step(input_ids=IDS, labels=IDS)
    resumed = megacompile.from_pretrained(str(tmp_path / "src"), hbm_budget=1.0, device="cpu",
                                          compute_dtype=torch.bfloat16)
    resumed.load_checkpoint(str(tmp_path / "ck"))       # replaces the pending load of the weights
    assert resumed.step(input_ids=IDS, labels=IDS) == expected
