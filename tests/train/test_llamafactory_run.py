"""A run configured in LlamaFactory's shape (their full-SFT example's keys, the data named in a
dataset_info.json) trains exactly as the same run under megacompile's own keys: the same
log.csv, every column but the timings."""
from __future__ import annotations

import dataclasses
import json
import math
import os

from megacompile.train import load, run
from megacompile.train.log import read
from tests.train import files
from tests.train.killed import TIMED

TIMING = TIMED      # the measured columns, which differ run to run


def _rows(run_dir: str) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read(os.path.join(run_dir, "log.csv"))]


def _sharegpt(chats: str, folder: str) -> str:
    """chats.jsonl's conversations as LlamaFactory's ShareGPT file, named `identity` in
    folder/dataset_info.json."""
    os.makedirs(folder)
    with open(chats) as f:
        records = [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                                      for m in json.loads(line)["messages"]]} for line in f]
    path = os.path.join(folder, "identity.json")
    with open(path, "w") as f:
        json.dump(records, f)
    with open(os.path.join(folder, "dataset_info.json"), "w") as f:
        json.dump({"identity": {"file_name": "identity.json", "formatting": "sharegpt"}}, f)
    return path


LLAMA3 = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def test_llamafactory_names_and_own_names_train_the_same_run(tmp_path):
    tok = files.tokenizer(words=["system", "user", "assistant"], special=LLAMA3)
    tok.add_special_tokens({"additional_special_tokens": LLAMA3})      # template llama3 writes them
    made = {"model": files.model_dir(str(tmp_path / "model"), tok=tok),
            "chats": files.chats(str(tmp_path / "chats.jsonl"))}
    sharegpt = _sharegpt(made["chats"], str(tmp_path / "data"))
    lr, rate = 1.0e-3, 0.1
    llamafactory = files.run_yaml(
        str(tmp_path / "lf.yaml"),
        model_name_or_path="model", trust_remote_code=True,
        stage="sft", do_train=True,
        dataset="identity", dataset_dir="data",
        template="llama3", cutoff_len=32, max_samples=1000, overwrite_cache=True, preprocessing_num_workers=16,
        dataloader_num_workers=4,
        output_dir="saves/lf", logging_steps=1, save_steps=3, plot_loss=True, overwrite_output_dir=True,
        save_only_model=False, report_to="none",
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=lr, num_train_epochs=2.0,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": rate}, warmup_ratio=0.25,
        bf16=False, ddp_timeout=180000000, resume_from_checkpoint=None,
        val_size=0.2, per_device_eval_batch_size=1, eval_strategy="steps", eval_steps=2,
        adam_beta2=0.95, weight_decay=0.01, seed=3,
        device="cpu")
    own = files.run_yaml(
        str(tmp_path / "own.yaml"),
        model="model", data=sharegpt, template="llama3", seq=32, max_samples=1000, run_dir="saves/own", log_every=1, save_every=3, log="csv",
        plot_loss=True,
        batch=2, grad_accum=2, lr=lr, epochs=2.0, schedule="cosine", min_lr=lr * rate, warmup=0.25,
        compute_dtype="float32", eval_fraction=0.2, eval_every=2, eval_batch=1, betas=[0.9, 0.95], weight_decay=0.01,
        seed=3,
        device="cpu")
    a, b = load(llamafactory), load(own)
    assert [e["path"] for e in a.data] == [e["path"] for e in b.data] == [sharegpt]
    # the same settings, field for field (the data named by dataset_info.json or by its path), but
    # preprocessing_num_workers: the same token file from that many processes (the logs below)
    assert a.tokenize_workers == min(16, os.cpu_count() or 1) and b.tokenize_workers == 1
    assert dataclasses.replace(a, run_dir=b.run_dir, data=b.data, dataset=None, dataset_dir=b.dataset_dir,
                               tokenize_workers=1) == b
    run(a)
    run(b)
    lf_rows, own_rows = _rows(str(tmp_path / "saves/lf")), _rows(str(tmp_path / "saves/own"))
    assert len(lf_rows) == a.steps >= 4
    assert a.warmup == b.warmup == math.ceil(a.steps * 0.25)     # the ratio of the steps the epochs gave
    assert any(row["eval_loss"] for row in lf_rows)
    assert lf_rows == own_rows
