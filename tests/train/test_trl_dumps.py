"""A TRL config as its `to_dict()` writes it, every field of transformers' TrainingArguments and of
TRL's config included (tests/train/trl_dumps/, made by TRL 1.16 with transformers 5.24), loads as a
run.yaml with the model and the data added: the fields at their defaults ask for nothing and say
nothing; one away from its default is refused naming why, or named in the note of ignored keys
where it changes nothing trained."""
from __future__ import annotations

import os

import pytest
import yaml

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.trainer_args import ASK_NOTHING, NO_EFFECT, QUIET, at_default
from tests.posttrain import stage_files
from tests.train import files

DUMPS = os.path.join(os.path.dirname(__file__), "trl_dumps")


def _dump(stage: str) -> dict:
    with open(os.path.join(DUMPS, f"{stage}.yaml")) as f:
        return yaml.safe_load(f)


def _keys(tmp_path, stage: str, **more) -> str:
    work = stage_files.workspace(tmp_path)
    data = {"sft": files.chats(str(tmp_path / "chats.jsonl")), "grpo": work["prompts"]}.get(stage, work["pairs"])
    # a GRPOTrainer takes its reward functions as an argument, not from its config
    rewards = {"reward_funcs": ["format_check"]} if stage == "grpo" else {}
    keys = {**_dump(stage), "model": work["model"], "data": data, "output_dir": str(tmp_path / "out"),
            "device": "cpu", **({"stage": stage} if stage != "sft" else {}), **rewards, **more}
    return files.run_yaml(str(tmp_path / "run.yaml"), **keys)


@pytest.mark.parametrize("stage", ["sft", "dpo", "kto", "rm", "grpo"])
def test_a_trl_config_dump_loads_with_do_train_given(tmp_path, stage, capsys):
    dump = _dump(stage)
    with pytest.raises(ArgumentError, match="do_train False: megacompile train always trains; .*a dump of "
                                            "transformers' TrainingArguments writes false"):
        load(_keys(tmp_path, stage), [])
    c = load(_keys(tmp_path, stage, do_train=True), [])
    assert (c.lr, c.batch, c.grad_accum, c.compute_dtype) == (
        dump["learning_rate"], dump["per_device_train_batch_size"], dump["gradient_accumulation_steps"], "bfloat16")
    out = capsys.readouterr().out
    ignored = out.split("ignored (no effect in a megacompile run): ")[1].splitlines()[0] if "ignored (" in out else ""
    # fields at their defaults are not named; disable_dropout is read (TRL's default of the stage)
    assert ignored == "", ignored
    assert c.disable_dropout is dump.get("disable_dropout", False)
    # every field the tables know is at a default the dump writes
    assert all(at_default(k, dump[k]) for k in dump if k in ASK_NOTHING or k in NO_EFFECT or k in QUIET)


def test_a_field_away_from_its_default_is_refused_or_named(tmp_path, capsys):
    with pytest.raises(ArgumentError, match=r"torch_compile -> megacompile compiles the step itself"):
        load(_keys(tmp_path, "sft", do_train=True, torch_compile=True), [])
    with pytest.raises(ArgumentError, match=r"train_sampling_strategy 'group_by_length' is not supported: rows are "
                                            r"shuffled by seed \(random\) or taken in the files' order"):
        load(_keys(tmp_path, "sft", do_train=True, train_sampling_strategy="group_by_length"), [])
    c = load(_keys(tmp_path, "sft", do_train=True, train_sampling_strategy="random", disable_tqdm=True), [])
    out = capsys.readouterr().out
    assert "disable_tqdm (the run's own progress lines and log.csv)" in out and "train_sampling_strategy" not in out
    assert c.disable_shuffling is False


def test_sequential_sampling_takes_the_files_order_as_ktos_default_does(tmp_path):
    """KTOConfig's dump writes train_sampling_strategy: sequential (its KL rows are paired in the files'
    order): the run takes its examples in that order, as disable_shuffling does."""
    assert load(_keys(tmp_path, "kto", do_train=True), []).disable_shuffling is True
    assert load(_keys(tmp_path, "sft", do_train=True, train_sampling_strategy="sequential"), []).disable_shuffling


@pytest.mark.parametrize("strategy, packing", [("bfd", "isolated"), ("ffd", "isolated"), ("wrapped", True)])
def test_packing_reads_trls_packing_strategy(tmp_path, capsys, strategy, packing):
    """TRL's bfd (its default; ffd, its earlier name, as in SmolLM3's recipe) keeps the packed
    documents apart; wrapped cuts the token stream into rows, as LlamaFactory's packing: true does;
    bfd_split, which splits a long document across rows, is refused."""
    c = load(_keys(tmp_path, "sft", do_train=True, packing=True, packing_strategy=strategy), [])
    assert c.packing == packing
    said = capsys.readouterr().out
    assert (f"packing_strategy {strategy} keeps the packed documents apart" in said) == (packing == "isolated")
    assert load(_keys(tmp_path, "sft", do_train=True, packing=False, packing_strategy=strategy), []).packing is False
    with pytest.raises(ArgumentError, match="packing_strategy must be bfd .* or wrapped"):
        load(_keys(tmp_path, "sft", do_train=True, packing=True, packing_strategy="best_fit"), [])
    with pytest.raises(ArgumentError, match="packing_strategy bfd_split splits a document longer than a row"):
        load(_keys(tmp_path, "sft", do_train=True, packing=True, packing_strategy="bfd_split"), [])


def test_grpo_reads_num_generations_eval(tmp_path):
    """TRL samples num_generations_eval completions of each eval prompt (stage grpo's evaluation);
    left at null, the evaluation here is one greedy completion of each."""
    assert load(_keys(tmp_path, "grpo", do_train=True), []).num_generations_eval is None
    assert load(_keys(tmp_path, "grpo", do_train=True, num_generations_eval=4), []).num_generations_eval == 4
