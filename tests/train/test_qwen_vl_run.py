"""`megacompile train` on records with images for a tiny Qwen2.5-VL folder (qwen_files.py): each
image widened to its grid's tokens, micro-batches as Qwen2_5_VLProcessor writes them, losses as
eager torch.optim.AdamW's, a resume to the uninterrupted run's log, and an export transformers
loads with its processor's files and generates from."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train.data import grid_images, packing
from megacompile.train import load, log, run
from megacompile.train.data.grid_images import GridMedia
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests.train import files, qwen_files, vlm_files


def _work(tmp_path, family: str = "qwen2_5_vl") -> dict:
    return {"model": qwen_files.model_dir(str(tmp_path / "model"), family=family),
            "data": qwen_files.records(str(tmp_path / "data.jsonl"), 12),
            "eval": qwen_files.records(str(tmp_path / "eval.jsonl"), 4, text_every=2)}


def _tokens(folder, model: str, data: str):
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    return media, tokenizer, token_file(str(folder / "tokens"), "train", [data], tokenizer, model, False, media)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_each_image_fills_its_grids_tokens_and_micro_batches_are_the_processors(tmp_path):
    """Images of two sizes widen to 4 and 2 tokens, none a target; a micro-batch's pixel_values,
    image_grid_thw and mm_token_type_ids are what the image processor writes for its images taken
    together and where the image tokens are, rows without images beside rows with them."""
    work = _work(tmp_path)
    media, tokenizer, tokens = _tokens(tmp_path, work["model"], work["data"])
    assert isinstance(media, GridMedia)
    records = _records(work["data"])
    colour = {f"images/{c}.png": c for c in qwen_files.SIZES}
    pad, start, end = (tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>",
                                                                      "<|vision_end|>"))
    assert sorted(tokens.images) == [i for i, r in enumerate(records) if "images" in r] != []
    for doc, record in enumerate(records):
        ids = np.asarray(tokens.ids[tokens.docs[doc]:tokens.docs[doc + 1]]).tolist()
        targets = np.asarray(tokens.targets[tokens.docs[doc]:tokens.docs[doc + 1]]).astype(bool)
        at = [i for i, t in enumerate(ids) if t == pad]
        if "images" not in record:
            assert at == [] and start not in ids
            continue
        n = qwen_files.TOKENS[colour[record["images"][0]]]
        assert at == list(range(at[0], at[0] + n)) and ids[at[0] - 1] == start and ids[at[-1] + 1] == end
        assert not targets[:at[-1] + 2].any()
        assert targets.any()
    assert {qwen_files.TOKENS[colour[r["images"][0]]] for r in records if "images" in r} == {2, 4}

    rows = packing.Rows(tokens, 32, True, 3, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    mixed = 0
    for first in range(0, rows.rows_per_epoch - 1, 2):
        inputs = packing.batch(rows, first, 2, shifted=False)
        paths = [p for i in range(2) for p in rows.images(first + i)]
        if not paths:
            assert set(inputs) == {"input_ids", "labels"}
            continue
        mixed += any(not rows.images(first + i) for i in range(2))
        from PIL import Image
        written = media.image_processor(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
        assert torch.equal(inputs["pixel_values"], written["pixel_values"])
        assert torch.equal(inputs["image_grid_thw"], written["image_grid_thw"])
        assert [tuple(g) for g in inputs["image_grid_thw"].tolist()] == \
               [qwen_files.GRIDS[colour[os.path.relpath(p, tmp_path)]] for p in paths]
        assert torch.equal(inputs["mm_token_type_ids"], (inputs["input_ids"] == pad).long())
        assert int(inputs["mm_token_type_ids"].sum()) == sum(int(g.prod()) // 4 for g in inputs["image_grid_thw"])
        assert (inputs["labels"][inputs["input_ids"] == pad] == packing.IGNORE).all()
    assert mixed        # a micro-batch with a row of text beside a row with an image


def test_isolated_packing_is_refused_with_images_before_any_file_is_written(tmp_path):
    work = _work(tmp_path)
    config = files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=work["data"], seq=32, steps=1,
                            packing="isolated", device="cpu", run_dir=str(tmp_path / "run"))
    with pytest.raises(ArgumentError, match=r"packing: isolated gives each document 1D position ids, and "
                                            r".*data.jsonl:1 has images"):
        run(load(config, []))
    assert not os.path.exists(tmp_path / "run")


def _settings(name: str, **over) -> dict:
    # seed 3: every micro-batch of the 4 steps holds an image (the run checks it)
    return vlm_files.settings(name, 32, 4, **over)


def _eager(c, tmp_path) -> list[float]:
    """The run's micro-batches (its rows, as it reads them) through transformers' model (Qwen2.5-VL
    or Qwen3-VL) and torch.optim.AdamW; the model builds its 3D positions itself."""
    from transformers import AutoModelForImageTextToText
    os.makedirs(tmp_path / "eager")
    media, tokenizer, tokens = _tokens(tmp_path / "eager", c.model, str(tmp_path / "data.jsonl"))
    rows = packing.Rows(tokens, c.seq, c.packing, c.seed, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    return vlm_files.eager(c, AutoModelForImageTextToText.from_pretrained(c.model, dtype=torch.float32), rows,
                           "image_grid_thw")


@pytest.mark.long   # 4 steps of a Qwen3-VL run beside eager AdamW, an export and a generation: 25-100 s on 2 cores
def test_a_qwen3_vl_run_trains_as_eagerly_and_exports_a_model_that_generates_from_an_image(tmp_path, monkeypatch):
    """The same records through a Qwen3-VL folder (Qwen3VLProcessor's files): its deepstack trains
    from files as eagerly, and transformers loads the export and answers an image with it."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLForConditionalGeneration
    _work(tmp_path, family="qwen3_vl")
    monkeypatch.chdir(tmp_path)
    config = load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings("whole")), [])
    assert isinstance(grid_images.media(config.model), GridMedia)
    run(config)
    rows = log.read(str(tmp_path / "whole" / "log.csv"))
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in rows]), torch.tensor(_eager(config, tmp_path)),
                               rtol=1e-5, atol=0)
    export = str(tmp_path / "whole-export")
    with open(os.path.join(export, "preprocessor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen3VLProcessor"
    model = Qwen3VLForConditionalGeneration.from_pretrained(export)
    trained, start = model.state_dict(), Qwen3VLForConditionalGeneration.from_pretrained(config.model).state_dict()
    assert trained.keys() == start.keys()
    assert not torch.equal(trained["model.visual.deepstack_merger_list.0.linear_fc1.weight"],
                           start["model.visual.deepstack_merger_list.0.linear_fc1.weight"])   # the mergers trained
    tokenizer, image_processor = AutoTokenizer.from_pretrained(export), AutoImageProcessor.from_pretrained(export)
    pixels = image_processor(images=[Image.open(tmp_path / "images" / "blue.png")], return_tensors="pt")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|> what colour is this"}],
        add_generation_prompt=True, tokenize=False)
    ids = tokenizer(prompt.replace("<|image_pad|>", "<|image_pad|>" * qwen_files.TOKENS["blue"]),
                    return_tensors="pt")["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out = model.generate(input_ids=ids, mm_token_type_ids=(ids == pad).long(), **pixels, max_new_tokens=3,
                         do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.long   # 4 steps of a Qwen2.5-VL run beside eager AdamW, a capture per set of grids: 50-120 s on 2 cores
def test_a_qwen_vl_run_trains_as_eagerly_capturing_each_set_of_grids_once(tmp_path, monkeypatch):
    """Micro-batches of one and two images of two sizes: the losses are eager's; the first
    micro-batch's grids are captured once before the first step (for the budget and the engine
    alike), beside the heaviest micro-batch's (for the budget), and a step captures only at grids
    the engine has not met."""
    import megacompile.capture as capture_room
    from megacompile.engine import Engine
    _work(tmp_path)
    monkeypatch.chdir(tmp_path)
    captures, steps = [0], []
    trace_top, step = capture_room.trace_top, Engine.weighted_step

    def counted_trace(*args, **kwargs):
        captures[0] += 1
        return trace_top(*args, **kwargs)

    def counted_step(self, weight, **inputs):
        before = captures[0]
        out = step(self, weight, **inputs)
        steps.append((before, captures[0] - before, tuple(map(tuple, inputs["image_grid_thw"].tolist()))))
        return out
    monkeypatch.setattr(capture_room, "trace_top", counted_trace)
    monkeypatch.setattr(Engine, "weighted_step", counted_step)
    # packed (whole records): rows of two records mix the grids of one and two images
    config = load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings("whole", export=None, packing=True)), [])
    run(config)
    rows = log.read(str(tmp_path / "whole" / "log.csv"))
    assert len(rows) == 4 and sum(1 for r in rows if r["eval_loss"]) == 2
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in rows]), torch.tensor(_eager(config, tmp_path)),
                               rtol=1e-5, atol=0)
    # before the first step: its grids once (for the budget and the engine alike), and the grids of
    # the micro-batch with the most image tokens, whose smallest plan the default budget fits too
    assert steps[0][:2] == (2, 0)
    grids = [g for _, _, g in steps]
    assert len(set(grids)) > 2 and {len(g) for g in grids} == {1, 2}
    assert [new for _, new, _ in steps[1:]] == [int(g not in grids[:i]) for i, g in enumerate(grids) if i]


