"""A quantized checkpoint's config (quantization_config) plans as the full-precision model megacompile
trains, and the plan says so, naming the quantization, in the text and the JSON."""
from __future__ import annotations

import json

import torch
import transformers

import megacompile
from megacompile.cli import main

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}


def _plan(tmp_path, capsys, config: dict, *flags: str) -> tuple[int, dict, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc = main(["plan", "--config", str(path), "--hbm-budget", "1", "--seq", "64", "--host-budget", "4", "--json",
               *flags])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


def _quantized_notes(notes: list[str]) -> list[str]:
    return [n for n in notes if "quantization_config" in n]


def test_an_fp8_checkpoints_config_plans_in_full_precision_with_a_note(tmp_path, capsys):
    rc, summary, text = _plan(tmp_path, capsys, {**CONFIG, "quantization_config": FP8})
    assert rc == 0 and summary["fits"]
    [note] = _quantized_notes(summary["notes"])
    assert note.startswith("the config is a quantized checkpoint's (quantization_config: fp8): planned as the "
                           "full-precision model megacompile trains, fp32 masters and bfloat16 compute")
    assert "must be dequantized before a run loads them" in note
    assert f"  note           {note}" in text
    # The same model without quantization_config: the same plan, no note.
    rc, plain, text = _plan(tmp_path, capsys, CONFIG)
    assert rc == 0 and "notes" not in plain and "quantization_config" not in text
    assert plain["device_peak_bytes"] == summary["device_peak_bytes"]
    assert plain["trainable_params"] == summary["trainable_params"]


def test_the_note_names_the_bits_and_the_compute_dtype(tmp_path, capsys):
    _, summary, _ = _plan(tmp_path, capsys, {**CONFIG, "quantization_config": GPTQ}, "--dtype", "float32")
    [note] = _quantized_notes(summary["notes"])
    assert "(quantization_config: gptq 4-bit)" in note and "fp32 masters and float32 compute" in note


def test_plan_of_a_config_object_and_a_module_say_it_too():
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"},
                                      quantization_config=bnb)
    plan = megacompile.plan(config, hbm_budget=1, seq=64, hardware="h100")
    assert plan.fits
    assert _quantized_notes(list(plan.notes)) == [
        "the config is a quantized checkpoint's (quantization_config: bitsandbytes 4-bit): planned as the "
        "full-precision model megacompile trains, fp32 masters and bfloat16 compute; its quantized weights must be "
        "dequantized before a run loads them (megacompile train and from_pretrained refuse them as they are)"]
    with torch.device("meta"):
        module = transformers.LlamaForCausalLM(config)
    assert _quantized_notes(list(megacompile.plan(module, hbm_budget=1, seq=64, hardware="h100").notes))
