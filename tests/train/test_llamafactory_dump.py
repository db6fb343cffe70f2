"""A LlamaFactory config with every one of its keys at its default (tests/train/llamafactory_dumps/,
each field of its argument dataclasses, LlamaFactory 0.9.5) loads as a run.yaml with the model,
the dataset and the output folder given: the keys at their defaults ask for nothing, those of
another stage, another finetuning_type or its generation among them, and those of
their_llamafactory.py say nothing; its generation's max_length beside cutoff_len is not the row
length, and the run says so."""
from __future__ import annotations

import json
import os
import re

import pytest
import yaml

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.their_llamafactory import KEYS, NO_EFFECT, STAGE_KEYS
from tests.train import files

DUMP = os.path.join(os.path.dirname(__file__), "llamafactory_dumps", "defaults.yaml")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llamafactory_dump")
    (tmp / "alpaca.json").write_text(json.dumps([{"instruction": "hello there", "output": "i am fine"}] * 4))
    (tmp / "pairs.json").write_text(json.dumps([{"instruction": "hello there", "chosen": "i am fine",
                                                 "rejected": "it is late"}] * 4))
    (tmp / "dataset_info.json").write_text(json.dumps({"alpaca": {"file_name": "alpaca.json"}, "pairs": {
        "file_name": "pairs.json", "ranking": True,
        "columns": {"prompt": "instruction", "chosen": "chosen", "rejected": "rejected"}}}))
    return {"model": files.model_dir(str(tmp / "model")), "dir": tmp}


def _yaml(work, tmp_path, **more) -> str:
    with open(DUMP) as f:
        keys = yaml.safe_load(f)
    keys.update(model_name_or_path=work["model"], dataset="alpaca", dataset_dir=str(work["dir"]), do_train=True,
                output_dir=str(tmp_path / "out"), device="cpu")
    keys.update(more)
    return files.run_yaml(str(tmp_path / "run.yaml"), **keys)


def test_every_llamafactory_key_at_its_default_asks_for_nothing(work, tmp_path, capsys):
    c = load(_yaml(work, tmp_path), [])
    assert (c.seq, c.batch, c.lr, c.epochs, c.finetuning_type, c.lora_rank) == (2048, 8, 5e-5, 3.0, "lora", 8)
    assert c.chat_template_kwargs == {"enable_thinking": True} and c.loss_type is None and not c.mask_history
    said = capsys.readouterr().out
    ignored = said.split("ignored (no effect in a megacompile run): ")[1].splitlines()[0]
    named = {k for k in yaml.safe_load(open(DUMP)) if re.search(rf"(^|, ){k}( \(|,|$)", ignored)}
    assert named and not named & (KEYS.keys() | NO_EFFECT.keys() | STAGE_KEYS.keys()), named
    assert ("max_length 1024 is not read: beside cutoff_len it is LlamaFactory's generation length, which its "
            "training does not read; cutoff_len 2048 is the row length (seq)") in said


@pytest.mark.parametrize("more, check", [
    ({"swanlab_project": "other"}, "swanlab_project -> not supported"),
    ({"freeze_trainable_layers": 3}, "freeze_trainable_layers applies to finetuning_type: freeze"),
    ({"finetuning_type": "full", "lora_rank": 16}, "lora_rank applies to finetuning_type: lora"),
    ({"temperature": 0.6}, r"temperature \(stage grpo\) belongs to another stage"),
    ({"pref_beta": 0.3}, r"beta \(stage dpo or kto or grpo\) belongs to another stage"),
    ({"finetuning_type": "full"}, None),
    ({"stage": "dpo", "dataset": "pairs", "finetuning_type": "full"}, None),
])
def test_a_key_away_from_its_default_still_asks(work, tmp_path, more, check):
    """Away from LlamaFactory's default the keys of another stage or finetuning_type are refused as
    before; at it, under another finetuning_type or stage, they ask for nothing."""
    if check is None:
        load(_yaml(work, tmp_path, **more), [])
        return
    with pytest.raises(ArgumentError, match=check):
        load(_yaml(work, tmp_path, **more), [])


def test_max_length_alone_is_the_row_length_and_other_keys_say_what_they_do(work, tmp_path, capsys):
    keys = dict(model=work["model"], dataset="alpaca", dataset_dir=str(work["dir"]), run_dir=str(tmp_path / "run"),
                steps=1)
    assert load(files.run_yaml(str(tmp_path / "a.yaml"), max_length=64, **keys), []).seq == 64
    c = load(files.run_yaml(str(tmp_path / "b.yaml"), max_length=64, cutoff_len=32, pref_loss="hinge",
                            enable_thinking=False, preserve_thinking=True, **keys), [])
    assert c.seq == 32 and c.loss_type is None
    assert c.chat_template_kwargs == {"enable_thinking": False, "preserve_thinking": True}
    said = capsys.readouterr().out
    assert "pref_loss 'hinge' is not read by stage sft (as in LlamaFactory: it is stage dpo's loss)" in said
    with pytest.raises(ArgumentError, match="preserve_thinking must be true or false"):
        load(files.run_yaml(str(tmp_path / "c.yaml"), preserve_thinking="yes", **keys), [])
    with pytest.raises(ArgumentError, match="set the same setting \\(chat_template_kwargs\\) to different values"):
        load(files.run_yaml(str(tmp_path / "d.yaml"), chat_template_kwargs={"enable_thinking": True},
                            enable_thinking=False, **keys), [])
