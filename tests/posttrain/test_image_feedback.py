"""stage kto on a vision-language model: LlamaFactory's kto_tag layout with an `images` column for a
tiny Qwen2.5-VL folder (tests/train/qwen_files.py). An example's row and its KL row (its prompt,
another example's answer) hold its prompt's images; a run from run.yaml trains with no
hbm_budget, its reference log-probabilities of both rows are eager transformers' with the pixels,
and its export carries the processor's files; the objective trains through the engine as eager
torch.optim.AdamW trains it."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from PIL import Image

from megacompile.posttrain import KTOLoss, KTOObjective, kl_estimate
from megacompile.posttrain.logprobs import sequence_logprobs
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages import kind
from tests.posttrain import image_pair_files
from tests.posttrain.test_parity import as_eagerly
from tests.train import files, qwen_files

PAD = "<|image_pad|>"


def _settings(tmp_path, **more) -> dict:
    return {"model_name_or_path": str(tmp_path / "model"), "stage": "kto", "dataset": "kto_mllm",
            "dataset_dir": str(tmp_path / "data"), "finetuning_type": "full", "cutoff_len": 32,
            "per_device_train_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2,
            "learning_rate": 1e-2, "lr_scheduler_type": "constant", "pref_beta": 0.1, "logging_steps": 1,
            "output_dir": str(tmp_path / "run"), "bf16": False, **more}


def test_an_examples_row_and_its_kl_row_hold_its_prompts_images(tmp_path):
    qwen_files.model_dir(str(tmp_path / "model"))
    image_pair_files.kto_tagged(str(tmp_path / "data"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), ["device=cpu"])
    stage = kind(c)(c, load_tokenizer(c.model, None), None)
    tok = load_tokenizer(c.model, None)
    pad = tok.convert_tokens_to_ids(PAD)
    with open(tmp_path / "data" / "kto_mllm.json") as f:
        records = json.load(f)
    assert [e.desirable for e in stage.examples] == [r["label"] for r in records]
    for example, record in zip(stage.examples, records):
        assert example.media == (str(tmp_path / "data" / record["images"][0]),)
        assert example.prompt.count(pad) == 4 and pad not in example.completion
        assert tok.convert_ids_to_tokens(list(example.completion))[:3] == record["messages"][1]["content"].split()
    items = [0, 3]
    rows, kl, _ = stage._rows(stage.examples, items, stage.partners)
    written = stage.media.image_processor(images=[Image.open(stage.examples[i].media[0]).convert("RGB")
                                                  for i in items], return_tensors="pt")
    for batch in (rows, kl):
        assert torch.equal(batch["pixel_values"], written["pixel_values"])
        assert torch.equal(batch["mm_token_type_ids"], (batch["input_ids"] == pad).long())
    partner = stage.examples[stage.partners[3]]
    assert kl["labels"][1][kl["labels"][1] != -100].tolist() == list(partner.completion)
    assert kl["input_ids"][1, :len(stage.examples[3].prompt)].tolist() == list(stage.examples[3].prompt)


def test_kto_with_images_trains_from_run_yaml_and_its_reference_is_eagers_with_the_pixels(tmp_path):
    from transformers import AutoModelForImageTextToText
    qwen_files.model_dir(str(tmp_path / "model"))
    image_pair_files.kto_tagged(str(tmp_path / "data"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), ["device=cpu"])
    assert c.hbm_budget is None
    assert run(c)["steps"] == 2
    rows = log.read(os.path.join(c.run_dir, "log.csv"))
    assert len(rows) == 2 and float(rows[1]["kl"]) != 0.0
    table = torch.load(os.path.join(c.run_dir, "reference_logps.pt"))["train"]
    stage = kind(c)(c, load_tokenizer(c.model, None), None)
    eager = AutoModelForImageTextToText.from_pretrained(c.model, dtype=torch.float32).eval()
    with torch.no_grad():
        for lo in range(0, len(stage.examples), c.batch):
            items = list(range(lo, lo + c.batch))
            for column, batch in enumerate(stage._rows(stage.examples, items, stage.partners)[:2]):
                batch = dict(batch)
                labels = batch.pop("labels")
                assert "pixel_values" in batch
                assert sequence_logprobs(eager(**batch).logits, labels).tolist() == \
                    pytest.approx(table[items, column].tolist(), rel=1e-5, abs=1e-5)
    with open(os.path.join(c.run_dir, "preprocessor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen2_5_VLProcessor"
    assert AutoModelForImageTextToText.from_pretrained(c.run_dir) is not None


def test_kto_with_images_trains_through_the_engine_as_eagerly(tmp_path):
    """The stage's micro-batches (rows with pixels, the KL estimate from KL rows with pixels)
    through KTOObjective over the Qwen2.5-VL: 3 steps at twice the weights' bytes give eager
    torch.optim.AdamW's losses and first moments to 1e-5 and its weights to the float32 noise floor."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    qwen_files.model_dir(str(tmp_path / "model"))
    image_pair_files.kto_tagged(str(tmp_path / "data"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), ["device=cpu"])
    stage = kind(c)(c, load_tokenizer(c.model, None), None)
    policy = Qwen2_5_VLForConditionalGeneration.from_pretrained(c.model, dtype=torch.float32)
    make = lambda: KTOObjective(copy.deepcopy(policy), KTOLoss(beta=0.5, desirable_weight=1.3))  # noqa: E731
    reference, batches = make(), []
    with torch.no_grad():
        for items in ([0, 1], [2, 3], [4, 5]):
            rows, kl_rows, desirable = stage._rows(stage.examples, items, stage.partners)
            ref, kl_ref = reference(**rows), reference(**kl_rows)
            kl = kl_estimate(kl_ref + 0.05, kl_ref)     # the policy's KL rows a little off the reference's
            batches.append({**rows, "ref_logps": ref - 0.1, "desirable": desirable, "kl": kl})
    weights = sum(p.numel() * 4 for p in policy.parameters())
    as_eagerly(make, batches, 2 * weights / 2 ** 30)[0].close()


def test_paired_records_with_images_make_the_examples_stage_dpo_makes_of_them(tmp_path):
    """TRL's paired layout (the prompt's turn of an image part and text) under kto: each record two
    examples, its chosen answer desirable and its rejected one not (TRL's order: the records' chosen
    ones, then their rejected ones), with the prompt, completions and images stage dpo reads."""
    model = qwen_files.model_dir(str(tmp_path / "model"))
    data = image_pair_files.trl_records(str(tmp_path / "trl.jsonl"), 2)
    template = image_pair_files.parts_template(str(tmp_path / "parts.jinja"))
    made = {}
    for stage in ("kto", "dpo"):
        c = load(files.run_yaml(str(tmp_path / f"{stage}.yaml"), model=model, stage=stage, data=data,
                                chat_template=template, batch=2, seq=32, steps=1, device="cpu",
                                run_dir=str(tmp_path / stage)), [])
        made[stage] = kind(c)(c, load_tokenizer(model, c.chat_template), None)
    pairs, examples = made["dpo"].pairs, made["kto"].examples
    assert [e.desirable for e in examples] == [True, True, False, False]
    for i, pair in enumerate(pairs):
        for example, completion in ((examples[i], pair.chosen), (examples[2 + i], pair.rejected)):
            assert (example.prompt, example.completion, example.media) == (pair.prompt, completion, pair.media)
            assert pair.media and example.prompt.count(made["kto"].text_tokenizer.convert_tokens_to_ids(PAD)) > 0
