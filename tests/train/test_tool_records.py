"""Tool-use conversations (TRL's tool_calls and role tool; LlamaFactory's function_call and
observation turns with a tools column): the calls are trained as the assistant's, the tools'
answers and the tool list are not, both layouts give the same tokens, and a chat template that
would drop a tool, a call or an answer is refused rather than trained on what it left out."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import tokens
from tests.train import files, tool_files
from tests.train.killed import TIMED


def _marked(tok, record, train_on_prompt=False):
    ids, targets = tokens.encode(tok, record, train_on_prompt, "tools.jsonl:1")
    return list(zip(tok.convert_ids_to_tokens(ids), map(int, targets)))


def test_a_call_is_trained_and_the_tools_answer_is_not():
    tok = tool_files.tokenizer()
    expected = [  # (token, counted by the loss)
        ("<|system|>", 0), ("tools:", 0), ("get_time", 0), ("get_weather", 0), ("<|end|>", 0),
        ("<|user|>", 0), ("what", 0), ("is", 0), ("the", 0), ("time", 0), ("now", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("<call>", 1), ("get_time", 1), ("city", 1), ("paris", 1), ("</call>", 1),
        ("<|end|>", 1),
        ("<|tool|>", 0), ("noon", 0), ("<|end|>", 0),
        ("<|assistant|>", 0), ("a", 1), ("dog", 1), ("ran", 1), ("in", 1), ("the", 1), ("park", 1), ("<|end|>", 1),
        ("</s>", 1)]
    assert _marked(tok, tool_files.trl_record(0)) == expected
    assert all(t for _, t in _marked(tok, tool_files.trl_record(0), train_on_prompt=True))


def test_llamafactory_function_call_and_observation_turns_read_as_trls_tool_calls():
    tok = tool_files.tokenizer()
    for i in range(4):      # one call, then two at once
        trl, lf = tool_files.trl_record(i), tool_files.llamafactory_record(i)
        assert _marked(tok, lf) == _marked(tok, trl)
    parallel = [w for w, t in _marked(tok, tool_files.llamafactory_record(1)) if t]
    assert parallel[:11] == ["<call>", "get_time", "city", "rome", "</call>",
                             "<call>", "get_weather", "city", "rome", "</call>", "<|end|>"]
    # the tools as a list of objects, or TRL's wrapped form, read the same as the JSON string
    lf = tool_files.llamafactory_record(0)
    assert _marked(tok, {**lf, "tools": tool_files.TOOLS}) == _marked(tok, lf)
    # a call with content null, as OpenAI writes it, reads as one without content
    trl = tool_files.trl_record(0)
    trl["messages"][1]["content"] = None
    assert _marked(tok, trl) == _marked(tok, tool_files.trl_record(0))


def test_chat_template_kwargs_of_a_record_reach_the_template():
    tok = tool_files.tokenizer()
    record = {**tool_files.trl_record(0), "chat_template_kwargs": {"brief": True}}
    marked = _marked(tok, record)
    assert marked[5] == ("brief", 0) and marked[:5] + marked[6:] == _marked(tok, tool_files.trl_record(0))
    with pytest.raises(ArgumentError, match="chat_template_kwargs sets add_generation_prompt, tools, which the "):
        _marked(tok, {**record, "chat_template_kwargs": {"tools": [], "add_generation_prompt": True}})
    with pytest.raises(ArgumentError, match="tools.jsonl:1: chat_template_kwargs is a mapping"):
        _marked(tok, {**record, "chat_template_kwargs": "brief"})


def test_a_template_that_drops_tools_calls_or_answers_is_refused():
    record = tool_files.trl_record(0)
    with pytest.raises(ArgumentError, match=r"tools.jsonl:1: the chat template does not write the record's tools "
                                            r"\(get_time, get_weather\)"):
        _marked(files.tokenizer(), record)      # its template knows role and content only
    writes_tools = "{% if tools %}{% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
    with pytest.raises(ArgumentError, match=r"does not write turn 1's tool call \(get_time\): give a tokenizer"):
        _marked(tool_files.tokenizer(writes_tools + files.TEMPLATE), record)
    no_tool_role = tool_files.TEMPLATE.replace("{% else %}", "{% elif m.role != 'tool' %}")
    with pytest.raises(ArgumentError, match="does not write turn 2 \\(role 'tool'\\): give a tokenizer whose chat "
                                            "template renders tool answers"):
        _marked(tool_files.tokenizer(no_tool_role), record)
    unknown = {"messages": [{"role": "user", "content": "hello there"}, {"role": "function", "content": "noon"},
                            {"role": "assistant", "content": "it is late"}]}
    with pytest.raises(ArgumentError, match="does not write turn 1 \\(role 'function'\\): its roles are system"):
        _marked(tool_files.tokenizer(no_tool_role.replace("m.role != 'tool'", "m.role != 'function'")), unknown)


@pytest.mark.parametrize("change, message", [
    (lambda r: r["conversations"][1].update(value="{name: get_time}"),
     "the function_call of turn 1 is not valid JSON"),
    (lambda r: r["conversations"][1].update(value=json.dumps({"name": "get_time"})),
     "turn 1 \\(function_call\\): each call is \\{name, arguments\\}"),
    (lambda r: r["conversations"][1].update(value="[]"),
     "turn 1 \\(function_call\\) holds a call \\{name, arguments\\} as JSON, or a list of them"),
    (lambda r: r.update(tools="[{\"description\": \"no name\"}]"),
     "a tool is \\{type: function, function: \\{name, description, parameters\\}\\} or a bare"),
    (lambda r: r.update(tools="{\"name\": "), "tools is not valid JSON"),
    (lambda r: r.update(tools=7), "tools is a list of function descriptions"),
])
def test_malformed_tool_records_are_refused_with_their_line(change, message):
    record = tool_files.llamafactory_record(0)
    change(record)
    with pytest.raises(ArgumentError, match="tools.jsonl:1: " + message):
        _marked(tool_files.tokenizer(), record)


def test_tool_calls_on_a_turn_not_the_assistants_are_refused():
    record = tool_files.trl_record(0)
    record["messages"][0]["tool_calls"] = record["messages"][1]["tool_calls"]
    with pytest.raises(ArgumentError, match="turn 0 has tool_calls and role 'user'; only the assistant calls tools"):
        _marked(tool_files.tokenizer(), record)
    record = tool_files.trl_record(0)
    record["messages"][1]["tool_calls"] = [{"type": "function", "function": {"name": "get_time"}}]
    with pytest.raises(ArgumentError, match="turn 1: each of tool_calls is"):
        _marked(tool_files.tokenizer(), record)


def test_a_templates_own_error_is_said_with_the_line():
    tok = tool_files.tokenizer("{{ raise_exception('roles must alternate user/assistant') }}")
    with pytest.raises(ArgumentError, match="tools.jsonl:1: the chat template fails on this conversation: "
                                            ".*roles must alternate user/assistant"):
        _marked(tok, tool_files.trl_record(0))


@pytest.mark.slow     # 15 s: two runs; the records' tokens above are the default tier's
def test_a_llamafactory_tool_dataset_trains_as_the_same_data_in_trls_layout(tmp_path):
    """glaive's layout named in dataset_info.json (its own column and tag names, as that file maps
    them) and TRL's messages: the same log.csv, every column but the timings."""
    from megacompile.train import load, log, run
    model = files.model_dir(str(tmp_path / "model"), tok=tool_files.tokenizer())
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "calls.json", "w") as f:
        json.dump([{"dialogue": [{"who": {"human": "person", "gpt": "bot"}.get(t["from"], t["from"]), "text": t["value"]}
                                 for t in r["conversations"]], "functions": r["tools"]}
                   for r in map(tool_files.llamafactory_record, range(8))], f)
    with open(data / "dataset_info.json", "w") as f:
        json.dump({"calls": {"file_name": "calls.json", "formatting": "sharegpt",
                             "columns": {"messages": "dialogue", "tools": "functions"},
                             "tags": {"role_tag": "who", "content_tag": "text", "user_tag": "person",
                                      "assistant_tag": "bot"}}}, f)
    trl = tmp_path / "calls.jsonl"
    trl.write_text("".join(json.dumps(tool_files.trl_record(i)) + "\n" for i in range(8)))
    common = dict(model=model, seq=48, batch=2, steps=3, lr=1e-3, log_every=1, log="csv", compute_dtype="float32",
                  device="cpu", seed=1)
    run(load(files.run_yaml(str(tmp_path / "lf.yaml"), dataset="calls", dataset_dir=str(data), run_dir="lf",
                            **common), []))
    run(load(files.run_yaml(str(tmp_path / "trl.yaml"), data=str(trl), run_dir="trl", **common), []))
    rows = [[{k: v for k, v in r.items() if k not in TIMED}
             for r in log.read(str(tmp_path / name / "log.csv"))] for name in ("lf", "trl")]
    assert len(rows[0]) == 3 and rows[0] == rows[1]
    assert all(float(r["loss"]) > 0 for r in rows[0])


