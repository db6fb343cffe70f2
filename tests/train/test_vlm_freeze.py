"""run.yaml's freeze_vision_tower, freeze_multi_modal_projector and freeze_language_model
(LlamaFactory's names) on a tiny LLaVA trained from records with images: a frozen part's weights
come out of the export bit for bit as they went in, the rest moves; under finetuning_type lora
the adapters sit on the language model alone, and on the tower's Linear modules too with
freeze_vision_tower false. On a text-only model the keys away from LlamaFactory's defaults are
refused by name, before anything is written."""
from __future__ import annotations

import os

import pytest
import safetensors.torch

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from tests.train import files, vlm_files


def _run_yaml(tmp_path, name: str, **over) -> str:
    if not os.path.isdir(tmp_path / "model"):
        vlm_files.model_dir(str(tmp_path / "model"))
        vlm_files.records(str(tmp_path / "data.jsonl"), 12)
    settings = {"model": "model", "data": "data.jsonl", "seq": 48, "batch": 2, "steps": 3, "seed": 3, "lr": 1e-2,
                "schedule": "constant", "device": "cpu", "compute_dtype": "float32", "run_dir": name,
                "export": f"{name}-export", "log_every": 1, **over}
    return files.run_yaml(str(tmp_path / f"{name}.yaml"), **settings)


def _weights(path) -> dict:
    return safetensors.torch.load_file(str(path / "model.safetensors"))


@pytest.mark.slow     # 18 s; test_vlm.py's frozen tower trains as eagerly in the default tier
def test_a_frozen_vision_tower_is_exported_as_it_went_in_and_the_rest_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run(load(_run_yaml(tmp_path, "tower", freeze_vision_tower=True), []))
    before, after = _weights(tmp_path / "model"), _weights(tmp_path / "tower-export")
    assert before.keys() == after.keys()
    tower = [k for k in before if "vision_tower" in k.split(".")]
    rest = [k for k in before if k not in tower]
    assert tower and all(before[k].equal(after[k]) for k in tower)
    moved = [k for k in rest if not before[k].equal(after[k])]
    projector = [k for k in rest if "multi_modal_projector" in k]
    assert set(projector) <= set(moved) and any("layers" in k.split(".") for k in moved)


@pytest.mark.long   # two runs of a LLaVA, one record a micro-batch: 40-50 s on 2 cores
def test_a_micro_batch_may_hold_no_image_whatever_is_frozen(tmp_path, monkeypatch):
    """One record a micro-batch, every fourth record text alone: a trained projector is skipped by
    those steps (engine/gradless.py) and still moves; with the whole image side frozen it stays."""
    monkeypatch.chdir(tmp_path)
    run(load(_run_yaml(tmp_path, "projector", batch=1, steps=4, freeze_vision_tower=True), []))
    before, after = _weights(tmp_path / "model"), _weights(tmp_path / "projector-export")
    projector = [k for k in before if "multi_modal_projector" in k.split(".")]
    tower = [k for k in before if "vision_tower" in k.split(".")]
    assert projector and all(not before[k].equal(after[k]) for k in projector)
    assert tower and all(before[k].equal(after[k]) for k in tower)
    run(load(_run_yaml(tmp_path, "both", batch=1, steps=4, freeze_vision_tower=True,
                       freeze_multi_modal_projector=True), []))
    before, after = _weights(tmp_path / "model"), _weights(tmp_path / "both-export")
    image_side = [k for k in before if {"vision_tower", "multi_modal_projector"} & set(k.split("."))]
    assert image_side and all(before[k].equal(after[k]) for k in image_side)
    assert any(not before[k].equal(after[k]) for k in before if k not in image_side)


@pytest.mark.long   # about 60 s on 2 cores
def test_lora_puts_adapters_on_the_language_model_alone(tmp_path, monkeypatch):
    """The tower has q_proj and v_proj too; lora_target names them, and they stay frozen."""
    monkeypatch.chdir(tmp_path)
    run(load(_run_yaml(tmp_path, "lora", finetuning_type="lora", lora_rank=2, lora_target="q_proj,v_proj",
                       freeze_vision_tower=True, merge_adapter=True), []))
    before, after = _weights(tmp_path / "model"), _weights(tmp_path / "lora-export")
    assert before.keys() == after.keys()
    moved = [k for k in before if not before[k].equal(after[k])]
    assert moved and all(k.startswith("language_model.") and {"q_proj", "v_proj"} & set(k.split(".")) for k in moved)
    assert any(k.startswith("vision_tower.") and "q_proj" in k.split(".") for k in before)


def test_a_lora_runs_model_puts_adapters_on_the_tower_with_freeze_vision_tower_false(tmp_path, monkeypatch):
    """The run's LoRA model, made from the folder as a run makes it: with freeze_vision_tower false
    the tower's q_proj and v_proj take adapters beside the language model's (test_vlm_lora_tower.py:
    LlamaFactory's choice in full); the projector none."""
    from megacompile.train import methods
    monkeypatch.chdir(tmp_path)
    c = load(_run_yaml(tmp_path, "lora", finetuning_type="lora", lora_rank=2, lora_target="q_proj,v_proj",
                       freeze_vision_tower=False), [])
    adapted = {n for n, m in methods.lora_skeleton(c).named_modules() if hasattr(m, "lora_A")}
    tower = {n for n in adapted if ".vision_tower." in n}
    assert tower and {n.rsplit(".", 1)[-1] for n in tower} == {"q_proj", "v_proj"}
    assert any(".language_model." in n for n in adapted) and not any("multi_modal_projector" in n for n in adapted)


def test_the_keys_are_refused_where_they_cannot_apply_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    work = files.workspace(tmp_path / "text-model")
    text = files.run_yaml(str(tmp_path / "text.yaml"), model=work["model"], data=work["chats"], seq=32, batch=2,
                          steps=1, device="cpu", run_dir="text", freeze_vision_tower=False,
                          freeze_multi_modal_projector=True)      # LlamaFactory's default: asks for nothing here
    with pytest.raises(ArgumentError, match="freeze_vision_tower applies to a vision-language model; LlamaForCausalLM "
                                            "has no vision tower: leave it out"):
        run(load(text, []))
    assert not os.path.exists(tmp_path / "text")
    for over, message in (({"freeze_vision_tower": "yes"}, "freeze_vision_tower must be true or false"),
                          ({"finetuning_type": "lora", "freeze_language_model": True},
                           "freeze_language_model: true under finetuning_type lora leaves no part to put adapters on")):
        with pytest.raises(ArgumentError, match=message):
            load(_run_yaml(tmp_path, "bad", **over), [])


def test_llamafactorys_defaults_of_the_keys_ask_nothing_of_a_text_model():
    """A LlamaFactory dump writes freeze_vision_tower: true, freeze_multi_modal_projector: true and
    freeze_language_model: false whatever the model: on a text model they freeze nothing."""
    from types import SimpleNamespace
    from megacompile.train.methods import vision_freeze
    from tests import models
    model = models.hf_llama(layers=1, d=32)
    vision_freeze.apply(SimpleNamespace(freeze_vision_tower=True, freeze_multi_modal_projector=True,
                                        freeze_language_model=False), model)
    assert all(p.requires_grad for p in model.parameters())
    with pytest.raises(ArgumentError, match="freeze_language_model applies to a vision-language model"):
        vision_freeze.apply(SimpleNamespace(freeze_vision_tower=True, freeze_multi_modal_projector=None,
                                            freeze_language_model=True), model)
