"""`megacompile train` on records with images: a tiny LLaVA saved with its processor, PNG files
and LLaVA-layout chat records (some without an image) under a run.yaml with an eval file,
checkpoints, a resume and an export."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from megacompile.train.data.images import Media
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests.train import files, vlm_files


def _work(tmp_path) -> dict:
    model = vlm_files.model_dir(str(tmp_path / "model"))
    return {"model": model, "data": vlm_files.records(str(tmp_path / "data.jsonl"), 12),
            "eval": vlm_files.records(str(tmp_path / "eval.jsonl"), 4, text_every=2)}


def _tokens(tmp_path, work: dict, split: str = "data"):
    media = Media(work["model"])
    tokenizer = load_tokenizer(work["model"])
    return media, token_file(str(tmp_path / "tokens"), "train", [work[split]], tokenizer, work["model"], False, media)


def _records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_image_tokens_are_widened_and_masked_with_the_prompt(tmp_path):
    work = _work(tmp_path)
    media, tokens = _tokens(tmp_path, work)
    records = _records(work["data"])
    assert sorted(tokens.images) == [i for i, r in enumerate(records) if "images" in r] != []
    image_id = media.token_id
    for doc, record in enumerate(records):
        ids = np.asarray(tokens.ids[tokens.docs[doc]:tokens.docs[doc + 1]]).tolist()
        targets = np.asarray(tokens.targets[tokens.docs[doc]:tokens.docs[doc + 1]]).astype(bool)
        at = [i for i, t in enumerate(ids) if t == image_id]
        if "images" not in record:
            assert at == []
            continue
        where, paths = tokens.images[doc]
        assert where == f"{work['data']}:{doc + 1}"
        assert paths == [str(tmp_path / p) for p in record["images"]]
        assert at == list(range(at[0], at[0] + vlm_files.IMAGE_TOKENS))     # one token per vision feature
        assert not targets[:at[-1] + 1].any()       # the image and the prompt around it: not targets
        answer = media.processor.tokenizer(record["messages"][1]["content"], add_special_tokens=False)["input_ids"]
        counted = [t for t, on in zip(ids, targets) if on]
        assert counted[:len(answer)] == answer and len(counted) <= len(answer) + 2     # its end, the EOS
    pixels = media.pixels(tokens.images[0][1])
    assert pixels.shape == (1, 3, vlm_files.IMAGE, vlm_files.IMAGE)


def test_documents_with_images_fill_rows_of_their_own_and_bring_their_pixels(tmp_path):
    work = _work(tmp_path)
    media, tokens = _tokens(tmp_path, work)
    rows = packing.Rows(tokens, 48, True, 0, pad_id=0, pixels=media.inputs)
    text_docs = [d for d in range(tokens.n_docs) if d not in tokens.images]
    assert text_docs and len(tokens.images) < rows.rows_per_epoch <= tokens.n_docs
    for start in range(rows.rows_per_epoch - 1):
        inputs = packing.batch(rows, start, 2, shifted=False)
        images = sum(d in tokens.images for i in range(2) for d in rows.documents(start + i))
        assert int((inputs["input_ids"] == media.token_id).sum()) == images * vlm_files.IMAGE_TOKENS
        assert ("pixel_values" in inputs) == (images > 0)
        if images:
            assert inputs["pixel_values"].shape[0] == images
        for i in range(2):
            row = inputs["input_ids"][i]
            if (row == media.token_id).any():       # the document starts the row; the rest is padding
                doc = rows.documents(start + i)
                assert len(doc) == 1
                n = int(tokens.docs[doc[0] + 1] - tokens.docs[doc[0]])
                assert torch.equal(row[:n], torch.from_numpy(tokens.ids[tokens.docs[doc[0]]:tokens.docs[doc[0] + 1]]
                                                             .astype(np.int64)))
                assert (row[n:] == 0).all() and (inputs["labels"][i, n:] == packing.IGNORE).all()
    with pytest.raises(ArgumentError, match=rf"data.jsonl:1: the record has images and is \d+ tokens, longer than "
                                            r"a row \(20\)"):
        packing.Rows(tokens, 20, True, 0)


def _write(path: str, records: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def test_bad_image_records_are_refused_naming_the_line_before_any_file_is_written(tmp_path):
    work = _work(tmp_path)
    good = _records(work["data"])
    missing = [*good[:2], {**good[0], "images": ["images/gone.png"]}]
    two = [*good[:1], {**good[1], "images": good[1]["images"] * 2}]
    stray = [{"messages": [{"role": "user", "content": "<image> what is this"},
                           {"role": "assistant", "content": "red"}]}]
    for records, message in (
            (missing, r"bad.jsonl:3: image images/gone.png is not there"),
            (two, r"bad.jsonl:2: the turns hold 1 <image> placeholder \(image parts counted\) and images lists 2 files"),
            (stray, r"bad.jsonl:1: the turns hold 1 <image> placeholder \(image parts counted\) and images lists 0 files")):
        data = _write(str(tmp_path / "bad.jsonl"), records)
        config = files.run_yaml(str(tmp_path / "run.yaml"), model="model", data=data, seq=48, steps=1,
                                device="cpu", run_dir="run")
        with pytest.raises(ArgumentError, match=message):
            run(load(config, []))
        assert not os.path.exists(tmp_path / "run")
    text_model = files.model_dir(str(tmp_path / "llama"))
    config = files.run_yaml(str(tmp_path / "run.yaml"), model=text_model, data=work["data"], seq=48, steps=1,
                            device="cpu", run_dir="run")
    with pytest.raises(ArgumentError, match=r"data.jsonl:1: the record has images, and they are read only with "
                                            r"the model folder's processor"):
        run(load(config, []))
    assert not os.path.exists(tmp_path / "run")


def _settings(name: str, **over) -> dict:
    return vlm_files.settings(name, 48, 5, **over)


def _eager(c, tmp_path) -> list[float]:
    """The run's batches (its rows, as it reads them) through transformers' LLaVA and
    torch.optim.AdamW."""
    from transformers import LlavaForConditionalGeneration
    media, tokens = _tokens(tmp_path / "eager", {"data": str(tmp_path / "data.jsonl"), "model": c.model})
    rows = packing.Rows(tokens, c.seq, c.packing, c.seed, pad_id=load_tokenizer(c.model).pad_token_id,
                        pixels=media.inputs)
    return vlm_files.eager(c, LlavaForConditionalGeneration.from_pretrained(c.model, dtype=torch.float32), rows,
                           "pixel_values")


@pytest.mark.long   # three runs of a LLaVA and its evaluations with and without an image: 45-100 s on 2 cores
def test_a_vlm_run_trains_as_eagerly_resumes_exactly_and_exports_a_model_that_generates(tmp_path, monkeypatch):
    _work(tmp_path)
    monkeypatch.chdir(tmp_path)
    whole_config = load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings("whole")), [])
    whole = run(whole_config)
    rows = log.read(str(tmp_path / "whole" / "log.csv"))
    assert len(rows) == 5
    evals = [float(r["eval_loss"]) for r in rows if r["eval_loss"]]
    assert len(evals) == 3 and evals[-1] < evals[0]         # it learns: the held-out loss goes down
    eager = _eager(whole_config, tmp_path)
    torch.testing.assert_close(torch.tensor([float(r["loss"]) for r in rows]), torch.tensor(eager), rtol=1e-5, atol=0)

    # cut after step 3 (a checkpoint at 2), resumed with resume: auto
    assert whole["steps"] == 5
    vlm_files.resumes_as_whole(tmp_path, monkeypatch, _settings("cut"), 3, 5)

    # the export: the model and its processor, as transformers loads them; it answers an image
    from PIL import Image
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    export = str(tmp_path / "cut-export")
    assert {"processor_config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(export))
    processor = AutoProcessor.from_pretrained(export)
    model = LlavaForConditionalGeneration.from_pretrained(export)
    whole_model = LlavaForConditionalGeneration.from_pretrained(str(tmp_path / "whole-export")).state_dict()
    assert all(torch.equal(v, whole_model[k]) for k, v in model.state_dict().items())
    prompt = processor.apply_chat_template([{"role": "user", "content": "<image> what colour is this"}],
                                           add_generation_prompt=True)
    inputs = processor(text=prompt, images=[Image.open(tmp_path / "images" / "red.png")], return_tensors="pt")
    assert int((inputs["input_ids"] == processor.image_token_id).sum()) == vlm_files.IMAGE_TOKENS
    out = model.generate(**inputs, max_new_tokens=3, do_sample=False)
    assert out.shape[1] > inputs["input_ids"].shape[1]


def test_llamafactory_multimodal_dataset_reads_as_the_same_records(tmp_path):
    """LlamaFactory's mllm_demo layout: a JSON array named in dataset_info.json, `messages` with
    role/content tags and an `images` column; the same tokens and images as the jsonl."""
    work = _work(tmp_path)
    records = _records(work["data"])
    with open(tmp_path / "mllm.json", "w") as f:
        json.dump([{"turns": r["messages"], **({"pictures": r["images"]} if "images" in r else {})}
                   for r in records], f)
    with open(tmp_path / "dataset_info.json", "w") as f:
        json.dump({"mllm": {"file_name": "mllm.json", "formatting": "sharegpt",
                            "columns": {"messages": "turns", "images": "pictures"},
                            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                     "assistant_tag": "assistant"}}}, f)
    c = load(files.run_yaml(str(tmp_path / "lf.yaml"), model_name_or_path="model", dataset="mllm", dataset_dir=".",
                            cutoff_len=48, max_steps=1, device="cpu"), [])
    media, ours = _tokens(tmp_path, work)
    theirs = token_file(str(tmp_path / "lf-tokens"), "train", c.data, load_tokenizer(work["model"]), work["model"],
                        False, media)
    assert np.array_equal(ours.ids, theirs.ids) and np.array_equal(ours.targets, theirs.targets)
    assert [p for _, p in ours.images.values()] == [p for _, p in theirs.images.values()]
