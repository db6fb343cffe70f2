"""run.yaml's `tools:` (TRL's DPOConfig.tools): the run's tools reach every conversation that names
none of its own, in stage sft and dpo, as if each record carried them; a record's own tools win,
records that are not conversations are left alone, a Python function is described by its JSON
schema, and what cannot be a tool is refused by name before anything is read."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.data import entries, tokens
from megacompile.train.data.reading import records
from megacompile.train.stages.dpo import DPOStage
from tests.posttrain import stage_files
from tests.train import files, tool_files

DESCRIBED = [{"type": "function", "function": t} for t in tool_files.TOOLS]
# get_time as a Python function beside the run.yaml: its schema is what transformers writes for it
MODULE = '''
def get_time(city: str):
    """The time now in a city.

    Args:
        city: the city to ask about
    """
    return "noon"


def undocumented(city):
    return city
'''


def _without_tools(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "tools"}


def _sft(tmp_path, rows: list[dict], **settings):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load(files.run_yaml(str(tmp_path / "run.yaml"), model=files.model_dir(str(tmp_path / "model")),
                               data=str(data), steps=1, **settings), [])


def test_sft_conversations_without_tools_train_as_if_each_carried_the_runs(tmp_path):
    own = {"messages": [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}],
           "tools": [DESCRIBED[1]]}
    text = {"text": "the cat sat on the mat"}
    rows = [_without_tools(tool_files.trl_record(0)), _without_tools(tool_files.trl_record(1)), own, text]
    c = _sft(tmp_path, rows, tools=tool_files.TOOLS)       # LlamaFactory's bare descriptions
    tok = tool_files.tokenizer()
    read = list(records(c.data[0]))
    for (where, record), expected in zip(read, [tool_files.trl_record(0), tool_files.trl_record(1), own, text]):
        assert tokens.encode(tok, record, False, where) == tokens.encode(tok, expected, False, where)
    first = tok.convert_ids_to_tokens(tokens.encode(tok, read[0][1], False, "x")[0])
    assert first[:5] == ["<|system|>", "tools:", "get_time", "get_weather", "<|end|>"]
    # the record's own tools (get_weather alone) win over the run's
    assert tok.convert_ids_to_tokens(tokens.encode(tok, read[2][1], False, "x")[0])[:4] == \
        ["<|system|>", "tools:", "get_weather", "<|end|>"]
    # the token files are made again under other tools
    key = [entries.check("data", [str(tmp_path / "chats.jsonl")], False, False)[0], dict(c.data[0])]
    assert tokens.fingerprint(key[:1], None, False) != tokens.fingerprint(key[1:], None, False)


def test_a_python_function_beside_the_run_yaml_is_described_by_its_schema(tmp_path):
    (tmp_path / "clock_tools.py").write_text(MODULE)
    c = _sft(tmp_path, [_without_tools(tool_files.trl_record(0))], tools=["clock_tools:get_time", DESCRIBED[1]])
    assert [t["function"]["name"] for t in c.tools] == ["get_time", "get_weather"]
    assert c.tools[0]["function"]["description"] == "The time now in a city."
    assert c.tools[0]["function"]["parameters"]["properties"]["city"] == {"type": "string",
                                                                          "description": "the city to ask about"}
    (_, record), = records(c.data[0])
    assert record["tools"] == c.tools
    # training_args.yaml names the module's file, for a run started from it elsewhere (run_args.py)
    assert c.given["tools"] == [f"{tmp_path / 'clock_tools.py'}:get_time", DESCRIBED[1]]
    # a JSON file holding the list, named beside the run.yaml
    (tmp_path / "tools.json").write_text(json.dumps(DESCRIBED))
    assert _sft(tmp_path, [_without_tools(tool_files.trl_record(0))], tools="tools.json").tools == DESCRIBED


def test_dpo_pairs_under_the_runs_tools_are_the_pairs_of_records_that_carry_them(tmp_path):
    call = [{"type": "function", "function": {"name": "get_time", "arguments": {"city": "paris"}}}]
    pair = {"prompt": [{"role": "user", "content": files.SENTENCES[8]}],
            "chosen": [{"role": "assistant", "tool_calls": call}],
            "rejected": [{"role": "assistant", "content": "it is late"}]}
    work = stage_files.workspace(tmp_path)
    tok = tool_files.tokenizer()

    def pairs(rows, name, **more):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        settings = {**stage_files.dpo(work, str(tmp_path / name)), "data": str(path), "seq": 48, **more}
        settings.pop("eval_fraction")
        settings.pop("eval_every")
        return DPOStage(load(files.run_yaml(str(tmp_path / f"{name}.yaml"), **settings), []), tok).pairs

    carried = pairs([{**pair, "tools": DESCRIBED}] * 3, "carried")
    assert pairs([pair] * 3, "run", tools=DESCRIBED) == carried
    assert pairs([pair] * 3, "none") != carried       # the tools are written into the prompt


@pytest.mark.parametrize("tools, message", [
    (["clock_tools:missing"], "tool 'clock_tools:missing' cannot be loaded: clock_tools .* has no missing"),
    (["clock_tools:undocumented"], "tool 'clock_tools:undocumented': its JSON schema cannot be made from its "
                                   "signature and docstring"),
    ([{"description": "no name"}], "a tool is \\{type: function, function:"),
    ([DESCRIBED[0], tool_files.TOOLS[0]], "tools: get_time given twice"),
    ("missing.json", "tools: '/.*/missing.json' is not a file"),     # beside the run.yaml
    (7, "tools is a list of tools, each a module:function name or a function description"),
])
def test_what_cannot_be_a_tool_is_refused_by_name(tmp_path, tools, message):
    (tmp_path / "clock_tools.py").write_text(MODULE)
    with pytest.raises(ArgumentError, match=message):
        _sft(tmp_path, [tool_files.trl_record(0)], tools=tools)


def test_grpo_and_the_bundled_model_refuse_the_runs_tools(tmp_path):
    work = stage_files.workspace(tmp_path)
    settings = {**stage_files.grpo(work, str(tmp_path / "run")), "tools": DESCRIBED}
    with pytest.raises(ArgumentError, match="tools: stage grpo hands a record's tools column to the reward functions"):
        load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings), [])
    with pytest.raises(ArgumentError, match="tools: the bundled model reads bytes and has no chat template"):
        load(files.run_yaml(str(tmp_path / "bundled.yaml"), data=files.text(str(tmp_path / "t.txt")), steps=1,
                            tools=DESCRIBED), [])
