"""Stage dpo's pairs and kto's examples under `template: qwen3` and `deepseekr1` (LlamaFactory's
reasoning layouts): the prompt's earlier answers are written without their thoughts and without an
empty think block, as LlamaFactory's pairwise and feedback encodings (its ReasoningTemplate's
encode_oneturn) write them; the answer keeps its own thoughts, which enable_thinking false drops,
the empty block then written before the answer as prompt."""
from __future__ import annotations

import json

import pytest

from megacompile.train import load
from megacompile.train.data import named_template
from megacompile.train.stages.dpo import DPOStage
from megacompile.train.stages.kto import KTOStage
from megacompile.train.stages.rm import RMStage
from tests.train import files
from tests.train.test_named_template import CHAT, EMPTY, LAYOUT_TOKENS, SPECIAL, _llamafactory, _tokenizer

PROMPT = CHAT[:-1]      # its answers: one without a think block, one with ("it is late")
CHOSEN = CHAT[-1]
REJECTED = {"role": "assistant", "content": "<think>\nbirds sing\n</think>\n\nthe cat sat"}
CASES = [("qwen3", True), ("qwen3", False), ("deepseekr1", True), ("deepseekr1", False)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return files.model_dir(str(tmp_path_factory.mktemp("preference_thoughts") / "model"), layers=1, dim=16)


def _oneturn(tok, answer: dict, name: str, thinking: bool) -> tuple[tuple, tuple]:
    """LlamaFactory's encode_oneturn of PROMPT + [answer] (without preserve_thinking): the tokens
    its encode_multiturn writes with discarding_history_cot (test_named_template's reference), split
    where the last answer, its one target, starts."""
    ids, targets = _llamafactory(tok, PROMPT + [answer], name, thinking, mask_history=True)
    first = targets.index(1)
    return tuple(ids[:first]), tuple(ids[first:])


def _settings(model, tmp_path, stage: str, rows: list[dict], thinking: bool) -> dict:
    path = tmp_path / f"{stage}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load(files.run_yaml(str(tmp_path / f"{stage}.yaml"), model=model, stage=stage, data=str(path), batch=2,
                               seq=128, steps=1, device="cpu", run_dir=str(tmp_path / stage),
                               **({} if thinking else {"enable_thinking": False})), [])


def _layout(name: str):
    return named_template.apply(_tokenizer(special=LAYOUT_TOKENS.get(name, SPECIAL)), name)


@pytest.mark.parametrize("name, thinking", CASES)
def test_a_dpo_pair_drops_the_earlier_answers_thoughts_as_llamafactory_does(model, tmp_path, name, thinking):
    tok = _layout(name)
    record = {"conversations": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}     # LlamaFactory's ranking layout
    pair, = DPOStage(_settings(model, tmp_path, "dpo", [record], thinking), tok).pairs
    prompt, chosen = _oneturn(tok, CHOSEN, name, thinking)
    _, rejected = _oneturn(tok, REJECTED, name, thinking)
    assert (pair.prompt, pair.chosen, pair.rejected) == (prompt, chosen, rejected)
    written = tok.decode(pair.prompt).replace(" ", "")
    assert "itislate" not in written and written.count(EMPTY) == (0 if thinking else 1)
    assert ("birdssing" in tok.decode(pair.rejected).replace(" ", "")) == thinking


@pytest.mark.parametrize("name, thinking", CASES[:2])
def test_a_reward_models_pair_drops_the_earlier_answers_thoughts_as_llamafactory_does(model, tmp_path, name,
                                                                                       thinking):
    """LlamaFactory's stage rm reads its pairs through the same pairwise encoding as dpo."""
    tok = _layout(name)
    record = {"conversations": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    (pair, _), = RMStage(_settings(model, tmp_path, "rm", [record], thinking), tok).pairs
    prompt, chosen = _oneturn(tok, CHOSEN, name, thinking)
    _, rejected = _oneturn(tok, REJECTED, name, thinking)
    assert (pair.prompt, pair.chosen, pair.rejected) == (prompt, chosen, rejected)


@pytest.mark.parametrize("name, thinking", CASES)
def test_a_kto_example_drops_the_earlier_answers_thoughts_as_llamafactory_does(model, tmp_path, name, thinking):
    tok = _layout(name)
    rows = [{"messages": PROMPT + [CHOSEN], "label": True}, {"messages": PROMPT + [REJECTED], "label": False}]
    examples = KTOStage(_settings(model, tmp_path, "kto", rows, thinking), tok).examples
    assert [(e.prompt, e.completion) for e in examples] == [_oneturn(tok, a, name, thinking)
                                                            for a in (CHOSEN, REJECTED)]
    assert "itislate" not in tok.decode(examples[0].prompt).replace(" ", "")


def test_preserve_thinking_keeps_the_earlier_answers_thoughts_in_the_prompt(model, tmp_path):
    tok = _layout("qwen3")
    record = {"prompt": PROMPT, "chosen": [CHOSEN], "rejected": [REJECTED],
              "chat_template_kwargs": {"preserve_thinking": True}}
    pair, = DPOStage(_settings(model, tmp_path, "dpo", [record], True), tok).pairs
    assert "itislate" in tok.decode(pair.prompt).replace(" ", "")
