"""cutoff_len (seq) means what it means in LlamaFactory: a supervised record longer than a row is
truncated to one row, its prompt and answer in LlamaFactory's proportions, and records are never
split across rows: packed whole (LlamaFactory's greedy knapsack) with packing on, one a row when
packing is off or not given. Plain text may still continue across rows."""
from __future__ import annotations

import bisect
import json
import random

import numpy as np
import pytest

from megacompile.errors import ArgumentError
from megacompile.train.data import cutoff, packing, placement, split, tokens
from tests.train import files, records

WORDS = " ".join(files.SENTENCES).split()


def _words(n: int, start: int = 0) -> str:
    return " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))


def _token_file(tmp_path, rows: list[dict], seq: int | None):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tokens.token_file(str(tmp_path / "tokens"), "train", [str(data)], files.tokenizer(), None, False,
                             cutoff=seq)


def test_a_long_alpaca_record_is_one_row_with_its_instruction_cut_in_llamafactorys_proportions(tmp_path):
    # With the test template the prompt is <|user|> + 27 words + <|end|> <|assistant|> = 30 tokens and
    # the answer 48 words + <|end|> + EOS = 50. In rows of 40 neither half fits in half the row, so
    # LlamaFactory's infer_seqlen cuts both: the answer to int(40 * 50 / 80) = 25, the prompt to 15.
    record = {"instruction": _words(27), "input": "", "output": _words(48, start=5)}
    tok = files.tokenizer()
    full, full_targets = tokens.encode(tok, record, False, "x:1")
    assert (len(full), full_targets.index(True)) == (80, 30)
    made = _token_file(tmp_path, [record], seq=40)
    assert made.n_docs == 1 and made.records.tolist() == [True]
    ids, targets = np.asarray(made.ids).tolist(), np.asarray(made.targets).astype(bool).tolist()
    assert ids == full[:15] + full[30:55]                      # the heads of the prompt and of the answer
    assert targets == [False] * 15 + [True] * 25
    assert tok.decode(ids[1:15]) == _words(14)                 # the instruction's start is in the row
    rows = packing.Rows(made, 40, False, seed=0, pad_id=tok.pad_token_id)
    assert rows.rows_per_epoch == 1 and rows.row(0)[0].tolist() == ids


@pytest.mark.parametrize("prompt, answer, budget, kept", [
    (30, 50, 40, (15, 25)),     # neither fits in half: both cut, in proportion
    (60, 10, 40, (30, 10)),     # a short answer stays whole, the prompt takes the rest
    (10, 60, 40, (10, 30)),     # a short prompt stays whole, the answer takes the rest
])
def test_infer_seqlen_is_llamafactorys(prompt, answer, budget, kept):
    assert cutoff.infer_seqlen(prompt, answer, budget) == kept


def test_a_conversation_stops_adding_turns_when_the_budget_is_spent():
    # two turns of 10 prompt + 10 answer tokens in 30: the first whole, the second cut 5 + 5
    ids = list(range(40))
    targets = [i % 20 >= 10 for i in ids]
    kept, kept_targets = cutoff.truncate(ids, targets, [(10, 20), (30, 40)], 30)
    assert kept == [*range(0, 20), *range(20, 25), *range(30, 35)]
    assert kept_targets == [False] * 10 + [True] * 10 + [False] * 5 + [True] * 5
    three = [(10, 20), (30, 40), (50, 60)]
    assert cutoff.truncate(list(range(60)), [False] * 60, three, 30)[0] == kept     # the third turn is dropped


def test_mask_history_grants_the_budget_from_the_last_turn_back():
    # LlamaFactory's mask_history: the pairs reversed, the last whole, the one before cut 5 + 5,
    # the first dropped; the kept turns in their order
    ids = list(range(60))
    three = [(10, 20), (30, 40), (50, 60)]
    kept, _ = cutoff.truncate(ids, [False] * 60, three, 30, last_first=True)
    assert kept == [*range(20, 25), *range(30, 35), *range(40, 60)]
    assert cutoff.truncate(ids, [False] * 60, three, 60, last_first=True)[0] == ids     # it fits: whole


