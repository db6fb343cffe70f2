"""A model quantized in memory (transformers loaded it with a quantization_config, or a parameter is
stored as integers) is refused by compile() and plan() before anything is captured or allocated,
naming the quantization and how to load the model in full precision; a full-precision model trains
(one built from a quantized checkpoint's config too: tests/e2e/test_quantized_weights_refused.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import MegacompileError

BNB = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
       "bnb_4bit_compute_dtype": "bfloat16"}
IDS = torch.arange(16).remainder(128).reshape(1, 16)


def _llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _refused(model: nn.Module) -> list[str]:
    """The messages compile() and plan() refuse `model` with; the model's weights are left as they were."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    messages = []
    with pytest.raises(MegacompileError) as refused:
        megacompile.compile(model, hbm_budget=1.0, device="cpu")
    messages.append(str(refused.value))
    with pytest.raises(MegacompileError) as refused:
        megacompile.plan(model, hbm_budget=1.0, seq=16, hardware="h100")
    messages.append(str(refused.value))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return messages


class _Quantizer:
    """Stands for the HfQuantizer transformers leaves on a model it quantized."""
    quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": 128}


def test_a_model_transformers_quantized_is_refused_naming_the_method_and_the_fix():
    model = _llama()
    model.config.quantization_config = BNB
    model.is_quantized = True
    for message in _refused(model):
        assert message.startswith("LlamaForCausalLM is quantized (quantization_config: bitsandbytes 4-bit): "
                                  "model.is_quantized is True. megacompile trains every parameter in float32 masters")
        assert "would train as wrong numbers" in message
        assert "from_pretrained(path, dtype=torch.float32) without a quantization_config" in message
        assert "point megacompile at a full-precision copy" in message
        assert "model.dequantize()" in message
        assert "(QLoRA) is not supported" in message


@pytest.mark.parametrize("flag", ["hf_quantizer", "config._is_quantized"])
def test_each_mark_transformers_leaves_on_a_quantized_model_is_refused(flag):
    model = _llama()
    if flag == "hf_quantizer":
        model.hf_quantizer = _Quantizer()
        start = ("LlamaForCausalLM is quantized (quantization_config: gptq 4-bit): transformers quantized it as it "
                 "loaded (model.hf_quantizer is a _Quantizer)")
    else:
        model.config.quantization_config = {"quant_method": "awq", "bits": 4}
        model.config._is_quantized = True
        start = ("LlamaForCausalLM is quantized (quantization_config: awq 4-bit): its config says transformers "
                 "quantized it (config._is_quantized is True)")
    for message in _refused(model):
        assert message.startswith(start)
        assert "model.dequantize()" not in message


def test_an_integer_weight_is_refused_naming_the_parameter():
    model = _llama()
    linear = model.model.layers[1].mlp.down_proj
    linear.weight = nn.Parameter(torch.zeros(linear.weight.shape, dtype=torch.int8), requires_grad=False)
    for message in _refused(model):
        assert message.startswith("LlamaForCausalLM is quantized: its parameter model.layers.1.mlp.down_proj.weight "
                                  "is int8 (Parameter of shape (64, 128)). megacompile trains")
        assert "from_pretrained(path, dtype=torch.float32) without a quantization_config" in message


def test_an_fp8_weight_is_refused():
    model = _llama()
    linear = model.model.layers[0].self_attn.q_proj
    linear.weight = nn.Parameter(linear.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
    for message in _refused(model):
        assert "its parameter model.layers.0.self_attn.q_proj.weight is float8_e4m3fn" in message


def test_a_full_precision_model_still_compiles_and_trains():
    model = _llama()
    expected = model(input_ids=IDS, labels=IDS).loss.item()
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    try:
        assert engine.step(input_ids=IDS, labels=IDS) == pytest.approx(expected, rel=1e-4)
    finally:
        engine.close()
