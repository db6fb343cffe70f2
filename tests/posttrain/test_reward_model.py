"""Reward modelling (stage rm): the Bradley-Terry loss, a decoder with a one-number head that scores
as transformers' sequence classifier does, trained through the engine exactly as eager AdamW
trains it, and a run whose exported model is that classifier with the trained weights."""
from __future__ import annotations

import copy
import json
import math
import os

import pytest
import torch

from megacompile import minimum_budget
from megacompile.acceptance.parity import float64_noise, moment_error, weight_bytes
from megacompile.errors import ArgumentError
from megacompile.posttrain import RewardModel, reward_loss
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages.rm import RMStage, scored_rows
from tests.e2e.harness import assert_same_weights
from tests.posttrain import stage_files
from tests.posttrain.test_parity import _eager, through_engine
from tests.train import files
from tests.train.killed import TIMED

GiB = 2**30


def _causal_lm(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                        use_cache=False))


def test_the_loss_is_bradley_terry_with_trls_margin_and_centring():
    chosen, rejected = torch.tensor([0.5, -1.0], requires_grad=True), torch.tensor([0.25, 0.5], requires_grad=True)
    margin = torch.tensor([0.0, 0.5])
    got = reward_loss(chosen, rejected, margin, center=0.01)
    log_sig = lambda x: -math.log1p(math.exp(-x))      # noqa: E731
    want = [-log_sig(0.25) + 0.01 * 0.75 ** 2, -log_sig(-2.0) + 0.01 * 0.5 ** 2]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    got.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()    # the chosen pulled up, the rejected down


def test_the_reward_model_scores_as_transformers_sequence_classifier():
    from transformers import LlamaConfig, LlamaForSequenceClassification
    lm = _causal_lm()
    model = RewardModel.of(lm, seed=1)
    assert model.left_out == ("lm_head.weight",)        # the causal LM's head the files hold, unused
    classifier = LlamaForSequenceClassification(LlamaConfig(**{**lm.config.to_dict(), "num_labels": 1}))
    classifier.load_state_dict(model.state_dict(), strict=True)      # the same names, every one of them
    ids = torch.randint(1, 48, (3, 8), generator=torch.Generator().manual_seed(2))
    ids[1, 5:], ids[2, 7:] = 0, 0       # right padding, pad id 0
    rows = {"input_ids": ids, "last": (torch.arange(8) * (ids != 0)).argmax(-1)}
    assert rows["last"].tolist() == [7, 4, 6]
    with torch.no_grad():
        assert model(**rows).tolist() == pytest.approx(classifier(ids).logits.squeeze(-1).tolist(), abs=1e-6)


def test_rows_are_scored_at_their_last_token_that_is_not_padding():
    from megacompile.posttrain import Pair
    pairs = [Pair((5, 6), (7, 8, 9), (7,)), Pair((5,), (6, 7, 8, 9, 10, 11), (12, 13))]
    rows = scored_rows(pairs, [0.0, 1.5], 6, 0)
    assert rows["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0], [5, 6, 7, 8, 9, 10],      # cut at seq
                                          [5, 6, 7, 0, 0, 0], [5, 12, 13, 0, 0, 0]]
    assert rows["last"].tolist() == [4, 5, 2, 2] and rows["margin"].tolist() == [0.0, 1.5]


def test_a_reward_model_trains_through_the_engine_as_eager_adamw_trains_it():
    lm = _causal_lm()
    g = torch.Generator().manual_seed(3)
    batches = []
    for step in range(3):
        ids = torch.randint(1, 48, (4, 10), generator=g)
        ids[1, 7:], ids[3, 8:] = 0, 0
        batches.append({"input_ids": ids, "last": (torch.arange(10) * (ids != 0)).argmax(-1),
                        "margin": torch.tensor([0.0, 0.5 * step])})
    make = lambda: RewardModel.of(copy.deepcopy(lm), seed=1, center_rewards_coefficient=0.01)      # noqa: E731
    reference = make()
    moments: dict = {}
    losses = _eager(reference, batches, moments)
    noise = float64_noise(lambda exact: _eager(exact, [{k: v.double() if v.is_floating_point() else v
                                                         for k, v in b.items()} for b in batches]), make(), reference)
    smallest = minimum_budget(make(), compute_dtype=torch.float32, hardware="cpu", inputs=batches[0])
    for budget in (2 * weight_bytes(reference) / GiB, smallest):
        ours, first, engine = through_engine(make(), batches, budget)
        assert ours == pytest.approx(losses, rel=1e-5, abs=1e-7), (budget, ours, losses)
        assert moment_error(first, moments) <= 1e-5
        assert_same_weights(engine, reference, noise=noise)
        assert engine.memory_stats()["device_peak_bytes"] == engine.plan.predicted_peak_bytes
        engine.close()


