"""`megacompile train` on Gemma 3 records with images: a tiny Gemma 3 saved with its processor
(processor_files.gemma3_dir), records of one or two images: each image as Gemma3Processor writes
it (begin-of-image, soft tokens, end-of-image), token_type_ids on the soft tokens, finite losses,
and the first step's loss transformers' on the batch Gemma3Processor makes of the same records."""
from __future__ import annotations

import json
import math

import numpy as np
import torch

from megacompile.train import load, log, run
from megacompile.train.data import packing
from megacompile.train.data.images import Media
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests.train import files, processor_files


def _processor_batch(model: str, records: list[dict], where, seq: int) -> dict:
    """Gemma3Processor's batch of these records (the template's text, images in order), each
    row closed by the EOS and padded to `seq`; labels: the tokens after the assistant's header."""
    from PIL import Image
    from transformers import AutoProcessor
    processor = AutoProcessor.from_pretrained(model)
    tok = processor.tokenizer
    texts = [processor.apply_chat_template([{**m, "content": m["content"].replace("<image>", processor.image_token)}
                                            for m in r["messages"]], tokenize=False) for r in records]
    out = processor(text=texts, images=[[Image.open(where / p).convert("RGB") for p in r["images"]] for r in records],
                    add_special_tokens=False)
    header = tok.convert_tokens_to_ids("<|assistant|>")
    ids, labels, types = [], [], []
    for row, kinds in zip(out["input_ids"], out["token_type_ids"]):
        row = row + [tok.eos_token_id]
        answer = row.index(header) + 2                  # past the header and its newline
        ids.append(row + [tok.pad_token_id] * (seq - len(row)))
        labels.append([packing.IGNORE] * answer + row[answer:] + [packing.IGNORE] * (seq - len(row)))
        types.append(kinds + [0] * (seq - len(kinds)))
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(labels), "token_type_ids": torch.tensor(types),
            "pixel_values": torch.from_numpy(np.array(out["pixel_values"]))}


def test_a_gemma3_run_trains_on_the_processors_rows_and_its_first_loss_is_transformers(tmp_path, monkeypatch):
    model = processor_files.gemma3_dir(str(tmp_path / "model"))
    data = processor_files.gemma3_records(str(tmp_path / "data.jsonl"))
    monkeypatch.chdir(tmp_path)
    settings = {"model": "model", "data": "data.jsonl", "seq": 48, "batch": 2, "steps": 3, "seed": 3, "lr": 1e-2,
                "schedule": "constant", "device": "cpu", "compute_dtype": "float32", "packing": False,
                "run_dir": "run", "log_every": 1}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    assert run(c)["steps"] == 3
    losses = [float(r["loss"]) for r in log.read(str(tmp_path / "run" / "log.csv"))]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)

    # the first step's rows, as the run reads them, and Gemma3Processor's batch of their records
    media = Media(model)
    tokens = token_file(str(tmp_path / "eager-tokens"), "train", [data], load_tokenizer(model), model, False, media)
    rows = packing.Rows(tokens, c.seq, c.packing, c.seed, pad_id=load_tokenizer(model).pad_token_id,
                        pixels=media.inputs)
    ours = packing.batch(rows, 0, c.batch, shifted=False)
    with open(data) as f:
        records = [json.loads(line) for line in f]
    first = [records[d] for i in range(c.batch) for d in rows.documents(i)]
    theirs = _processor_batch(model, first, tmp_path, c.seq)
    assert set(ours) == set(theirs)
    for key in theirs:
        assert torch.equal(ours[key], theirs[key].to(ours[key].dtype)), key
    assert int(theirs["token_type_ids"].sum()) == processor_files.GEMMA3_TOKENS * sum(len(r["images"]) for r in first)

    from transformers import Gemma3ForConditionalGeneration
    eager = Gemma3ForConditionalGeneration.from_pretrained(model, dtype=torch.float32)
    loss = eager(**theirs).loss.item()
    assert math.isclose(losses[0], loss, rel_tol=1e-5), (losses[0], loss)
