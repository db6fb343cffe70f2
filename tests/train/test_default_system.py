"""LlamaFactory's default_system: every conversation without a system message of its own gets it
(as its first turn, or as the system column its layout reads), in every layout and stage; a
record's own system wins, and text records are left alone."""
from __future__ import annotations

import json

from megacompile.train import load
from megacompile.train.data import entries, tokens
from megacompile.train.data.reading import records
from megacompile.train.data.system import with_default
from tests.train import files

SYSTEM = "we like to read books at night"
USER, ANSWER = {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}


def test_each_layout_gets_the_system_message_where_it_has_none():
    head = {"role": "system", "content": SYSTEM}
    assert with_default({"messages": [USER, ANSWER]}, SYSTEM) == {"messages": [head, USER, ANSWER]}
    sharegpt = {"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "i am fine"}]}
    assert with_default(sharegpt, SYSTEM) == {**sharegpt, "system": SYSTEM}
    assert with_default({"instruction": "hello", "output": "fine"}, SYSTEM)["system"] == SYSTEM
    assert with_default({"prompt": [USER], "completion": [ANSWER]}, SYSTEM)["prompt"] == [head, USER]
    # a record's own system wins; text has no conversation
    own = {"messages": [{"role": "system", "content": "be brief"}, USER, ANSWER]}
    for record in (own, {**sharegpt, "system": "be brief"}, {"conversations": [{"from": "system", "value": "x"}]},
                   {"text": "the cat sat"}, {"prompt": "the cat", "completion": "sat"}):
        assert with_default(record, SYSTEM) is record


def test_a_run_trains_its_chats_with_the_default_system(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": [USER, ANSWER]}) + "\n")
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=files.model_dir(str(tmp_path / "model")),
                            data=str(data), default_system=SYSTEM, steps=1), [])
    (where, record), = records(c.data[0])
    tok = files.tokenizer()
    ids, targets = tokens.encode(tok, record, False, where)
    assert tok.convert_ids_to_tokens(ids)[:6] == ["<|system|>", "we", "like", "to", "read", "books"]
    assert (ids, targets) == tokens.encode(tok, {"messages": [{"role": "system", "content": SYSTEM}, USER, ANSWER]},
                                           False, where)
    # the token files are made again under another default_system
    key = [entries.check("data", [str(data)], False, False)[0], dict(c.data[0])]
    assert tokens.fingerprint(key[:1], None, False) != tokens.fingerprint(key[1:], None, False)


def test_llamafactorys_other_data_keys_are_noted_or_refused_by_name(tmp_path, capsys):
    import pytest

    from megacompile.errors import ArgumentError
    common = dict(model=files.model_dir(str(tmp_path / "model")), data=files.chats(str(tmp_path / "c.jsonl")), steps=1)
    load(files.run_yaml(str(tmp_path / "a.yaml"), tool_format="qwen", buffer_size=16384, preprocessing_batch_size=1000,
                        ignore_pad_token_for_loss=True, data_shared_file_system=False, eval_num_beams=None, **common),
         [])
    note = capsys.readouterr().out
    for said in ("tool_format (tools are written by the model's chat template)",
                 "buffer_size (streamed data is read in file order, with no shuffle buffer)",
                 "ignore_pad_token_for_loss (padding is never counted)"):
        assert said in note
    with pytest.raises(ArgumentError, match="use_galore -> not supported"):
        load(files.run_yaml(str(tmp_path / "b.yaml"), use_galore=True, **common), [])
