"""stage: kto from run.yaml: TRL's unpaired and paired records and LlamaFactory's kto_tag datasets
train the same run from the same examples, each prompt's KL row takes the completion TRL gives it
(LlamaFactory's datasets: the one LlamaFactory gives it, so its batch of one trains), and a resumed
run writes the uninterrupted run's log."""
from __future__ import annotations

import json
import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages.kto import KTOStage
from megacompile.train.stages.reference import REFERENCE
from tests.posttrain import stage_files
from tests.train import files
from tests.train.killed import TIMED      # the measured columns, which differ run to run

S = files.SENTENCES


def _rows(run_dir) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMED} for r in log.read(os.path.join(str(run_dir), "log.csv"))]


def _conversations() -> list[tuple[list, list, bool]]:
    return [([{"role": "user", "content": S[i]}], [{"role": "assistant", "content": S[(i * 3 + 1) % 10]}], i % 3 != 1)
            for i in range(10)]


def _write(path, records) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def _kto(work, name: str, **more) -> dict:
    return {"model": work["model"], "stage": "kto", "batch": 2, "seq": 16, "steps": 4, "lr": 1e-2, "warmup": 0,
            "schedule": "constant", "device": "cpu", "hbm_budget": 1, "run_dir": name, "log_every": 1, **more}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kto")
    made = stage_files.workspace(tmp)
    made["tmp"] = tmp
    made["unpaired"] = _write(tmp / "unpaired.jsonl", [{"prompt": p, "completion": c, "label": label}
                                                       for p, c, label in _conversations()])
    return made


def test_a_kto_run_learns_which_completions_are_desirable(work, capsys):
    tmp = work["tmp"]
    text = _write(tmp / "text.jsonl", [{"prompt": S[i], "completion": " " + S[(i * 3 + 1) % 10], "label": i % 2 == 0}
                                       for i in range(10)])
    result = run(load(files.run_yaml(str(tmp / "text.yaml"), **_kto(work, str(tmp / "text"), data=text, steps=12,
                                                                     eval=text, eval_every=6))))
    said = capsys.readouterr().out
    assert "stage          kto: 10 completions (5 desirable, 5 undesirable)" in said and "loss kto, beta 0.1" in said
    rows = log.read(str(tmp / "text" / "log.csv"))
    assert result["first_loss"] == pytest.approx(0.5)     # the policy is the reference: 1 - sigmoid(0) each
    assert {"rewards_chosen", "rewards_rejected", "kl", "eval_loss"} <= set(rows[0])
    # held to the training examples themselves: the policy raises the desirable completions above the rest
    evals = [{k: float(r[k]) for k in ("eval_loss", "eval_rewards_chosen", "eval_rewards_rejected")}
             for r in rows if r["eval_loss"]]
    assert 0.5 > evals[0]["eval_loss"] > evals[1]["eval_loss"]
    assert evals[1]["eval_rewards_chosen"] > 0 > evals[1]["eval_rewards_rejected"]
    assert os.path.isfile(tmp / "text" / REFERENCE)


def test_each_prompts_kl_row_takes_the_completion_trl_gives_it(work):
    c = load(files.run_yaml(str(work["tmp"] / "rows.yaml"), **_kto(work, "rows", data=work["unpaired"], batch=3)))
    stage = KTOStage(c, load_tokenizer(work["model"], None))
    assert stage.partners == [2, 0, 1, 5, 3, 4, 8, 6, 7, 9]
    rows, kl, desirable = stage._rows(stage.examples, [4, 9], stage.partners)
    want = [stage.examples[4].prompt + stage.examples[3].completion,
            stage.examples[9].prompt + stage.examples[9].completion]      # the last chunk, of one, its own
    for r, ids in enumerate(want):
        assert kl["input_ids"][r, :len(ids)].tolist() == list(ids)
        counted = kl["labels"][r][kl["labels"][r] != -100].tolist()
        assert counted == list(stage.examples[[3, 9][r]].completion)       # the partner's completion is scored
    assert desirable.tolist() == [0.0, 1.0]     # labels i % 3 != 1 (_conversations)


def _llamafactory(work, name: str, **more) -> str:
    """A LlamaFactory KTO run.yaml over a kto_tag dataset of _conversations()."""
    tmp = work["tmp"]
    folder = tmp / "lf"
    if not folder.exists():
        folder.mkdir()
        _write(folder / "kto.jsonl", [{"messages": prompt + answer, "label": label} for prompt, answer, label in
                                      _conversations()])
        (folder / "dataset_info.json").write_text(json.dumps({"kto_demo": {
            "file_name": "kto.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages", "kto_tag": "label"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}}}))
    settings = dict(model_name_or_path=work["model"], stage="kto", do_train=True, dataset="kto_demo",
                    dataset_dir=str(folder), cutoff_len=16, per_device_train_batch_size=10, learning_rate=1e-2,
                    max_steps=4, lr_scheduler_type="constant", logging_steps=1, kto_chosen_weight=1.2,
                    kto_rejected_weight=0.8, pref_beta=0.1, output_dir=str(tmp / name), device="cpu", hbm_budget=1)
    return files.run_yaml(str(tmp / f"{name}.yaml"), **(settings | more))


