"""A model folder whose config.json has quantization_config holds quantized weights (FP8 values with
their scales, packed integers): read as plain tensors they would train as wrong numbers, so
from_pretrained and a run refuse the folder, naming the quantization and how to dequantize it, before
the data is read. An export is full precision and its config.json says so (no quantization_config)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.errors import WeightsFileError
from megacompile.train import load, run
from tests import models
from tests.train import files

FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _with_config(folder: str, **changes) -> str:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **changes}, f)
    return folder


def _fp8_folder(tmp_path) -> str:
    """A small Llama as DeepSeek-V3 stores its weights: e4m3 matrices, each with its weight_scale_inv."""
    folder = files.model_dir(str(tmp_path / "fp8"))
    weights = os.path.join(folder, "model.safetensors")
    stored = {}
    for key, t in load_file(weights).items():
        if key.endswith("proj.weight"):
            scale = t.abs().max().float() / 448
            stored[key] = (t.float() / scale).to(torch.float8_e4m3fn)
            stored[key.replace(".weight", ".weight_scale_inv")] = scale.reshape(1, 1)
        else:
            stored[key] = t
    save_file(stored, weights, metadata={"format": "pt"})
    return _with_config(folder, quantization_config=FP8)


def test_from_pretrained_refuses_fp8_weights_naming_how_to_dequantize_them(tmp_path):
    folder = _fp8_folder(tmp_path)
    with pytest.raises(WeightsFileError) as refused:
        megacompile.from_pretrained(folder, hbm_budget=1.0, device="cpu")
    message = str(refused.value)
    assert message.startswith(f"{folder}/config.json has quantization_config (fp8): the weights in {folder} are "
                              "stored quantized")
    assert "quantization_config=FineGrainedFP8Config(dequantize=True)" in message
    assert "remove quantization_config from its config.json" in message


def test_fp8_tensors_in_a_folder_whose_config_does_not_say_so_are_refused_as_such(tmp_path):
    folder = _with_config(_fp8_folder(tmp_path), quantization_config=None)
    with pytest.raises(WeightsFileError, match=r"has dtype F8_E4M3, which megacompile does not load \(an FP8 tensor "
                                               r"of a quantized checkpoint: dequantize the checkpoint"):
        megacompile.from_pretrained(folder, hbm_budget=1.0, device="cpu")


def _gptq_folder(tmp_path) -> str:
    """A small Llama as GPTQ stores it: 4-bit integers packed eight to an int32, scales and zeros per group."""
    folder = files.model_dir(str(tmp_path / "gptq"))
    weights = os.path.join(folder, "model.safetensors")
    stored = {}
    for key, t in load_file(weights).items():
        if not key.endswith("proj.weight"):
            stored[key] = t
            continue
        out, into = t.shape
        base = key.removesuffix(".weight")
        stored |= {f"{base}.qweight": torch.zeros(into // 8, out, dtype=torch.int32),
                   f"{base}.qzeros": torch.zeros(1, out // 8, dtype=torch.int32),
                   f"{base}.scales": torch.ones(1, out, dtype=torch.float16),
                   f"{base}.g_idx": torch.zeros(into, dtype=torch.int32)}
    save_file(stored, weights, metadata={"format": "pt"})
    return _with_config(folder, quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})


def test_a_method_transformers_cannot_dequantize_points_to_the_full_precision_checkpoint(tmp_path):
    folder = _gptq_folder(tmp_path)
    with pytest.raises(WeightsFileError, match=r"has quantization_config \(gptq 4-bit\).* train from the "
                                               r"full-precision checkpoint it was quantized from"):
        megacompile.from_pretrained(folder, hbm_budget=1.0, device="cpu")


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_run_refuses_a_quantized_folder_before_the_data_is_read(tmp_path, monkeypatch, method):
    folder = _fp8_folder(tmp_path)
    notes = files.text(str(tmp_path / "notes.txt"))
    monkeypatch.setattr("megacompile.train.loop.open_stage", lambda *a, **k: pytest.fail("the data was read"))
    with pytest.raises(WeightsFileError, match=r"config.json has quantization_config \(fp8\)"):
        run(load(None, ["device=cpu", "steps=1", "seq=32", f"model={folder}", f"data={notes}",
                        f"finetuning_type={method}", f"run_dir={tmp_path / 'run'}"]))
    assert not (tmp_path / "run").exists()


def test_an_export_of_a_model_whose_config_names_a_quantization_is_full_precision(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         quantization_config=FP8)
    engine = megacompile.compile(LlamaForCausalLM(config), 1.0, device="cpu")
    ids = models.batch(96, 2, 16, seed=3)
    engine.step(input_ids=ids, labels=ids)
    out = str(tmp_path / "out")
    engine.save_pretrained(out)
    with open(os.path.join(out, "config.json")) as f:
        assert "quantization_config" not in json.load(f)
    back = AutoModelForCausalLM.from_pretrained(out)
    for key, value in back.state_dict().items():
        assert torch.equal(value, engine.state_dict()[key]), key