def test_a_runs_chat_template_kwargs_lie_under_each_records_own(tmp_path):
    """run.yaml's chat_template_kwargs (TRL's; LlamaFactory's enable_thinking is one of them) reach
    every record's rendering, a record's own win, and the token files are keyed by them."""
    from megacompile.train import load
    from megacompile.train.data import reading
    model = files.model_dir(str(tmp_path / "model"), tok=tool_files.tokenizer())
    data = tmp_path / "calls.jsonl"
    own = {**tool_files.trl_record(1), "chat_template_kwargs": {"brief": False}}
    data.write_text(json.dumps(tool_files.trl_record(0)) + "\n" + json.dumps(own) + "\n")

    def config(**settings):
        return load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, data=str(data), steps=1, **settings), [])
    c = config(chat_template_kwargs={"brief": True})
    read = [r for _, r in reading.records(c.data[0])]
    assert [r["chat_template_kwargs"] for r in read] == [{"brief": True}, {"brief": False}]
    tok = tool_files.tokenizer()
    assert _marked(tok, read[0])[5] == ("brief", 0) and "brief" not in [w for w, _ in _marked(tok, read[1])]
    assert tokens.fingerprint(c.data, model, False) != tokens.fingerprint(config().data, model, False)
    assert config(enable_thinking=False).chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ArgumentError, match="chat_template_kwargs sets tools, which the rendering"):
        config(chat_template_kwargs={"tools": []})
    with pytest.raises(ArgumentError, match="enable_thinking must be true or false; got 'no thanks'"):
        config(enable_thinking="no thanks")


def test_trls_dataset_text_field_names_the_column_text_records_are_read_from(tmp_path):
    from megacompile.train import load
    from megacompile.train.data import reading
    model = files.model_dir(str(tmp_path / "model"))
    data = tmp_path / "notes.jsonl"
    data.write_text(json.dumps({"body": "the cat sat on the mat", "text": "unused"}) + "\n")

    def config(**settings):
        return load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, data=str(data), steps=1, **settings), [])
    read = [r for _, r in reading.records(config(dataset_text_field="body").data[0])]
    assert read[0]["text"] == "the cat sat on the mat"
    assert [r for _, r in reading.records(config(dataset_text_field="text").data[0])][0]["text"] == "unused"
    with pytest.raises(ArgumentError, match="dataset_text_field must be a string"):
        config(dataset_text_field=3)
    with pytest.raises(ArgumentError, match="stage dpo: dataset_text_field is not taken by dpo"):
        config(dataset_text_field="body", stage="dpo")
