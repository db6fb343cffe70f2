"""Mixture-of-experts folders in and out: transformers 5 holds experts as fused 3D weights but
saves them one tensor per expert (Mixtral's `block_sparse_moe.experts.N.w1`, Qwen's
`mlp.experts.N.gate_proj`). from_pretrained streams those into slices of the fused masters with
the eager loss exactly; save_pretrained writes the same names transformers writes, and
transformers loads them back with the trained weights and the same loss."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

import megacompile
from megacompile.errors import WeightsFileError
from tests.families import FAMILIES, batch

IDS = batch(seed=3)


def _keys(folder: str) -> set[str]:
    out = set()
    for file in os.listdir(folder):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(folder, file), "pt") as f:
                out |= set(f.keys())
    return out


def _loss(model) -> float:
    with torch.no_grad():
        return model(input_ids=IDS, labels=IDS).loss.item()


@pytest.mark.parametrize("family,stored", [
    pytest.param("mixtral", "block_sparse_moe.experts.3.w3.weight", marks=pytest.mark.slow),   # renamed too
    ("qwen3_moe", "mlp.experts.3.up_proj.weight")])
def test_per_expert_folders_load_exactly_and_export_as_transformers_saves(family, stored, tmp_path):
    torch.manual_seed(0)
    eager = FAMILIES[family]()
    source = str(tmp_path / "src")
    eager.save_pretrained(source, max_shard_size="40KB")
    written = _keys(source)
    assert f"model.layers.1.{stored}" in written and not any(k.endswith("gate_up_proj") for k in written)
    engine = megacompile.from_pretrained(source, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    assert engine(input_ids=IDS, labels=IDS).loss.item() == _loss(eager)
    for name, value in eager.state_dict().items():       # every expert in its slice of the fused master
        assert torch.equal(engine.state_dict()[name], value), name
    for _ in range(2):
        engine.step(input_ids=IDS, labels=IDS)
    out = str(tmp_path / "out")
    engine.save_pretrained(out, max_shard_size="40KB")
    assert _keys(out) == written                          # the names and cuts transformers writes
    back = AutoModelForCausalLM.from_pretrained(out)
    trained = engine.state_dict()
    for name, value in back.state_dict().items():
        assert torch.equal(value, trained[name]), name
    assert _loss(back) == engine(input_ids=IDS, labels=IDS).loss.item()


def test_a_folder_missing_one_expert_tensor_is_refused_naming_the_weight(tmp_path):
    torch.manual_seed(0)
    source = str(tmp_path / "src")
    FAMILIES["qwen3_moe"]().save_pretrained(source, max_shard_size="40KB")
    index = os.path.join(source, "model.safetensors.index.json")
    with open(index) as f:
        meta = json.load(f)
    del meta["weight_map"]["model.layers.0.mlp.experts.2.down_proj.weight"]
    with open(index, "w") as f:
        json.dump(meta, f)
    with pytest.raises(WeightsFileError, match=r"model.layers.0.mlp.experts.down_proj \(3 of its 4 per-expert"):
        megacompile.from_pretrained(source, hbm_budget=1.0, device="cpu")


def test_before_the_first_step_exports_and_checkpoints_come_from_the_files(tmp_path):
    torch.manual_seed(0)
    eager = FAMILIES["qwen3_moe"]()
    source = str(tmp_path / "src")
    eager.save_pretrained(source, max_shard_size="40KB")
    engine = megacompile.from_pretrained(source, hbm_budget=1.0, device="cpu")
    out = str(tmp_path / "out")
    engine.save_pretrained(out, dtype=torch.bfloat16)     # the fused experts assembled once, then cut again
    engine.save_checkpoint(str(tmp_path / "step-0"))
    assert engine.host is None
    half = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    for name, value in half.state_dict().items():
        assert torch.equal(value, eager.state_dict()[name].to(torch.bfloat16)), name
    resumed = megacompile.from_pretrained(out, hbm_budget=1.0, device="cpu")   # bf16 weights, then the fp32 masters
    resumed.load_checkpoint(str(tmp_path / "step-0"))
    assert resumed.step(input_ids=IDS, labels=IDS) == engine.step(input_ids=IDS, labels=IDS)