def test_mask_history_trains_the_last_answer_alone(tmp_path):
    from megacompile.train import load
    tok = files.tokenizer()
    chat = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"},
            {"role": "user", "content": "what is the time now"}, {"role": "assistant", "content": "it is late"}]
    ids, every = tokens.encode(tok, {"messages": chat}, False, "x:1")
    same, last = tokens.encode(tok, {"messages": chat}, False, "x:1", mask_history=True)
    assert same == ids and sum(every) == 9 and sum(last) == 5       # "it is late <|end|>" and the EOS
    assert [bool(t) for t in last] == [bool(t) and i >= len(ids) - 5 for i, t in enumerate(every)]
    # train_on_prompt counts the prompts still, the earlier answer not (as LlamaFactory labels it)
    _, prompts = tokens.encode(tok, {"messages": chat}, True, "x:1", mask_history=True)
    assert [bool(t) for t in prompts] == [not (e and not a) for e, a in zip(every, last)]
    # the run's key reaches the token file, keyed by it
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps({"messages": chat}) + "\n")
    model = files.model_dir(str(tmp_path / "model"))
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, data=str(data), steps=1, mask_history=True), [])
    made = tokens.token_file(str(tmp_path / "tokens"), "train", c.data, tok, model, False, cutoff=64)
    assert np.asarray(made.targets).astype(bool).tolist() == [bool(t) for t in last]
    assert tokens.fingerprint(c.data, model, False) != tokens.fingerprint(
        load(files.run_yaml(str(tmp_path / "run.yaml"), model=model, data=str(data), steps=1), []).data, model, False)


def _lf_greedy_knapsack(numbers: list[int], capacity: int) -> list[list[int]]:
    """LlamaFactory's processor_utils.greedy_knapsack, as it is written there."""
    numbers = sorted(numbers)
    knapsacks = []
    while numbers:
        current, remaining = [], capacity
        while True:
            index = bisect.bisect(numbers, remaining) - 1
            if index < 0:
                break
            remaining -= numbers[index]
            current.append(numbers.pop(index))
        knapsacks.append(current)
    return knapsacks


def test_records_are_packed_by_llamafactorys_greedy_knapsack():
    lengths = [random.Random(3).randint(1, 64) for _ in range(300)]
    bins = placement.greedy_knapsack(lengths, 64)
    assert [[lengths[i] for i in b] for b in bins] == _lf_greedy_knapsack(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(300))


def _rows_holding(rows: packing.Rows, epoch: int) -> dict[int, list[int]]:
    held: dict[int, list[int]] = {}
    for r in range(epoch * rows.rows_per_epoch, (epoch + 1) * rows.rows_per_epoch):
        for d in rows.documents(r):
            held.setdefault(d, []).append(r)
    return held


@pytest.mark.parametrize("mode", [True, "isolated", None, False])
def test_packing_never_splits_a_record(tmp_path, mode):
    seq = 48
    chats = records.sharegpt(40) + records.alpaca(30)
    long = [{"instruction": _words(40, i), "output": _words(30, i + 3)} for i in range(5)]    # truncated to 48
    notes = [{"text": _words(120, i)} for i in range(3)]                                      # text, > 2 rows
    made = _token_file(tmp_path, chats + long + notes, seq)
    lengths = np.diff(np.asarray(made.docs))
    assert lengths[:75].max() == seq and lengths[75:].min() > 2 * seq
    rows = packing.Rows(made, seq, mode, seed=1, pad_id=0)
    for epoch in (0, 1):
        held = _rows_holding(rows, epoch)
        assert sorted(held) == list(range(made.n_docs))              # every document, every epoch
        assert all(len(held[d]) == 1 for d in range(75))             # each record in one row
        for d in range(75):                                          # whole in it
            row = rows.row(held[d][0])[0].tolist()
            doc = np.asarray(made.ids[made.docs[d]:made.docs[d + 1]]).tolist()
            assert any(row[i:i + len(doc)] == doc for i in range(seq - len(doc) + 1))
        assert all(len(held[d]) >= 3 for d in range(75, 78))         # text continues across rows
    shared = max(sum(d < 75 for d in rows.documents(r)) for r in range(rows.rows_per_epoch))
    assert (shared > 1) == (mode in (True, "isolated"))             # packed several to a row, or one a row


def test_eval_fraction_holds_out_records_whole(tmp_path):
    made = _token_file(tmp_path, records.alpaca(20), seq=64)
    for seed in range(3):
        cut = split.hold_out(made, 0.13, seed)
        assert not cut.cut and cut.tokens.n_docs == 20
    (tmp_path / "two").mkdir()
    two = _token_file(tmp_path / "two", records.alpaca(2), seq=64)
    with pytest.raises(ArgumentError, match="eval_fraction 0.9 reaches into the last document left to train on, a "
                                            "record held out whole"):
        split.hold_out(two, 0.9, 0)
