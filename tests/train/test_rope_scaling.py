"""rope_scaling: a run longer than the model's positions trains the model LlamaFactory's
configure_rope makes of it (losses to 1e-5 against eager transformers with that config, full and
LoRA runs), the exported config.json carries the scaling, a seq within the positions leaves the
model as it is, and what cannot be scaled so is refused."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, rope_scaling, run
from tests.train import files, finetune_runs

SEQ, CONTEXT = 32, 12       # factor ceil(32 / 12) = 3


def _short_model(path: str) -> str:
    """files.model_dir's Llama, its config.json saying it was trained on CONTEXT positions."""
    files.model_dir(path, dim=32)
    config = os.path.join(path, "config.json")
    with open(config) as f:
        saved = json.load(f)
    with open(config, "w") as f:
        json.dump(saved | {"max_position_embeddings": CONTEXT}, f)
    return path


def _settings(tmp_path, **extra) -> dict:
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    return dict(model=_short_model(str(tmp_path / "llama")), data=[chats], eval=[chats], eval_batches=1, seq=SEQ,
                batch=2, steps=2, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu",
                run_dir=str(tmp_path / "run"), log_every=1, save_every=2) | extra


def _as_llamafactory_scales(model_dir: str, kind: str):
    """The model as LlamaFactory's configure_rope builds it for seq SEQ."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(model_dir)
    config.rope_parameters = {"rope_theta": config.rope_parameters["rope_theta"], "rope_type": kind, "factor": 3.0} | (
        {"original_max_position_embeddings": CONTEXT} if kind != "linear" else {}) | (
        {"low_freq_factor": 1.0, "high_freq_factor": 4.0} if kind == "llama3" else {})
    config.max_position_embeddings = 3 * CONTEXT
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=torch.float32)


def _losses(model, c, rows) -> list[float]:
    return finetune_runs.train(model, c, rows, finetune_runs.trainer_groups(model, 0.0))[0]


@pytest.mark.parametrize("kind", [pytest.param("linear", marks=pytest.mark.slow), "yarn",
                                  pytest.param("llama3", marks=pytest.mark.slow)])
def test_a_longer_run_trains_the_scaled_model_and_exports_its_config(tmp_path, capsys, kind):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, rope_scaling=kind.upper())), [])
    run(c)
    out = capsys.readouterr().out
    assert f"rope           {kind} scaling, factor 3: seq 32 over the model's 12 positions; " \
           "max_position_embeddings 36" in out
    from transformers import AutoModelForCausalLM
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, plain = _as_llamafactory_scales(c.model, kind), AutoModelForCausalLM.from_pretrained(c.model)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert ours == pytest.approx(_losses(eager, c, rows), rel=1e-5)
    unscaled = _losses(plain, c, rows)      # what was trained is the scaling, not the model's own positions
    assert max(abs(a - b) / b for a, b in zip(ours, unscaled)) > 5e-5
    with open(os.path.join(c.run_dir, "config.json")) as f:
        exported = json.load(f)
    assert exported["max_position_embeddings"] == 36
    assert exported["rope_parameters"]["rope_type"] == kind and exported["rope_parameters"]["factor"] == 3.0


@pytest.mark.slow
def test_a_lora_run_builds_its_adapters_on_the_scaled_model(tmp_path):
    import peft
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(
        tmp_path, rope_scaling="yarn", finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0,
        lora_target="q_proj,v_proj", merge_adapter=True)), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    torch.manual_seed(c.seed)       # the adapters' draws, as the run draws them
    eager = peft.get_peft_model(_as_llamafactory_scales(c.model, "yarn"), peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert ours == pytest.approx(_losses(eager, c, rows), rel=1e-5)
    with open(os.path.join(c.run_dir, "config.json")) as f:
        assert json.load(f)["rope_parameters"]["rope_type"] == "yarn"     # the merged model's config


def test_a_seq_within_the_models_positions_leaves_them_as_they_are(tmp_path):
    settings = _settings(tmp_path, rope_scaling="linear", seq=CONTEXT)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    assert rope_scaling.note(c) == ("  note           rope_scaling linear: seq 12 is within the model's 12 positions, "
                                    "so its rotary embedding is left as it is (as LlamaFactory leaves it)")
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(c.model)
    before = dict(config.rope_parameters)
    rope_scaling.edit(config, c, c.model)
    assert config.rope_parameters == before and config.max_position_embeddings == CONTEXT


def test_without_it_a_longer_run_is_refused(tmp_path):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path)), [])
    with pytest.raises(ArgumentError, match="seq 32 is longer than the model's max_position_embeddings, 12"):
        run(c)


@pytest.mark.parametrize("extra, says", [
    (dict(rope_scaling="dynamic"), "rope_scaling: dynamic NTK scaling recomputes the rotary frequencies"),
    (dict(rope_scaling="ntk"), "rope_scaling is 'ntk'; give one of linear, yarn, llama3"),
    (dict(rope_scaling="linear", model="bundled"), "rope_scaling: the bundled model's positions are its own"),
])
def test_a_scaling_that_cannot_be_trained_is_refused(tmp_path, extra, says):
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **{**_settings(tmp_path), **extra}), [])
    assert says in str(e.value)


def test_a_model_without_one_rotary_config_is_refused(tmp_path):
    from transformers import LlamaConfig
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, rope_scaling="linear")), [])
    per_layer = LlamaConfig(max_position_embeddings=CONTEXT)
    per_layer.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ArgumentError, match="cannot be scaled so: its rotary parameters are per layer type"):
        rope_scaling.edit(per_layer, c, "a folder")
