"""One reading of a model's key-value cache shape (cost/decode.py cache_shape), for both the GRPO
step's plan (planner/kv_generation.py) and a run's device check (train/beside.py)."""
import types

import pytest
import torch
from transformers import LlamaConfig, LlavaConfig

from megacompile.cost import cache_bytes_per_token, cache_shape
from megacompile.errors import ArgumentError
from megacompile.planner.kv_generation import cache_per_token


def _model(config):
    return types.SimpleNamespace(config=config)


def test_the_shape_comes_from_the_config_and_a_vision_language_models_text_config():
    text = LlamaConfig(num_hidden_layers=3, hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    assert cache_shape(_model(text)) == (3, 2, 32)
    assert cache_shape(_model(LlavaConfig(text_config=text.to_dict()))) == (3, 2, 32)
    assert cache_bytes_per_token(3, 2, 32) == 2 * 3 * 2 * 32 * 2
    assert cache_bytes_per_token(3, 2, 32, itemsize=torch.float32.itemsize) == 2 * 3 * 2 * 32 * 4
    assert cache_per_token(_model(LlavaConfig(text_config=text.to_dict()))) == 2 * 3 * 2 * 32 * 2


def test_a_model_without_a_config_has_no_shape_and_the_plan_names_the_generator_that_needs_none():
    assert cache_shape(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ArgumentError, match="use generator engine"):
        cache_per_token(torch.nn.Linear(2, 2))
