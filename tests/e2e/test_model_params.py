"""The user's module after training: its parameters are the trained weights wherever a user reads
them (synchronize, close, model.state_dict, model.save_pretrained), or, where the module holds no
weights (built on meta), reading them is refused naming the engine's own way."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import MegacompileError
from tests import models

IDS = models.batch(96, 2, 16)


def _trained(model, steps=3):
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    for _ in range(steps):
        engine.step(idx=IDS, targets=IDS)
    return engine


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def test_after_synchronize_the_models_parameters_are_the_trained_ones():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _trained(model)
    engine.synchronize()
    trained = engine.state_dict()
    assert not torch.equal(trained["transformer.wte.weight"], initial["transformer.wte.weight"])
    _assert_same({k: v.detach() for k, v in model.named_parameters()},
                 {k: trained[k] for k, _ in model.named_parameters()})


def test_model_state_dict_reads_the_trained_weights_without_synchronize():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    engine = _trained(model)
    _assert_same(model.state_dict(), engine.state_dict())


def test_after_close_the_models_parameters_are_the_trained_ones():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    engine = _trained(model)
    engine.close()
    assert torch.equal(model.lm_head.weight.detach(), engine.state_dict()["lm_head.weight"])


def test_a_meta_model_refuses_model_state_dict_naming_the_engines_way():
    with torch.device("meta"):
        model = models.NanoGPT(vocab=96, d=32, layers=2)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    engine.load_state_dict(models.NanoGPT(vocab=96, d=32, layers=2).state_dict())
    engine.step(idx=IDS, targets=IDS)
    with pytest.raises(MegacompileError, match=r"are on the meta device: the weights live in the engine.*"
                                               r"engine.state_dict\(\).*engine.save_pretrained\(path\)"):
        model.state_dict()
    assert not engine.state_dict()["lm_head.weight"].is_meta     # the engine's way reads them


def test_model_save_pretrained_after_training_writes_the_trained_weights(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         use_cache=False))
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    for _ in range(2):
        engine.step(input_ids=IDS, labels=IDS)
    model.save_pretrained(str(tmp_path / "out"))
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    trained = engine.state_dict()
    _assert_same({k: v for k, v in back.state_dict().items() if k in trained}, trained)


def test_engine_state_dict_of_a_meta_model_before_its_weights_says_to_load_them():
    with torch.device("meta"):
        model = models.NanoGPT(vocab=96, d=32, layers=2)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    with pytest.raises(MegacompileError, match=r"no weights yet: the model was built on the meta device; load them "
                                               r"\(engine.load_state_dict, engine.load_checkpoint\)"):
        engine.state_dict()


def test_layer_major_steps_reach_the_models_parameters_too():
    model = models.NanoGPT(vocab=96, d=32, layers=2)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=2, accumulation="layer",
                                 optimizer=megacompile.AdamW(lr=1e-2))
    for _ in range(4):                          # 2 optimizer steps of 2 micro-batches, walked layer by layer
        engine.step(idx=IDS, targets=IDS)
    assert engine.steps_done == 2
    _assert_same(model.state_dict(), engine.state_dict())