def test_llamafactory_kto_tag_datasets_and_trl_records_train_the_same_run(work):
    """The same examples read from either layout; at a batch of all ten examples TRL's chunk and
    LlamaFactory's (1,000) pair the same KL rows, so the runs are the same run."""
    tmp = work["tmp"]
    run(load(_llamafactory(work, "lf_run")))
    run(load(files.run_yaml(str(tmp / "trl.yaml"), **_kto(work, str(tmp / "trl_run"), data=work["unpaired"], batch=10,
                                                         desirable_weight=1.2, undesirable_weight=0.8))))
    a, b = _rows(tmp / "lf_run"), _rows(tmp / "trl_run")
    assert len(a) == 4 and a == b


def test_llamafactory_pairs_the_kl_rows_across_its_preprocessing_batch_before_the_split(work, capsys):
    """LlamaFactory's feedback processor gives each example the completion of the one before it
    over its preprocessing batch (1,000), before val_size holds examples out: a micro-batch of
    one (its own KTO example's per_device_train_batch_size) has the KL row of another completion."""
    c = load(_llamafactory(work, "lf_one", per_device_train_batch_size=1, val_size=0.3, eval_strategy="steps",
                           eval_steps=2))
    stage = KTOStage(c, load_tokenizer(work["model"], None))
    whole = KTOStage(load(_llamafactory(work, "lf_whole", per_device_train_batch_size=1)),
                     load_tokenizer(work["model"], None))
    before = {e.prompt: whole.examples[i - 1].completion for i, e in enumerate(whole.examples)}
    assert len(stage.examples) == 7 and len(stage.held) == 3
    assert all(e.kl == before[e.prompt] != e.completion for e in stage.examples + stage.held)
    rows, kl, _ = stage._rows(stage.examples, [4], stage.partners)
    ids = stage.examples[4].prompt + before[stage.examples[4].prompt]
    assert kl["input_ids"][0, :len(ids)].tolist() == list(ids)
    result = run(c)
    assert result["steps"] == 4
    assert "kl rows        each prompt with the completion before it, in chunks of 1,000 examples" in \
        capsys.readouterr().out


def test_paired_records_train_as_trl_unpairs_them(work):
    tmp = work["tmp"]
    pairs = [json.loads(line) for line in open(work["pairs"])]
    examples = [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
                for k in ("chosen", "rejected") for p in pairs]         # a map batch's chosen, then its rejected
    unpaired = _write(tmp / "unpaired_pairs.jsonl", examples)
    run(load(files.run_yaml(str(tmp / "paired.yaml"), **_kto(work, str(tmp / "paired"), data=work["pairs"]))))
    run(load(files.run_yaml(str(tmp / "split.yaml"), **_kto(work, str(tmp / "split"), data=unpaired))))
    assert _rows(tmp / "paired") == _rows(tmp / "split")


def test_a_resumed_kto_run_writes_the_uninterrupted_log(work):
    tmp = work["tmp"]
    whole = files.run_yaml(str(tmp / "whole.yaml"), **_kto(work, str(tmp / "whole"), data=work["unpaired"]))
    run(load(whole))
    cut = files.run_yaml(str(tmp / "cut.yaml"), **_kto(work, str(tmp / "cut"), data=work["unpaired"], steps=2))
    run(load(cut))
    run(load(cut, ["steps=4", "resume=auto"]))
    assert _rows(tmp / "cut") == _rows(tmp / "whole")
    with pytest.raises(ArgumentError, match="other post-training keys .*desirable_weight 1.0 -> 2.0"):
        run(load(cut, ["steps=5", "resume=auto", "desirable_weight=2.0"]))
    # another batch pairs other KL rows, whose reference log-probabilities the run folder does not hold
    with pytest.raises(ArgumentError, match="reference log-probabilities of other tokens than this run's batch"):
        run(load(cut, ["steps=5", "resume=auto", "batch=3"]))


@pytest.mark.parametrize("more, words", [
    ({"batch": 1}, "batch (per_device_train_batch_size) must be at least 2"),
    ({"loss_type": "sigmoid"}, "stage kto: loss_type must be one of kto, apo_zero_unpaired"),
    ({"stage": "dpo", "desirable_weight": 2.0}, "desirable_weight (stage kto) belongs to another stage"),
    ({"beta": 0}, "beta must be a positive number"),
])
def test_kto_settings_are_checked_before_anything_runs(work, more, words):
    path = files.run_yaml(str(work["tmp"] / "bad.yaml"), **_kto(work, "bad", data=work["unpaired"], **more))
    with pytest.raises(ArgumentError) as e:
        load(path)
    assert words in str(e.value)


def test_apo_zero_unpaired_runs_no_kl_rows(work):
    import torch
    tmp = work["tmp"]
    run(load(files.run_yaml(str(tmp / "apo.yaml"), **_kto(work, str(tmp / "apo"), data=work["unpaired"], steps=2,
                                                         loss_type="apo_zero_unpaired"))))
    kept = torch.load(tmp / "apo" / REFERENCE)
    assert kept["train"][:, 0].abs().min() > 0 and kept["train"][:, 1].eq(0).all()     # no KL row scored
    assert all(float(r["kl"]) == 0.0 for r in log.read(str(tmp / "apo" / "log.csv")))


def test_the_progress_line_shows_no_nan_for_a_kind_a_step_had_none_of():
    """A step of desirable examples alone has no rejected reward: the bar shows '-', not nan."""
    text, _ = KTOStage.progress(None, {"rewards_chosen": 0.125, "rewards_rejected": float("nan"), "kl": 0.5}, 0)
    assert text == "rewards 0.1250 / - | kl 0.5000"
