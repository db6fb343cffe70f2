"""LlamaFactory's Qwen2.5-VL examples (examples/train_full/qwen2_5vl_full_sft.yaml and
examples/train_lora/qwen2_5vl_lora_sft.yaml), their keys as written, pointed at a tiny local folder
of each vision-language family and at LlamaFactory's demo data (mllm_demo with images, identity,
alpaca_en_demo, named in dataset_info.json): with no hbm_budget the run trains, its first step's
loss is eager transformers' on the micro-batches the engine was given, and output_dir holds what
transformers (with peft, for the adapter) and the family's processor load."""
from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText

from megacompile import Engine
from megacompile.train import load, log, run
from tests.train import files, processor_files, qwen_files

LAYOUTS = {"full": qwen_files.LLAMAFACTORY_QWEN2_5VL_FULL_SFT, "lora": qwen_files.LLAMAFACTORY_QWEN2_5VL_LORA_SFT}
FAMILIES = ("llava", "gemma3", "idefics3", "qwen2_5_vl", "qwen3_vl")
ROWS = {"idefics3": 128}      # its crops and the global image: the demo's records run to 102 tokens


def _processor(folder: str, family: str):
    if family in ("qwen2_5_vl", "qwen3_vl"):     # built without its video processor (no torchvision here)
        return processor_files.qwen_processor(folder, family)
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(folder)


@pytest.mark.slow   # per case: a tiny VLM made, the demo data tokenised, the default budget found, one step
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_llamafactorys_qwen2_5vl_examples_train_every_family(tmp_path, monkeypatch, family, layout):
    monkeypatch.chdir(tmp_path)
    processor_files.model_dir("model", family)
    qwen_files.llamafactory_data("data")
    given = []
    step = Engine.step
    monkeypatch.setattr(Engine, "step", lambda engine, **kw: given.append(kw) or step(engine, **kw))
    # tiny sizes (rows that hold the longest demo record with its image, one optimizer step of 2
    # micro-batches) and float32, so that the loss is eager's to 1e-5 (the bfloat16 run as written:
    # test_vlm_keys.py)
    settings = {"model_name_or_path": "model", **LAYOUTS[layout], "output_dir": f"saves/{family}/{layout}/sft",
                "cutoff_len": ROWS.get(family, 96), "max_steps": 1, "gradient_accumulation_steps": 2, "bf16": False}
    c = load(files.run_yaml("run.yaml", **settings), ["device=cpu"])
    assert c.hbm_budget is None
    assert run(c)["steps"] == 1
    row, = log.read(os.path.join(c.run_dir, "log.csv"))
    assert math.isfinite(float(row["loss"]))
    assert len(given) == c.grad_accum and any("pixel_values" in kw for kw in given)

    eager = AutoModelForImageTextToText.from_pretrained("model", dtype=torch.float32)
    with torch.no_grad():
        losses = [eager(**kw).loss.item() for kw in given]
    assert float(row["loss"]) == pytest.approx(sum(losses) / len(losses), rel=1e-5)

    out = c.run_dir
    _processor(out, family)
    if layout == "lora":
        from peft import PeftModel
        tuned = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained("model", dtype=torch.float32), out)
    else:
        tuned = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        after = tuned(**given[0]).loss.item()
    assert math.isfinite(after) and after != pytest.approx(losses[0], rel=1e-6)    # it trained
