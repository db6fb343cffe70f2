"""engine.save_pretrained of a PEFT model: the adapter in PEFT's format, which PeftModel.from_pretrained
loads on the base, or with merge_adapter=True the merged model, which AutoModelForCausalLM loads;
either gives the engine's loss, and neither changes the engine or the user's module."""
from __future__ import annotations

import os

import pytest
import torch

import megacompile
from megacompile.errors import ArgumentError, MegacompileError
from tests import models

peft = pytest.importorskip("peft")

IDS = [models.batch(96, 2, 16, seed=s) for s in range(3)]


def _base():
    torch.manual_seed(0)
    return models.hf_llama(layers=1, d=32)


def _peft_model():
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(_base(), config)


@pytest.fixture(scope="module")
def trained():
    """A PEFT Llama trained 2 steps through compile, and its loss on a batch it did not train on."""
    model = _peft_model()
    engine = megacompile.compile(model, 1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    for ids in IDS[:2]:
        engine.step(input_ids=ids, labels=ids)
    loss = engine(input_ids=IDS[2], labels=IDS[2]).loss.item()
    yield engine, loss
    engine.close()


def _loss(model) -> float:
    with torch.no_grad():
        return model(input_ids=IDS[2], labels=IDS[2]).loss.item()


def test_the_adapter_loads_with_peft_and_gives_the_engines_loss(trained, tmp_path):
    engine, loss = trained
    engine.save_pretrained(tmp_path / "adapter")
    assert sorted(os.listdir(tmp_path / "adapter")) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = peft.PeftModel.from_pretrained(_base(), str(tmp_path / "adapter"))
    assert _loss(loaded) == pytest.approx(loss, abs=1e-5)
    assert _loss(loaded) != pytest.approx(_loss(_base()), abs=1e-4)     # the adapters trained


def test_the_merged_model_loads_with_transformers_and_leaves_the_engine_as_it_was(trained, tmp_path):
    from transformers import AutoModelForCausalLM
    engine, loss = trained
    before = engine.state_dict()
    engine.save_pretrained(tmp_path / "merged", merge_adapter=True)
    assert not any(f.startswith("adapter_") for f in os.listdir(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert _loss(merged) == pytest.approx(loss, abs=1e-5)
    # merged into a copy: the engine's masters and the user's module keep the adapters apart
    after = engine.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert any(".lora_A." in name for name, _ in engine.model.named_parameters())
    assert engine(input_ids=IDS[2], labels=IDS[2]).loss.item() == pytest.approx(loss, abs=1e-6)


def test_merge_adapter_on_a_model_without_adapters_is_refused(tmp_path):
    engine = megacompile.compile(_base(), 1.0, device="cpu")
    with pytest.raises(ArgumentError, match="carries none"):
        engine.save_pretrained(tmp_path / "out", merge_adapter=True)
    assert not os.path.exists(tmp_path / "out")


def test_two_adapters_are_refused_naming_them(tmp_path):
    model = _peft_model()
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"]))
    engine = megacompile.compile(model, 1.0, device="cpu")
    with pytest.raises(MegacompileError, match=r"'default' \(LORA\), 'other' \(LORA\)"):
        engine.save_pretrained(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_a_peft_model_under_data_parallelism_is_refused(tmp_path):
    engine = megacompile.compile(_peft_model(), 1.0, device="cpu")
    engine.data_parallel = object()      # the refusal comes before any rank would be asked for anything
    with pytest.raises(MegacompileError, match="runs in one process"):
        engine.save_pretrained(tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")
