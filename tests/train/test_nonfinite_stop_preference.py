"""A run of stage dpo, kto or rm stopped by a step whose loss is inf or NaN (on_nonfinite: raise)
names the records of the micro-batch that failed by file and line, in the words stage sft names
its rows' (test_nonfinite_stop.py): dpo's and rm's pairs, kto's examples (and the records its KL
rows' completions came from)."""
from __future__ import annotations

import json
import re

import pytest

from megacompile.errors import NonFiniteError
from megacompile.train import load, run
from tests.train import files
from tests.train.test_nonfinite_stop import _poison_rows_with

S = files.SENTENCES
POISONED = 8        # the line of the poisoned record: its prompt holds a word no other record holds
SEQ = 16


def _records(stage: str) -> list[dict]:
    out = []
    for i in range(10):
        prompt = ("poison " if i + 1 == POISONED else "") + S[i]
        out.append({"prompt": prompt, "completion": S[(i * 3 + 1) % 10], "label": i % 2 == 0} if stage == "kto"
                   else {"prompt": prompt, "chosen": S[(i + 1) % 10], "rejected": S[(i + 3) % 10]})
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = files.tokenizer(words=["poison"])
    poison = tok.convert_tokens_to_ids("poison")
    assert poison >= SEQ        # no row position (stage rm's `last`) reads as the poisoned token
    return files.model_dir(str(tmp_path_factory.mktemp("model")), layers=1, dim=32, tok=tok), poison


@pytest.mark.parametrize("stage, items", [("dpo", "pairs"), ("kto", "examples"), ("rm", "pairs")])
def test_a_poisoned_record_of_a_preference_stage_is_named(tmp_path, monkeypatch, model, stage, items):
    folder, poison = model
    data = str(tmp_path / "data.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _records(stage))
    _poison_rows_with(monkeypatch, poison)
    # 3 steps of 2 micro-batches of 2 draw every one of the 10 records
    with pytest.raises(NonFiniteError) as caught:
        run(load(files.run_yaml(str(tmp_path / "run.yaml"), model=folder, stage=stage, data=data, batch=2,
                                grad_accum=2, seq=SEQ, steps=3, device="cpu", hbm_budget=1,
                                run_dir=str(tmp_path / "run"), on_nonfinite="raise"), []))
    message = str(caught.value)
    assert re.match(r"step \d+ failed: the loss is nan, and on_nonfinite: raise stops the run", message), message
    # the micro-batch alone, not the step's two, and the poisoned record among those it read
    span = re.search(rf"; the micro-batch that failed \({items} (\d+) to (\d+) of the run\) held the records? ",
                     message)
    assert span and int(span[2]) == int(span[1]) + 1, message
    assert re.search(rf"held the records? {re.escape(data)}(:{POISONED};| \(lines ([0-9, ]*, )?{POISONED}[,)])",
                     message), message
    assert message.endswith("or look at the records named, mend or drop the bad one, and start a new run_dir (a "
                            "resume refuses changed data)")
