"""LoRA names that PEFT also gives the routed experts' fused weights (bare parameters, which take no
adapters here): refused by name, before the run, with the Linear modules to name instead."""
from __future__ import annotations

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train.methods.lora import with_adapters


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    config = Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    with torch.device("meta"):
        return Qwen3NextForCausalLM(config)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    with torch.device("meta"):
        return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                                num_local_experts=4, num_experts_per_tok=2))


def test_all_on_a_shared_expert_model_is_refused_naming_the_collision():
    with pytest.warns(RuntimeWarning), pytest.raises(ArgumentError) as e:
        with_adapters(_qwen3_next(), 2, 4, 0.0, "all")
    said = str(e.value)
    assert "down_proj, gate_proj, up_proj" in said and "mlp.experts.gate_up_proj" in said
    assert "base_layer" not in said and "e.g. lora_target: " in said and "q_proj" in said.split("e.g.")[1]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_mixtrals_expert_names_are_refused_as_the_fused_weights():
    with pytest.raises(ArgumentError, match=r"w1 name the routed experts' fused weights \(mlp.experts.gate_up_proj\)"):
        with_adapters(_mixtral(), 2, 4, 0.0, ["q_proj", "w1"])
