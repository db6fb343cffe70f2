"""TRL's preference formats (its "Dataset formats": standard, conversational, implicit prompt), from
.jsonl, .json, .parquet and .csv files, read into the token ids DPO trains on as TRL's DPOTrainer
makes them: the prompt's tokens, then the completion's (text: the tokens of prompt + completion +
eos after the prompt's; messages: the chat template's rendering after the prompt's with its
generation prompt), the completion tokens alone counted by the loss. A malformed record is refused
naming its file, its record and the fix."""
from __future__ import annotations

import json

import pytest

from megacompile.errors import ArgumentError
from megacompile.posttrain import IGNORE, pack, read_pairs, to_pair
from tests.train import files

USER = [{"role": "user", "content": "hello there"}]
FINE, LATE = [{"role": "assistant", "content": "i am fine"}], [{"role": "assistant", "content": "it is late"}]
STANDARD = {"prompt": "the cat sat", "chosen": " on the mat", "rejected": " in the park"}
CONVERSATIONAL = {"prompt": USER, "chosen": FINE, "rejected": LATE}
IMPLICIT_TEXT = {"chosen": "the cat sat on the mat", "rejected": "the cat sat in the park"}
IMPLICIT_CHAT = {"chosen": USER + FINE, "rejected": USER + LATE}
TEXT_PROMPT_BESIDE_CHATS = {"prompt": "hello there", "chosen": USER + FINE, "rejected": USER + LATE}


def _ids(tok, words: str) -> tuple[int, ...]:
    """The tokens of space-separated words, looked up in the vocabulary (not through the tokenizer)."""
    ids = tok.convert_tokens_to_ids(words.split())
    assert tok.unk_token_id not in ids, words
    return tuple(ids)


def _expected(tok, record: dict) -> tuple:
    if record in (STANDARD, IMPLICIT_TEXT):
        return _ids(tok, "the cat sat"), _ids(tok, "on the mat </s>"), _ids(tok, "in the park </s>")
    return (_ids(tok, "<|user|> hello there <|end|> <|assistant|>"), _ids(tok, "i am fine <|end|>"),
            _ids(tok, "it is late <|end|>"))


def _write(path, records: list[dict]) -> str:
    path = str(path)
    if path.endswith(".jsonl"):
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    elif path.endswith(".json"):
        with open(path, "w") as f:
            json.dump(records, f)
    else:
        import datasets
        table = datasets.Dataset.from_list(records)
        table.to_parquet(path) if path.endswith(".parquet") else table.to_csv(path, index=False)
    return path


CASES = [(STANDARD, ext) for ext in ("jsonl", "json", "parquet", "csv")] + \
        [(r, ext) for r in (CONVERSATIONAL, IMPLICIT_CHAT, TEXT_PROMPT_BESIDE_CHATS) for ext in ("jsonl", "json",
                                                                                               "parquet")] + \
        [(IMPLICIT_TEXT, ext) for ext in ("jsonl", "csv")]


@pytest.mark.parametrize("record, ext", CASES, ids=[f"{sorted(r)}-{type(r['chosen']).__name__}-{e}" for r, e in CASES])
def test_each_trl_format_gives_trls_prompt_and_completion_tokens(tmp_path, record, ext):
    tok = files.tokenizer()
    path = _write(tmp_path / f"pairs.{ext}", [record, record])
    pairs = read_pairs(path, tok)
    prompt, chosen, rejected = _expected(tok, record)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(prompt, chosen, rejected)] * 2


def test_the_loss_counts_the_completion_tokens_and_not_the_prompts():
    tok = files.tokenizer()
    pair = to_pair(STANDARD, tok)
    batch = pack([pair], seq=12, pad_id=tok.pad_token_id)
    prompt, chosen, rejected = _expected(tok, STANDARD)
    for row, completion in ((0, chosen), (1, rejected)):
        ids, labels = batch["input_ids"][row].tolist(), batch["labels"][row].tolist()
        assert tuple(ids[:len(prompt) + len(completion)]) == prompt + completion
        # labels[t] is the token at t + 1: the prompt's own tokens are never a target
        assert labels[:len(prompt) - 1] == [IGNORE] * (len(prompt) - 1)
        assert tuple(labels[len(prompt) - 1:len(prompt) - 1 + len(completion)]) == completion
        assert set(labels[len(prompt) - 1 + len(completion):]) == {IGNORE}


