"""stage dpo and kto fit long pairs into rows of seq as TRL does (train/stages/truncation.py):
max_prompt_length keeps a prompt's last tokens, max_completion_length a completion's first, and
truncation_mode cuts the row at seq (keep_start, dropping a pair whose prompt fills the row, or
keep_end); the run's start says what was cut or dropped; a prompt with images is never cut. Stage
kto takes KTOConfig's meanings instead (train/stages/example_cuts.py): max_prompt_length cuts only
a prompt whose row is too long, at the end truncation_mode names."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megacompile.errors import ArgumentError
from megacompile.posttrain import IGNORE, Pair, pack, pack_rows
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages.dpo import DPOStage
from megacompile.train.stages.keys import check_resume, saved_keys
from megacompile.train.stages.kto import KTOStage
from megacompile.train.stages.truncation import Cuts
from tests.posttrain import image_pair_files, stage_files
from tests.posttrain.test_image_pairs import _stage as vision_stage
from tests.train import files

S = files.SENTENCES
I = IGNORE  # noqa: E741
LONG = " ".join(S)      # a prompt of 53 tokens, past rows of 16


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("truncation")
    made = stage_files.workspace(tmp)
    made["tmp"] = tmp
    with open(made["pairs"]) as f:
        records = [json.loads(line) for line in f]
    records[3] = {"prompt": LONG, "chosen": S[0], "rejected": S[1]}
    made["long"] = str(tmp / "long.jsonl")
    with open(made["long"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    made["examples"] = str(tmp / "examples.jsonl")
    with open(made["examples"], "w") as f:
        f.writelines(json.dumps({"prompt": LONG if i == 2 else S[i], "completion": " " + S[(i * 3 + 1) % 10],
                                 "label": i % 2 == 0}) + "\n" for i in range(6))
    return made


def _config(work, name: str, held: bool = True, **more):
    settings = stage_files.dpo(work, str(work["tmp"] / name), **more)
    if not held:
        settings = {k: v for k, v in settings.items() if k not in ("eval_fraction", "eval_every")}
    return load(files.run_yaml(str(work["tmp"] / f"{name}.yaml"), **settings), [])


def test_rows_past_seq_keep_their_first_or_last_tokens_as_truncation_mode_says():
    rows = [((1, 2), (3, 4, 5, 6)), ((7,), (8,)), ((1, 2, 3, 4, 5), (6, 7))]
    start = pack_rows(rows[:2], 4, 0, "keep_start")
    assert start["input_ids"].tolist() == [[1, 2, 3, 4], [7, 8, 0, 0]]
    assert start["labels"].tolist() == [[I, 3, 4, I], [8, I, I, I]]
    end = pack_rows(rows, 4, 0, "keep_end")
    assert end["input_ids"].tolist() == [[3, 4, 5, 6], [7, 8, 0, 0], [4, 5, 6, 7]]
    # the kept row's first token is read with nothing before it: 3 is never a target
    assert end["labels"].tolist() == [[4, 5, 6, I], [8, I, I, I], [I, 6, 7, I]]
    pair = Pair((1, 2, 3, 4, 5), (6, 7), (8,))
    assert pack([pair], 4, 0, "keep_end")["input_ids"].tolist() == [[4, 5, 6, 7], [3, 4, 5, 8]]
    with pytest.raises(ArgumentError, match="a prompt of 5 tokens leaves no room"):
        pack([pair], 4, 0, "keep_start")      # the stages drop such a pair before packing


def _cuts(seq: int, mode: str = "keep_start", prompt: int | None = None, completion: int | None = None) -> Cuts:
    return Cuts(SimpleNamespace(seq=seq, truncation_mode=mode, max_prompt_length=prompt,
                                max_completion_length=completion), "pair")


def test_prompts_keep_their_last_tokens_completions_their_first_and_a_full_prompt_is_dropped():
    cuts = _cuts(8, prompt=3, completion=2)
    assert cuts.fit((1, 2, 3, 4, 5, 6), ((7, 8, 9), (10,)), "f:1", False) == ((4, 5, 6), ((7, 8), (10,)))
    assert cuts.lines() == ["truncation     the prompts of 1 pair cut to their last 3 tokens (max_prompt_length); "
                            "the completions of 1 pair cut to their first 2 tokens (max_completion_length)"]
    start = _cuts(4)
    assert start.fit((1, 2, 3, 4), ((5,), (6,)), "f:1", False) is None
    assert start.fit((1, 2), ((3, 4, 5), (6,)), "f:2", False) == ((1, 2), ((3, 4, 5), (6,)))
    assert start.lines() == ["truncation     1 pair dropped, a prompt filling rows of seq 4 (keep_start drops it, "
                             "as TRL does); 1 pair longer than seq 4, cut to their first 4 tokens (keep_start)"]
    end = _cuts(4, "keep_end")
    assert end.fit((1, 2, 3, 4), ((5,), (6,)), "f:1", False) == ((1, 2, 3, 4), ((5,), (6,)))
    assert (end.dropped, end.rows) == (0, 1)
    assert _cuts(4).lines() == []


def test_a_prompt_with_images_is_never_cut():
    with pytest.raises(ArgumentError, match="f:1: the prompt is 6 tokens with its images, past max_prompt_length 3"):
        _cuts(8, prompt=3).fit((1, 2, 3, 4, 5, 6), ((7,), (8,)), "f:1", True)
    with pytest.raises(ArgumentError, match="f:1: the prompt is 4 tokens with its images, which fills rows of seq 4"):
        _cuts(4).fit((1, 2, 3, 4), ((5,), (6,)), "f:1", True)
    with pytest.raises(ArgumentError, match="truncation_mode keep_end would cut the prompt's start"):
        _cuts(4, "keep_end").fit((1, 2, 3), ((5, 6), (7,)), "f:1", True)
    assert _cuts(4).fit((1, 2, 3), ((5, 6), (7,)), "f:1", True) == ((1, 2, 3), ((5, 6), (7,)))   # the end is cut


def test_a_dpo_run_with_one_long_prompt_drops_that_pair_and_says_so(work, capsys):
    run(_config(work, "dropped", data=work["long"]))
    said = capsys.readouterr().out
    assert "stage          dpo: 7 preference pairs, 2 held out" in said
    assert "truncation     1 pair dropped, a prompt filling rows of seq 16 (keep_start drops it, as TRL does)" in said
    assert [r["step"] for r in log.read(str(work["tmp"] / "dropped" / "log.csv"))] == ["1", "2", "3"]


def test_dpo_keep_end_and_max_prompt_length_keep_the_long_pair(work):
    tokenizer = load_tokenizer(work["model"], None)
    end = DPOStage(_config(work, "end", data=work["long"], truncation_mode="keep_end", held=False), tokenizer)
    assert len(end.pairs) == 10 and any(line.startswith("truncation     1 pair longer than seq 16, cut to their "
                                                        "last 16 tokens (keep_end)") for line in end.describe(None))
    pair = end.pairs[3]
    rows = end._pack([pair])
    assert rows["input_ids"][0].tolist() == list((pair.prompt + pair.chosen)[-16:])
    assert rows["labels"][0].tolist()[-len(pair.chosen) - 1:] == list(pair.chosen) + [I]
    cut = DPOStage(_config(work, "cut", data=work["long"], max_prompt_length=8, held=False), tokenizer)
    assert len(cut.pairs) == 10 and len(cut.pairs[3].prompt) == 8
    assert cut.pairs[3].prompt == DPOStage(_config(work, "whole", data=work["long"], seq=64, held=False),
                                           tokenizer).pairs[3].prompt[-8:]


def test_kto_drops_an_example_whose_prompt_fills_the_row_before_pairing_kl_rows(work):
    settings = {"model": work["model"], "stage": "kto", "data": work["examples"], "batch": 2, "seq": 16, "steps": 2,
                "device": "cpu", "run_dir": str(work["tmp"] / "kto")}
    tokenizer = load_tokenizer(work["model"], None)
    stage = KTOStage(load(files.run_yaml(str(work["tmp"] / "kto.yaml"), **settings), []), tokenizer)
    assert len(stage.examples) == 5 and stage.partners == [1, 0, 3, 2, 4]      # TRL pairs what is left
    assert "truncation     1 example dropped" in stage.describe(None)[-1]


def _kto(work, seq: int, **more) -> KTOStage:
    settings = {"model": work["model"], "stage": "kto", "data": work["examples"], "batch": 2, "seq": seq, "steps": 2,
                "device": "cpu", "run_dir": str(work["tmp"] / "kto")}
    return KTOStage(load(files.run_yaml(str(work["tmp"] / "kto.yaml"), **settings, **more), []),
                    load_tokenizer(work["model"], None))


def test_kto_cuts_a_prompt_only_where_its_row_is_too_long_at_the_end_truncation_mode_names(work):
    """KTOConfig's meaning (TRL up to 0.26), not DPOConfig's: max_prompt_length cuts only a prompt
    whose row passes seq, keeping its first (keep_start) or last (keep_end, the default with
    max_prompt_length) tokens, and a row still too long keeps seq - max_prompt_length completion tokens."""
    whole = _kto(work, 128).examples            # prompts of 5 or 6 tokens and completions of 6 or 7; one of 53
    start = _kto(work, 16, max_prompt_length=4, truncation_mode="keep_start")
    end = _kto(work, 16, max_prompt_length=4)
    assert end.c.truncation_mode == "keep_end"
    for w, s, e in zip(whole, start.examples, end.examples, strict=True):
        if len(w.prompt) + len(w.completion) <= 16:     # a prompt past 4 tokens kept whole: its row fits
            assert (s.prompt, s.completion) == (e.prompt, e.completion) == (w.prompt, w.completion)
        else:
            assert (s.prompt, e.prompt) == (w.prompt[:4], w.prompt[-4:]) and s.completion == w.completion
    assert sum(len(w.prompt) > 4 for w in whole) == 6 and len(LONG) > 16
    assert "the prompts of 1 example longer than seq 16 cut to their first 4 tokens" in start.describe(None)[-1]
    long = _kto(work, 16, max_prompt_length=12)         # 12 + 6 > 16: the completion keeps 16 - 12 tokens
    assert [len(e.completion) for e in long.examples] == [len(w.completion) for w in whole[:2]] + [4] + \
        [len(w.completion) for w in whole[3:]]
    # a KL row is fitted by the same rule: the long prompt beside another completion
    assert long.cuts.kl_row(whole[2].prompt, whole[0].completion, False) == (whole[2].prompt[-12:],
                                                                              whole[0].completion[:4])


def test_kto_drops_an_example_max_prompt_length_leaves_no_completion_token(work):
    left = _kto(work, 16, max_prompt_length=16)     # every row of 5 or 6 + 6 or 7 tokens fits; the long one's not
    assert len(left.examples) == 5 and "1 example dropped, no completion token left" in left.describe(None)[-1]


def test_kto_refuses_keep_end_without_max_prompt_length_which_would_cut_nothing(work):
    with pytest.raises(ArgumentError, match="stage kto: truncation_mode keep_end keeps the last max_prompt_length "
                                            "tokens"):
        _kto(work, 16, truncation_mode="keep_end")


def test_kto_takes_a_trl_max_completion_length_which_cuts_a_decoders_rows_by_nothing(work, capsys):
    """A KTOConfig of TRL 0.26 gives max_completion_length, which its trainer read for an
    encoder-decoder alone: the run takes it, says so, and cuts as without it."""
    given = _kto(work, 16, max_completion_length=2)
    assert "max_completion_length 2 cuts nothing, as TRL's KTOTrainer cut only an encoder-decoder's" in \
        capsys.readouterr().out
    assert [(e.prompt, e.completion) for e in given.examples] == \
        [(e.prompt, e.completion) for e in _kto(work, 16).examples]


@pytest.mark.parametrize("more, message", [
    ({"truncation_mode": "keep_middle"}, r"truncation_mode must be one of keep_start, keep_end \(TRL's: which end"),
    ({"max_prompt_length": 0}, "max_prompt_length must be a whole number >= 1; got 0"),
    ({"stage": "kto", "max_prompt_length": "ten"}, "max_prompt_length must be a whole number >= 1"),
    ({"stage": "sft", "truncation_mode": "keep_end"}, "truncation_mode 'keep_end' is not supported under stage sft: "
                                                      r"a record longer than seq keeps its start \(keep_start"),
])
def test_bad_truncation_keys_are_refused_naming_what_they_take(work, more, message):
    with pytest.raises(ArgumentError, match=message):
        _config(work, "bad", **more)


def test_a_checkpoint_saved_before_truncation_mode_resumes_and_a_changed_mode_is_refused(work):
    before = {k: v for k, v in saved_keys(_config(work, "before")).items() if k != "truncation_mode"}
    saved = SimpleNamespace(extra={"stage": before}, path="step-000001")
    check_resume(_config(work, "after"), saved)
    with pytest.raises(ArgumentError, match="truncation_mode 'keep_start' -> 'keep_end'"):
        check_resume(_config(work, "after", truncation_mode="keep_end"), saved)


def test_a_vision_pair_is_refused_where_max_prompt_length_or_keep_end_would_cut_its_images(tmp_path):
    image_pair_files.rlhf_v(str(tmp_path / "data"))
    with pytest.raises(ArgumentError, match=r"rlhf_v.json.*: the prompt is \d+ tokens with its images, past "
                                            "max_prompt_length 8"):
        vision_stage(tmp_path, max_prompt_length=8)
    image_pair_files.rlhf_v(str(tmp_path / "data"), mixed=False)
    with pytest.raises(ArgumentError, match="truncation_mode keep_end would cut the prompt's start"):
        vision_stage(tmp_path, truncation_mode="keep_end", seq=16)    # 13 + 6 tokens