# Two runs and a resume of a Qwen2.5-VL, its evaluations and a generation: 100-230 s on 2 cores. In
# CI: the LLaVA run's exact resume (test_vlm_run.py) and the Qwen runs above.
@pytest.mark.long
def test_a_qwen_vl_run_resumes_exactly_and_exports_a_model_that_generates_from_an_image(tmp_path, monkeypatch):
    _work(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings("whole")), []))["steps"] == 4
    # cut after step 3 (a checkpoint at 2), resumed with resume: auto
    vlm_files.resumes_as_whole(tmp_path, monkeypatch, _settings("cut"), 3, 4)

    # the export, as transformers loads it without torchvision: the processor's image processor
    # (its PIL class) and tokenizer from the export's files, the model; it answers an image
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    export = str(tmp_path / "cut-export")
    assert {"preprocessor_config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(export))
    with open(os.path.join(export, "preprocessor_config.json")) as f:
        assert json.load(f)["processor_class"] == "Qwen2_5_VLProcessor"
    image_processor = AutoImageProcessor.from_pretrained(export)
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(export)
    whole_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "whole-export")).state_dict()
    assert model.state_dict().keys() == whole_model.keys()
    assert all(torch.equal(v, whole_model[k]) for k, v in model.state_dict().items())
    pixels = image_processor(images=[Image.open(tmp_path / "images" / "blue.png")], return_tensors="pt")
    assert pixels["image_grid_thw"].tolist() == [list(qwen_files.GRIDS["blue"])]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|> what colour is this"}],
        add_generation_prompt=True, tokenize=False)
    # widened as the processor widens it
    prompt = prompt.replace("<|image_pad|>", "<|image_pad|>" * qwen_files.TOKENS["blue"])
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    out = model.generate(input_ids=ids, mm_token_type_ids=(ids == pad).long(), **pixels, max_new_tokens=3,
                         do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.slow   # 5 steps of a Qwen2.5-VL run, a capture per new set of grids: ~60 s on 2 cores
def test_the_default_budget_fits_the_micro_batch_with_the_most_image_tokens(tmp_path, monkeypatch):
    """Without hbm_budget the cpu budget is sized from the smallest plan of the micro-batch of an
    epoch with the most image tokens too, not the first alone: seed 1's first micro-batch holds a
    smaller image than a later one, which the first's budget would refuse mid-run."""
    _work(tmp_path)
    monkeypatch.chdir(tmp_path)
    settings = vlm_files.settings("heavy", 32, 5, batch=1, seed=1, export=None, save_every=5)
    del settings["eval"], settings["eval_every"]
    result = run(load(files.run_yaml(str(tmp_path / "heavy.yaml"), **settings), []))
    rows = log.read(str(tmp_path / "heavy" / "log.csv"))
    assert result["steps"] == 5 and len(rows) == 5
    assert all(np.isfinite(float(r["loss"])) for r in rows)
