"""Preference pairs with tools (TRL's tools column and tool_calls; LlamaFactory's sharegpt ranking
layout with a tools column, function_call and observation turns): the tools reach the template with
the pair, a completion that calls one is scored on the call as the template writes it, and a
template that would drop a tool or a call is refused rather than scored on what it left out."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.posttrain import to_pair
from megacompile.train import load
from megacompile.train.data import tools
from megacompile.train.data.ranking import preference
from megacompile.train.stages.dpo import DPOStage
from tests.posttrain import stage_files
from tests.train import files, tool_files

QUESTION = files.SENTENCES[8]
CALL = [{"type": "function", "function": {"name": "get_time", "arguments": {"city": "paris"}}}]
TRL = {"prompt": [{"role": "user", "content": QUESTION}],
       "chosen": [{"role": "assistant", "tool_calls": CALL}],
       "rejected": [{"role": "assistant", "content": "it is late"}],
       "tools": [{"type": "function", "function": t} for t in tool_files.TOOLS]}
LLAMAFACTORY = {"conversations": [{"from": "human", "value": QUESTION}],
                "chosen": {"from": "function_call", "value": json.dumps({"name": "get_time",
                                                                         "arguments": {"city": "paris"}})},
                "rejected": {"from": "gpt", "value": "it is late"}, "tools": json.dumps(tool_files.TOOLS)}


def _pair(record: dict, tok, where: str = "x:1"):
    """As stage dpo makes a record's pair."""
    return to_pair(preference(record, where), tok, where, tools.template_kwargs(record, where),
                   tools.tools(record, where))


def test_the_tools_reach_the_prompt_and_a_call_is_the_completion():
    tok = tool_files.tokenizer()
    pair = _pair(TRL, tok)
    words = tok.convert_ids_to_tokens
    assert words(pair.prompt) == ["<|system|>", "tools:", "get_time", "get_weather", "<|end|>", "<|user|>",
                                  *QUESTION.split(), "<|end|>", "<|assistant|>"]
    assert words(pair.chosen) == ["<call>", "get_time", "city", "paris", "</call>", "<|end|>"]
    assert words(pair.rejected) == ["it", "is", "late", "<|end|>"]
    assert _pair(LLAMAFACTORY, tok) == pair
    # the prompt may end with a tool's answer (observation): the completions reply to it
    answered = {**LLAMAFACTORY, "conversations": [*LLAMAFACTORY["conversations"], LLAMAFACTORY["chosen"],
                                                  {"from": "observation", "value": "noon"}],
                "chosen": {"from": "gpt", "value": "it is noon"}, "rejected": {"from": "gpt", "value": "it is late"}}
    replied = _pair(answered, tok)
    assert words(replied.prompt) == [*words(pair.prompt), *words(pair.chosen), "<|tool|>", "noon", "<|end|>",
                                     "<|assistant|>"]
    assert words(replied.chosen) == ["it", "is", "noon", "<|end|>"]


def test_a_template_that_drops_the_tools_or_a_call_is_refused():
    no_tools = tool_files.tokenizer("{% if brief %}" + tool_files.TEMPLATE.split("{% if brief %}", 1)[1])
    with pytest.raises(ArgumentError, match="x:2: the chat template does not write the record's tools "
                                            r"\(get_time, get_weather\)"):
        _pair(TRL, no_tools, "x:2")
    with pytest.raises(ArgumentError, match="x:3: the chat template does not write the record's tools"):
        _pair(TRL, tool_files.tokenizer(files.TEMPLATE), "x:3")     # a template that knows no tools
    calls_dropped = tool_files.tokenizer(tool_files.TEMPLATE.replace("{{ c.function.name }} ", ""))
    with pytest.raises(ArgumentError, match="x:4: the chat template does not write chosen's tool call \\(get_time\\)"):
        _pair(TRL, calls_dropped, "x:4")
    with pytest.raises(ArgumentError, match="x:5: the record gives tools, which a chat template renders: give the "
                                            "prompt and completions as messages"):
        _pair({"prompt": QUESTION, "chosen": "a", "rejected": "b", "tools": TRL["tools"]}, tool_files.tokenizer(),
              "x:5")


def test_a_templates_own_error_on_a_pair_is_said_with_the_record():
    failing = tool_files.tokenizer("{{ raise_exception('tools must come with a system turn') }}")
    with pytest.raises(ArgumentError, match="x:7: the chat template fails on this pair: "
                                            ".*tools must come with a system turn"):
        _pair(TRL, failing, "x:7")


def test_stage_dpo_reads_a_llamafactory_tool_ranking_dataset(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "calls.json").write_text(json.dumps([LLAMAFACTORY] * 3))
    (data / "dataset_info.json").write_text(json.dumps({"calls": {
        "file_name": "calls.json", "ranking": True, "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected", "tools": "tools"}}}))
    work = stage_files.workspace(tmp_path)
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "seq": 48, "dataset_dir": str(data),
                "dataset": "calls"}
    for key in ("data", "eval_fraction", "eval_every"):
        settings.pop(key)
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    tok = tool_files.tokenizer()
    assert DPOStage(c, tok).pairs == [_pair(TRL, tok)] * 3