def test_an_rm_run_exports_the_classifier_that_scores_as_its_log_says(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification
    work = stage_files.workspace(tmp_path)
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "stage": "rm", "lr": 1e-3,
                "center_rewards_coefficient": 0.01}
    config = files.run_yaml(str(tmp_path / "rm.yaml"), **settings)
    run(load(config))
    assert "AutoModelForSequenceClassification.from_pretrained(" in capsys.readouterr().out
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    assert [bool(r["eval_loss"]) for r in rows] == [False, True, True]
    classifier = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "run")).eval()
    assert classifier.config.num_labels == 1 and classifier.config.pad_token_id is not None
    c = load(config)
    stage = RMStage(c, load_tokenizer(work["model"], None))
    held = scored_rows([p for p, _ in stage.held], [m for _, m in stage.held], c.seq, stage.pad)
    with torch.no_grad():
        scores = classifier(held["input_ids"]).logits.squeeze(-1)      # pooled by transformers itself
    n = len(stage.held)
    assert float(rows[-1]["eval_rewards_chosen"]) == pytest.approx(scores[:n].mean().item(), abs=1e-5)
    assert float(rows[-1]["eval_rewards_rejected"]) == pytest.approx(scores[n:].mean().item(), abs=1e-5)
    with open(tmp_path / "run" / "config.json") as f:
        assert json.load(f)["architectures"] == ["LlamaForSequenceClassification"]
    assert not os.path.exists(tmp_path / "run" / "reference_logps.pt")


@pytest.mark.parametrize("merge", [False, True])
def test_a_lora_rm_run_exports_adapters_and_head_that_score_as_its_log_says(tmp_path, capsys, merge):
    """LlamaFactory's LoRA reward example's shape: adapters on the decoder and the new head trained,
    the base frozen; the export is PEFT's sequence-classification adapter (the adapters and the
    head), or with merge_adapter the merged classifier, and either scores the held-out pairs as the
    run's last eval did."""
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    work = stage_files.workspace(tmp_path)
    if not merge:       # a base config without a padding token (Llama's): the last line names the one to give
        with open(os.path.join(work["model"], "config.json")) as f:
            base_config = json.load(f)
        pad = base_config.pop("pad_token_id")
        with open(os.path.join(work["model"], "config.json"), "w") as f:
            json.dump(base_config, f)
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "stage": "rm", "lr": 1e-2, "finetuning_type": "lora",
                "lora_rank": 4, "lora_dropout": 0, "merge_adapter": merge}
    config = files.run_yaml(str(tmp_path / "rm.yaml"), **settings)
    run(load(config))
    said = capsys.readouterr().out
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    if merge:
        classifier = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "run"))
        assert not os.path.exists(tmp_path / "run" / "adapter_config.json")
        base = AutoModelForSequenceClassification.from_pretrained(work["model"], num_labels=1)
        assert torch.equal(classifier.model.embed_tokens.weight, base.model.embed_tokens.weight)    # frozen
        assert not torch.equal(classifier.model.layers[0].self_attn.q_proj.weight,
                               base.model.layers[0].self_attn.q_proj.weight)        # the adapter merged in
    else:
        assert (f"PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(base, num_labels=1, "
                f"pad_token_id={pad}), ") in said
        base = AutoModelForSequenceClassification.from_pretrained(work["model"], num_labels=1, pad_token_id=pad)
        classifier = PeftModel.from_pretrained(base, str(tmp_path / "run"))
        assert not os.path.exists(tmp_path / "run" / "config.json")
    classifier.eval()
    c = load(config)
    stage = RMStage(c, load_tokenizer(work["model"], None))
    held = scored_rows([p for p, _ in stage.held], [m for _, m in stage.held], c.seq, stage.pad)
    with torch.no_grad():
        scores = classifier(held["input_ids"]).logits.squeeze(-1)
    n = len(stage.held)
    first = float(rows[0]["rewards_chosen"])
    assert float(rows[-1]["eval_rewards_chosen"]) == pytest.approx(scores[:n].mean().item(), abs=1e-5)
    assert float(rows[-1]["eval_rewards_rejected"]) == pytest.approx(scores[n:].mean().item(), abs=1e-5)
    assert float(rows[-1]["eval_rewards_chosen"]) != pytest.approx(first, abs=1e-4)     # it trained


