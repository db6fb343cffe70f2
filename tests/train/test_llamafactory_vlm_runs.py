"""LlamaFactory's Qwen2.5-VL examples (examples/train_full/qwen2_5vl_full_sft.yaml and
examples/train_lora/qwen2_5vl_lora_sft.yaml), their keys as written, pointed at a tiny local folder
of each vision-language family and at LlamaFactory's demo data (mllm_demo with images, identity,
alpaca_en_demo, named in dataset_info.json): with no hbm_budget the run trains, its first step's
loss is eager transformers' on the micro-batches the engine was given, and output_dir holds what
transformers (with peft, for the adapter) and the family's processor load. SmolVLM saved with its
own processor, and Qwen's records with videos (LlamaFactory's mllm_video_demo), need torchvision
(tests/torchvision_env.py)."""
from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoModelForImageTextToText

from megacompile import Engine
from megacompile.train import load, log, run
from tests import torchvision_env
from tests.train import files, processor_files, qwen_files, video_files

LAYOUTS = {"full": qwen_files.LLAMAFACTORY_QWEN2_5VL_FULL_SFT, "lora": qwen_files.LLAMAFACTORY_QWEN2_5VL_LORA_SFT}
FAMILIES = ("llava", "gemma3", "idefics3", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
ROWS = {"idefics3": 128, "smolvlm": 128}      # their crops and global image: the demo's records run to 102 tokens


def _processor(folder: str, family: str):
    from transformers import AutoProcessor
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5") and not torchvision_env.importable():
        return processor_files.qwen_processor(folder, family)      # built without its video processor
    return AutoProcessor.from_pretrained(folder)


# per case: a tiny VLM made, the demo data tokenised, the default budget found, one step (20-75 s on
# two cores); the full example on Qwen2.5-VL in the slow tier, every other case with -m long
@pytest.mark.parametrize("family, layout", [
    pytest.param(f, layout, marks=pytest.mark.slow if (f, layout) == ("qwen2_5_vl", "full") else pytest.mark.long)
    for f in FAMILIES for layout in sorted(LAYOUTS)])
def test_llamafactorys_qwen2_5vl_examples_train_every_family(tmp_path, family, layout):
    _trains(str(tmp_path), family, layout)


@pytest.mark.long   # each: a child process (torchvision_env.py), a tiny SmolVLM made, one step: 20-30 s
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_smolvlm_saved_with_its_own_processor_trains_from_the_examples(tmp_path, layout):
    """SmolVLM's hub layout (SmolVLMProcessor, which transformers builds only with torchvision and
    num2words), its image wrappers and crops as its processor writes them."""
    torchvision_env.call(_trains, str(tmp_path), "smolvlm", layout)


# each: a child process (torchvision_env.py), a tiny Qwen made, clips decoded, one step (one to three
# minutes each on two cores), with -m long
@pytest.mark.long
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_the_full_example_trains_qwen_on_records_with_videos(tmp_path, family):
    """LlamaFactory's mllm_video_demo layout (a `videos` column, some records with an image too) in
    the full example's keys, video_max_pixels among them: every micro-batch holds a video."""
    torchvision_env.call(_trains, str(tmp_path), family, "full", "mllm_video_demo")


def _trains(folder: str, family: str, layout: str, dataset: str | None = None) -> None:
    """The example's keys (dataset: `dataset` when given) on the family's tiny folder, with no
    hbm_budget: it trains, its first loss is eager transformers' on the engine's micro-batches,
    output_dir loads and holds a model that moved."""
    from megacompile.calibrate import cpu_profile
    cpu_profile()       # measured first where none is cached: measuring it steps an engine of its own
    here = os.getcwd()
    os.chdir(folder)
    given, step = [], Engine.weighted_step
    Engine.weighted_step = lambda engine, weight, **kw: given.append(kw) or step(engine, weight, **kw)
    try:
        _run(family, layout, dataset, given)
    finally:
        Engine.weighted_step = step
        os.chdir(here)


def _run(family: str, layout: str, dataset: str | None, given: list) -> None:
    if dataset == "mllm_video_demo":
        video_files.model_dir("model", family)
    else:
        processor_files.model_dir("model", family)
    qwen_files.llamafactory_data("data")
    # tiny sizes (rows that hold the longest demo record with its image, one optimizer step of 2
    # micro-batches) and float32, so that the loss is eager's to 1e-5 (the bfloat16 run as written:
    # test_vlm_keys.py)
    settings = {"model_name_or_path": "model", **LAYOUTS[layout], "output_dir": f"saves/{family}/{layout}/sft",
                "cutoff_len": ROWS.get(family, 96), "max_steps": 1, "gradient_accumulation_steps": 2, "bf16": False}
    if dataset is not None:
        settings["dataset"] = dataset
    c = load(files.run_yaml("run.yaml", **settings), ["device=cpu"])
    assert c.hbm_budget is None
    assert run(c)["steps"] == 1
    row, = log.read(os.path.join(c.run_dir, "log.csv"))
    assert math.isfinite(float(row["loss"]))
    media = "pixel_values_videos" if dataset == "mllm_video_demo" else "pixel_values"
    assert len(given) == c.grad_accum and (all if dataset else any)(media in kw for kw in given)

    eager = AutoModelForImageTextToText.from_pretrained("model", dtype=torch.float32)
    with torch.no_grad():
        losses = [eager(**kw).loss.item() for kw in given]
    # the step's loss as the Trainer logs it: each micro-batch's weighted by its target tokens
    counted = [int((kw["labels"][:, 1:] != -100).sum()) for kw in given]
    assert float(row["loss"]) == pytest.approx(sum(n * x for n, x in zip(counted, losses)) / sum(counted), rel=1e-5)

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