def _legacy_sentencepiece_tokenizer():
    """A word-level tokenizer normalised as Llama 2's legacy tokenizer is: a "▁" put before the text
    and every space made "▁", each word keeping the "▁"s before it. " blue" alone is "▁▁blue":
    two tokens, where "The sky is blue" ends with the one token "▁blue"."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["▁", "▁The", "▁sky", "▁is", "▁blue", "▁green"]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(["<pad>", "<unk>", "</s>"] + words)},
                                     unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def test_text_completions_are_the_tokens_of_prompt_plus_completion_after_the_prompts():
    tok = _legacy_sentencepiece_tokenizer()
    ids = lambda words: tuple(tok.convert_tokens_to_ids(words.split()))  # noqa: E731
    assert tok(" blue", add_special_tokens=False)["input_ids"] == list(ids("▁ ▁blue"))     # alone: two tokens
    pair = to_pair({"prompt": "The sky is", "chosen": " blue", "rejected": " green</s>"}, tok)
    assert pair.prompt == ids("▁The ▁sky ▁is")
    assert pair.chosen == ids("▁blue </s>")
    assert pair.rejected == ids("▁green </s>")          # an eos the text ends with is not added again


@pytest.mark.parametrize("record, message", [
    ({"prompt": "the cat sat", "chosen": " on the mat"}, "missing rejected: give each record both completions"),
    ({"prompt": "the cat sat", "chosen": "  ", "rejected": " in the park"},
     "chosen is empty; give the chosen completion's text"),
    ({"prompt": USER, "chosen": [], "rejected": LATE}, "chosen is an empty list of messages; give its turns"),
    ({"prompt": USER, "chosen": [{"role": "assistant", "content": ""}], "rejected": LATE},
     "chosen is empty; give the chosen completion's text"),
    ({"prompt": "the cat sat", "chosen": " on the mat", "rejected": " on the mat"},
     "chosen and rejected are the same completion, which prefers nothing"),
    ({"prompt": "the cat sat", "chosen": " on the mat", "rejected": " on  the mat"},
     "chosen and rejected are the same completion, which prefers nothing (its DPO loss is log 2 whatever the "
     "policy): leave the record out, or give it two different answers (their tokens are equal)"),
    ({"prompt": "", "chosen": " on the mat", "rejected": " in the park"}, "the prompt is empty; DPO scores"),
    ({"prompt": USER, "chosen": "i am fine", "rejected": "it is late"},
     'give them as messages too ([{"role": "assistant", "content": ...}])'),
    ({"prompt": USER, "chosen": [{"from": "gpt", "value": "i am fine"}], "rejected": LATE},
     "chosen is text or a list of messages {role, content} with string values"),
    ({"chosen": "the cat sat on the mat", "rejected": "a dog ran in the park"},
     "chosen and rejected share no start to read as the prompt (the text they begin with, as TRL extracts it); "
     "give a prompt column"),
    ({"chosen": USER + FINE, "rejected": USER}, "one of chosen and rejected is the start of the other"),
    ({"chosen": FINE, "rejected": "it is late"}, "chosen and rejected are one text and one list of messages"),
])
def test_a_malformed_record_is_refused_naming_the_file_the_record_and_the_fix(tmp_path, record, message):
    tok = files.tokenizer()
    path = _write(tmp_path / "pairs.jsonl", [STANDARD, record])
    with pytest.raises(ArgumentError) as e:
        read_pairs(path, tok)
    assert str(e.value).startswith(f"{path}:2: ")
    assert message in str(e.value)


def test_a_table_names_the_row_of_a_malformed_record(tmp_path):
    path = _write(tmp_path / "pairs.parquet", [STANDARD, {"prompt": "the cat sat", "chosen": " on the mat"}])
    with pytest.raises(ArgumentError, match=rf"^{path} row 1: .*missing rejected"):
        read_pairs(path, files.tokenizer())