@pytest.mark.parametrize("more, words", [
    ({"finetuning_type": "lora", "lora_dropout": 0, "lora_target": "q_proj,lm_head"},
     "lora_target lm_head: a reward model scores with a new head"),
    ({"center_rewards_coefficient": -1}, "center_rewards_coefficient weighs (r+ + r-)^2"),
    ({"beta": 0.1}, "beta (stage dpo or kto or grpo) belongs to another stage"),
])
def test_rm_settings_are_checked_before_anything_runs(tmp_path, more, words):
    work = stage_files.workspace(tmp_path)
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "rm.yaml"), **{**stage_files.dpo(work, "run"), "stage": "rm", **more}))
    assert words in str(e.value)


def test_llamafactorys_rm_reads_ranking_datasets_only(tmp_path):
    work = stage_files.workspace(tmp_path)
    with open(tmp_path / "dataset_info.json", "w") as f:
        json.dump({"pairs": {"file_name": "pairs.jsonl", "ranking": True},
                   "plain": {"file_name": "pairs.jsonl"}}, f)
    lf = {"model_name_or_path": work["model"], "stage": "rm", "dataset_dir": str(tmp_path), "cutoff_len": 16,
          "max_steps": 1, "device": "cpu"}
    c = load(files.run_yaml(str(tmp_path / "lf.yaml"), **lf, dataset="pairs"))
    assert c.data[0]["path"] == work["pairs"]
    with pytest.raises(ArgumentError, match="plain in .* is not a ranking dataset, and stage rm trains on"):
        load(files.run_yaml(str(tmp_path / "lf.yaml"), **lf, dataset="plain"))


def test_a_records_margin_is_read_and_one_that_is_not_a_number_refused(tmp_path):
    work = stage_files.workspace(tmp_path)
    pairs = [json.loads(line) for line in open(work["pairs"])]
    for margin, name in ((1.5, "good"), ("big", "bad")):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({**p, "margin": margin if i == 1 else 0.0}) + "\n"
                                for i, p in enumerate(pairs)))
        c = load(files.run_yaml(str(tmp_path / "rm.yaml"), **{**stage_files.dpo(work, "run"), "stage": "rm",
                                                               "data": str(path), "eval_fraction": 0,
                                                               "eval_every": None}))
        if name == "good":
            assert [m for _, m in RMStage(c, load_tokenizer(work["model"], None)).pairs][:3] == [0.0, 1.5, 0.0]
        else:
            with pytest.raises(ArgumentError, match=r"bad.jsonl:2: margin .* is a number; got 'big'"):
                RMStage(c, load_tokenizer(work["model"], None))


def test_a_resumed_rm_run_writes_the_uninterrupted_log(tmp_path):
    work = stage_files.workspace(tmp_path)
    settings = {**stage_files.dpo(work, ""), "stage": "rm", "lr": 1e-3, "steps": 4, "eval_every": 2}
    rows = {}
    for name, steps in (("whole", [4]), ("cut", [2, 4])):
        config = files.run_yaml(str(tmp_path / f"{name}.yaml"), **{**settings, "run_dir": name})
        for n in steps:
            run(load(config, [f"steps={n}", "resume=auto"]))
        rows[name] = [{k: v for k, v in r.items() if k not in TIMED}
                      for r in log.read(str(tmp_path / name / "log.csv"))]
    assert len(rows["whole"]) == 4 and rows["cut"] == rows["whole"]      # the new head's trained weights resumed
