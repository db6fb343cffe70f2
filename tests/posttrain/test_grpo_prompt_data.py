"""stage: grpo reads its prompts as TRL's GRPOTrainer does ({prompt: text or messages}, every other
column handed to the reward functions by name), and LlamaFactory's supervised datasets named by
`dataset:` in dataset_info.json: alpaca (the prompt: system, history, instruction + input; the
answer and the other columns to the rewards, under the file's names) and sharegpt (the prompt: the
conversation up to its last user turn; the conversation to the rewards). A malformed record is
refused naming its file, its record and the fix."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.stages.grpo import GRPOStage
from tests.posttrain import stage_files, trl_rewards
from tests.train import files, tool_files

TRL_TEXT = [{"prompt": "the cat sat", "answer": "on", "level": 1}]
TRL_CHAT = [{"prompt": [{"role": "system", "content": "we like to read books"},
                        {"role": "user", "content": "hello there"}], "answer": "i"}]
# LlamaFactory's alpaca with its own column names, mapped by dataset_info.json
ALPACA = [{"question": "what is the time", "context": "now", "reply": "it", "history": [["hello there", "i am fine"]],
           "source": "clock"}]
# sharegpt with OpenAI-style tags: the prompt ends at the last user turn, the answer after it is dropped
SHAREGPT = [{"turns": [{"role": "system", "content": "we like to read books"},
                       {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"},
                       {"role": "user", "content": "what is the time"}, {"role": "assistant", "content": "it is late"}],
             "answer": "it"}]
INFO = {"math_alpaca": {"file_name": "alpaca.json",
                        "columns": {"prompt": "question", "query": "context", "response": "reply",
                                    "history": "history"}},
        "chat_sharegpt": {"file_name": "sharegpt.jsonl", "formatting": "sharegpt",
                          "columns": {"messages": "turns"},
                          "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                                   "assistant_tag": "assistant", "system_tag": "system"}},
        "pairs": {"file_name": "pairs.jsonl", "ranking": True}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo_prompts")
    (tmp / "alpaca.json").write_text(json.dumps(ALPACA * 8))
    (tmp / "sharegpt.jsonl").write_text((json.dumps(SHAREGPT[0]) + "\n") * 8)
    for name, records in (("text", TRL_TEXT), ("chat", TRL_CHAT)):
        (tmp / f"{name}.jsonl").write_text((json.dumps(records[0]) + "\n") * 8)
    (tmp / "pairs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": " b", "rejected": " c"}) + "\n")
    (tmp / "dataset_info.json").write_text(json.dumps(INFO))
    return {**stage_files.workspace(tmp), "dir": tmp}


def _config(work, tmp_path, **more):
    settings = {**stage_files.grpo(work, str(tmp_path / "run")), "max_prompt_length": 32,
                "reward_funcs": ["tests.posttrain.trl_rewards:says_answer"], "reward_weights": [1.0], **more}
    if "dataset" in more:
        settings.pop("data")
        settings["dataset_dir"] = str(work["dir"])
    return load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])


def _ids(tok, words: str) -> list[int]:
    ids = tok.convert_tokens_to_ids(words.split())
    assert tok.unk_token_id not in ids, words
    return ids


@pytest.mark.parametrize("source, prompt, columns", [
    ({"data": "text.jsonl"}, "the cat sat", {"answer": "on", "level": 1}),
    ({"data": "chat.jsonl"}, "<|system|> we like to read books <|end|> <|user|> hello there <|end|> <|assistant|>",
     {"answer": "i"}),
    ({"dataset": "math_alpaca"},
     "<|user|> hello there <|end|> <|assistant|> i am fine <|end|> <|user|> what is the time now <|end|> "
     "<|assistant|>", {"reply": "it", "source": "clock"}),
    ({"dataset": "chat_sharegpt"},
     "<|system|> we like to read books <|end|> <|user|> hello there <|end|> <|assistant|> i am fine <|end|> "
     "<|user|> what is the time <|end|> <|assistant|>",
     {"answer": "it", "turns": [{"role": "user", "content": "hello there"},
                                {"role": "assistant", "content": "i am fine"},
                                {"role": "user", "content": "what is the time"},
                                {"role": "assistant", "content": "it is late"}]}),
], ids=["trl-text", "trl-messages", "llamafactory-alpaca", "llamafactory-sharegpt"])
def test_prompts_and_reward_columns_are_read_from_each_layout(work, tmp_path, source, prompt, columns):
    tok = files.tokenizer()
    if "data" in source:
        source = {"data": str(work["dir"] / source["data"])}
    c = _config(work, tmp_path, reward_funcs=["format_check"], **source)
    stage = GRPOStage(c, tok)
    assert stage.prompts == [_ids(tok, prompt)] * 8         # the token ids the generator is handed
    for record in stage.records:
        assert {k: v for k, v in record.items() if k != "prompt"} == columns


def test_prompts_cut_at_max_prompt_length_are_counted_in_a_truncation_line(work, tmp_path):
    # TRL 1.16 has no max_prompt_length and cuts no prompt: a run whose prompts are cut says so
    tok, data = files.tokenizer(), str(work["dir"] / "text.jsonl")
    stage = GRPOStage(_config(work, tmp_path, reward_funcs=["format_check"], data=data, max_prompt_length=2), tok)
    assert stage.prompts == [_ids(tok, "cat sat")] * 8          # the prompt's last tokens, as older TRL kept them
    [line] = stage.truncation_lines()
    assert line.startswith(f"truncation     8 of the 8 prompts of {data} cut to their last 2 tokens "
                           "(max_prompt_length") and "TRL 1.16 has no such key and cuts no prompt" in line
    assert GRPOStage(_config(work, tmp_path, reward_funcs=["format_check"], data=data), tok).truncation_lines() == []


def test_chat_template_kwargs_render_the_prompts_and_are_not_handed_to_the_rewards(work, tmp_path):
    tok = tool_files.tokenizer()        # its template writes "brief" first when asked
    prompt = "<|system|> we like to read books <|end|> <|user|> hello there <|end|> <|assistant|>"
    for settings, first in (({"chat_template_kwargs": {"brief": True}}, ["brief"]), ({}, [])):
        stage = GRPOStage(_config(work, tmp_path, reward_funcs=["format_check"], data=str(work["dir"] / "chat.jsonl"),
                                  **settings), tok)
        assert stage.prompts == [_ids(tok, " ".join(first + [prompt]))] * 8
        assert all(set(r) == {"prompt", "answer"} for r in stage.records)
    tok.chat_template = tool_files.TEMPLATE.replace("{% for m in messages %}",
                                                    "{% for m in messages if m.role != 'system' %}")
    with pytest.raises(ArgumentError, match="chat.jsonl:1: the chat template does not write turn 0 \\(role 'system'\\)"):
        GRPOStage(_config(work, tmp_path, reward_funcs=["format_check"], data=str(work["dir"] / "chat.jsonl")), tok)
    tok.chat_template = "{{ raise_exception('the prompt must end with a user turn') }}"
    with pytest.raises(ArgumentError, match="chat.jsonl:1: the chat template fails on this prompt: "
                                            ".*the prompt must end with a user turn"):
        GRPOStage(_config(work, tmp_path, reward_funcs=["format_check"], data=str(work["dir"] / "chat.jsonl")), tok)


def test_a_llamafactory_dataset_trains_under_grpo_its_answers_handed_to_the_rewards(work, tmp_path):
    trl_rewards.CALLS.clear()
    info = {"math": {"file_name": "math.json", "columns": {"prompt": "question", "response": "answer"}}}
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "dataset_info.json").write_text(json.dumps(info))
    (folder / "math.json").write_text(json.dumps([{"question": s, "answer": s.split()[0]} for s in files.SENTENCES]))
    settings = {**stage_files.grpo(work, str(tmp_path / "run")), "dataset": "math", "dataset_dir": str(folder),
                "reward_funcs": ["tests.posttrain.trl_rewards:says_answer"], "reward_weights": [1.0]}
    settings.pop("data")
    run(load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), []))
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert len(rows) == len(trl_rewards.CALLS) == 2
    for call in trl_rewards.CALLS:
        questions = [p[-1]["content"] for p in call["prompts"]]          # the prompt as messages, as TRL hands it
        assert all(p == [{"role": "user", "content": q}] for p, q in zip(call["prompts"], questions))
        assert call["answer"] == [q.split()[0] for q in questions]       # the file's own column name
        assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in call["completions"])


@pytest.mark.parametrize("record, message", [
    ({"question": "the cat sat", "answer": "on"}, "a grpo record is TRL's {prompt, ...} (text or messages), or "
                                                 "LlamaFactory's alpaca {instruction, input, ...} or sharegpt "
                                                 "{conversations, ...}; this one has answer, question: give each "
                                                 "record its prompt"),
    ({"prompt": "  ", "answer": "on"}, "the prompt is empty; give the question as its text"),
    ({"prompt": [], "answer": "on"}, "the prompt's messages are a non-empty list of {role, content}"),
    ({"prompt": 7}, "prompt is text or a list of messages {role, content}; got 7"),
    ({"instruction": "", "input": "", "output": "on"}, "the instruction and input are empty; give the question as "
                                                        "the instruction"),
    ({"conversations": [{"from": "gpt", "value": "on"}]}, "the conversation has no user turn to prompt with; give "
                                                          "the question as a turn from human (role: user)"),
])
def test_a_malformed_prompt_record_is_refused_naming_the_file_the_record_and_the_fix(work, tmp_path, record, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps(TRL_TEXT[0]) + "\n" + json.dumps(record) + "\n")
    c = _config(work, tmp_path, data=str(path), reward_funcs=["format_check"])
    with pytest.raises(ArgumentError) as e:
        GRPOStage(c, files.tokenizer())
    assert str(e.value).startswith(f"{path}:2: ")
    assert message in str(e.value)


def test_a_ranking_dataset_under_grpo_is_refused_naming_what_grpo_reads(work, tmp_path):
    with pytest.raises(ArgumentError, match="pairs in .*dataset_info.json is a ranking \\(preference\\) dataset, which "
                                            "trains under stage: dpo .*; stage grpo reads prompts from supervised "
                                            "\\(alpaca or sharegpt\\) datasets"):
        _config(work, tmp_path, dataset="pairs")
