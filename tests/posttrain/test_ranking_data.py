"""stage: dpo reads LlamaFactory's preference data as LlamaFactory does: a dataset_info.json entry
with ranking: true (and only such an entry), in its alpaca layout (instruction, input, chosen,
rejected) or its sharegpt layout (conversations and the chosen and rejected turns), each read as
the conversation TRL's layout would give."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.posttrain import to_pair
from megacompile.train import load
from megacompile.train.data.ranking import preference
from megacompile.train.stages.dpo import DPOStage
from tests.posttrain import stage_files
from tests.train import files, tool_files

SYSTEM, EARLIER, ANSWER = "we like to read books at night", "what is the time now", "it is late"
QUESTION, INPUT, CHOSEN, REJECTED = "the cat sat", "on the mat", "a dog ran in the park", "rain fell on the old town"


def _trl() -> dict:
    """The pair as TRL's conversational layout writes it."""
    return {"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": EARLIER},
                       {"role": "assistant", "content": ANSWER}, {"role": "user", "content": QUESTION + "\n" + INPUT}],
            "chosen": [{"role": "assistant", "content": CHOSEN}],
            "rejected": [{"role": "assistant", "content": REJECTED}]}


ALPACA = {"question": QUESTION, "context": INPUT, "good": CHOSEN, "bad": REJECTED, "system": SYSTEM,
          "history": [[EARLIER, ANSWER]]}
SHAREGPT = {"turns": [{"speaker": "sys", "text": SYSTEM}, {"speaker": "me", "text": EARLIER},
                      {"speaker": "bot", "text": ANSWER}, {"speaker": "me", "text": QUESTION + "\n" + INPUT}],
            "chosen": {"speaker": "bot", "text": CHOSEN}, "rejected": {"speaker": "bot", "text": REJECTED}}
INFO = {"dpo_alpaca": {"file_name": "alpaca.json", "ranking": True,
                       "columns": {"prompt": "question", "query": "context", "chosen": "good", "rejected": "bad",
                                   "system": "system", "history": "history"}},
        "dpo_sharegpt": {"file_name": "sharegpt.jsonl", "ranking": True, "formatting": "sharegpt",
                         "columns": {"messages": "turns", "chosen": "chosen", "rejected": "rejected"},
                         "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "me",
                                  "assistant_tag": "bot", "system_tag": "sys"}},
        "chats": {"file_name": "chats.jsonl"}}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ranking")
    (tmp / "alpaca.json").write_text(json.dumps([ALPACA] * 3))
    (tmp / "sharegpt.jsonl").write_text((json.dumps(SHAREGPT) + "\n") * 3)
    files.chats(str(tmp / "chats.jsonl"))
    (tmp / "dataset_info.json").write_text(json.dumps(INFO))
    return {**stage_files.workspace(tmp), "dir": tmp}


def _config(work, tmp_path, **more):
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "seq": 48, "dataset_dir": str(work["dir"]), **more}
    for key in ("data", "eval_fraction", "eval_every"):
        settings.pop(key)
    return load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])


def test_llamafactorys_ranking_layouts_are_read_as_trls_conversations():
    tok = files.tokenizer()
    expected = to_pair(_trl(), tok)
    alpaca = {"instruction": QUESTION, "input": INPUT, "chosen": CHOSEN, "rejected": REJECTED, "system": SYSTEM,
              "history": [[EARLIER, ANSWER]]}
    sharegpt = {"conversations": [{"from": "human", "value": EARLIER}, {"from": "gpt", "value": ANSWER},
                                  {"from": "human", "value": QUESTION + "\n" + INPUT}], "system": SYSTEM,
                "chosen": {"from": "gpt", "value": CHOSEN}, "rejected": {"from": "gpt", "value": REJECTED}}
    assert to_pair(preference(alpaca, "x:1"), tok) == expected
    assert to_pair(preference(sharegpt, "x:2"), tok) == expected
    with pytest.raises(ArgumentError, match="x:3: a preference record is TRL's .* or LlamaFactory's ranking layouts"):
        preference({"instruction": QUESTION, "output": CHOSEN}, "x:3")
    assert to_pair(preference({**sharegpt, "tools": ""}, "x:4"), tok) == expected      # an empty tools column
    # chat_template_kwargs reach the template: here one that writes "brief" first when asked
    briefly = tool_files.tokenizer()
    plain, brief = to_pair(preference(sharegpt, "x:6"), briefly), to_pair(preference(sharegpt, "x:6"), briefly,
                                                                          "x:6", {"brief": True})
    assert briefly.convert_ids_to_tokens(brief.prompt[:1]) == ["brief"] and brief.prompt[1:] == plain.prompt
    assert (brief.chosen, brief.rejected) == (plain.chosen, plain.rejected)
    # a template that writes nothing of a turn is refused, not scored on what is left
    dropping = files.tokenizer()
    dropping.chat_template = files.TEMPLATE.replace("{% for m in messages %}",
                                                    "{% for m in messages if m['role'] != 'system' %}")
    with pytest.raises(ArgumentError, match="x:7: the chat template does not write turn 0 \\(role 'system'\\)"):
        to_pair(preference(sharegpt, "x:7"), dropping, "x:7")


def test_a_llamafactory_dpo_config_trains_on_its_ranking_datasets(work, tmp_path):
    c = _config(work, tmp_path, dataset="dpo_alpaca,dpo_sharegpt")
    stage = DPOStage(c, files.tokenizer())
    assert stage.pairs == [to_pair(_trl(), files.tokenizer())] * 6      # columns and tags renamed first


@pytest.mark.parametrize("stage, dataset, message", [
    ("sft", "dpo_alpaca", "dpo_alpaca in {dir}/dataset_info.json is a ranking (preference) dataset, which trains "
                          "under stage: dpo"),
    ("dpo", "chats", "chats in {dir}/dataset_info.json is not a ranking dataset, and stage dpo trains on preference "
                     "pairs"),
])
def test_a_dataset_for_another_stage_is_refused_as_llamafactory_refuses_it(work, tmp_path, stage, dataset, message):
    with pytest.raises(ArgumentError) as e:
        _config(work, tmp_path, stage=stage, dataset=dataset)
    assert message.format(dir=work["dir"]) in str(e.value)
