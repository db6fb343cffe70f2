"""stage rm on a vision-language model whose family transformers gives a sequence classifier (a
tiny Gemma 3: tests/train/processor_files.py): preference pairs with images (LlamaFactory's rlhf_v
layout) train the reward model through the engine as eager torch.optim.AdamW trains it; a run
exports a Gemma3ForSequenceClassification, which scores each pair's rows with their pixels as the
trained reward model does, beside the processor's files; a family without a sequence classifier
(Qwen2.5-VL) is refused by name before anything is read."""
from __future__ import annotations

import copy
import os

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain import RewardModel
from megacompile.train import load, log, run
from megacompile.train.data import images
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages import kind
from tests.posttrain import image_pair_files
from tests.posttrain.test_parity import as_eagerly
from tests.train import files, processor_files

GiB = 2 ** 30


def _settings(tmp_path, family: str = "gemma3", **more) -> dict:
    model = processor_files.model_dir(str(tmp_path / "model"), family)
    image_pair_files.rlhf_v(str(tmp_path / "data"), n=6)
    return {"model": model, "stage": "rm", "dataset": "rlhf_v", "dataset_dir": str(tmp_path / "data"), "batch": 2,
            "seq": 48, "steps": 2, "lr": 1e-2, "device": "cpu", "compute_dtype": "float32",
            "run_dir": str(tmp_path / "run"), "log_every": 1, **more}


def test_a_reward_model_over_pairs_with_images_trains_through_the_engine_as_eagerly(tmp_path):
    """Micro-batches of two pairs (chosen rows, then rejected, each with its prompt's image; a text
    pair among them), margins given: RewardModel over Gemma 3 through the engine at four times the
    weights' bytes (its tower's prologue needs more than twice) gives eager AdamW's losses and first
    moments to 1e-5 and its weights to the float32 noise floor; the engine's rewards are then eager's."""
    from transformers import Gemma3ForConditionalGeneration
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), [])
    stage = kind(c)(c, load_tokenizer(c.model, None), c.run_dir)
    assert sum(bool(p.media) for p, _ in stage.pairs) == 4
    causal = Gemma3ForConditionalGeneration.from_pretrained(c.model, dtype=torch.float32)
    causal.train()
    for name, p in causal.named_parameters():     # the tiny tower's pooling head, which Gemma 3 never reads
        if ".vision_tower.head." in name:       # (released configs have none: vision_use_head false)
            p.requires_grad_(False)
    make = lambda: RewardModel.of(copy.deepcopy(causal), seed=0, center_rewards_coefficient=0.01)  # noqa: E731
    groups = [[0, 1], [3, 4], [2, 0]]
    batches = []
    for k, group in enumerate(groups):
        rows = stage._rows([(stage.pairs[i][0], 0.1 * k) for i in group])
        assert ("pixel_values" in rows) == any(stage.pairs[i][0].media for i in group)
        batches.append(rows)
    weights = sum(p.numel() * 4 for p in make().parameters())
    engine, reference = as_eagerly(make, batches, 4 * weights / GiB)
    try:
        with torch.no_grad():
            for rows in batches:
                scored = {k: v for k, v in rows.items() if k != "margin"}
                assert torch.as_tensor(engine(**scored)) == pytest.approx(reference(**scored), rel=1e-5, abs=1e-5)
    finally:
        engine.close()


def test_a_reward_model_run_with_images_exports_a_classifier_that_scores_as_it_trained(tmp_path):
    """2 steps over rlhf_v pairs with images: the log's margins move; the export is a Gemma 3 sequence
    classifier (its processor's files beside it) whose score of each pair's rows, pixels given and
    pooled at the last token that is not padding, is the reward model's over the same weights."""
    from transformers import AutoModelForSequenceClassification
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), [])
    assert run(c)["steps"] == 2
    rows = log.read(os.path.join(c.run_dir, "log.csv"))
    assert len(rows) == 2 and rows[0]["reward_margin"] != rows[1]["reward_margin"]
    assert images.has_processor(c.run_dir)
    exported = AutoModelForSequenceClassification.from_pretrained(c.run_dir, dtype=torch.float32).eval()
    assert type(exported).__name__ == "Gemma3ForSequenceClassification"
    stage = kind(c)(c, load_tokenizer(c.model, None), None)
    scorer = RewardModel(exported.model, exported.score).eval()
    with torch.no_grad():
        for pair in stage.pairs:
            batch = stage._rows([pair, pair])
            inputs = {k: v for k, v in batch.items() if k not in ("last", "margin")}
            theirs = exported(**inputs).logits.squeeze(-1)
            ours = scorer(**{k: v for k, v in batch.items() if k != "margin"})
            assert theirs.tolist() == pytest.approx(ours.tolist(), rel=1e-5, abs=1e-6)


def test_a_family_without_a_sequence_classifier_is_refused_before_anything_is_read(tmp_path):
    config = files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path, "qwen2_5_vl"))
    with pytest.raises(ArgumentError, match="stage rm saves the reward model as transformers' sequence classifier "
                                            "of its family .* transformers has none for qwen2_5_vl"):
        run(load(config, []))
    assert not os.path.exists(tmp_path / "run")


def test_a_pair_whose_prompt_with_its_images_passes_seq_is_refused_while_reading(tmp_path):
    """Rows are cut at seq; a prompt past it would lose image tokens its pixels still fill, so the
    pair is refused by record, naming both lengths, before any step (a text pair is cut, as TRL cuts)."""
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path)), [])
    stage = kind(c)(c, load_tokenizer(c.model, None), None)
    prompt = max(len(p.prompt) for p, _ in stage.pairs if p.media)
    short = load(files.run_yaml(str(tmp_path / "short.yaml"), **_settings(tmp_path, seq=prompt - 1)), [])
    with pytest.raises(ArgumentError, match=rf"the prompt is {prompt} tokens with its images, past rows of seq "
                                            rf"{prompt - 1}: .*raise seq"):
        kind(short)(short, load_tokenizer(short.model, None), None)


def test_a_qwen3_5_reward_model_over_pairs_with_images_exports_its_classifier(tmp_path):
    """Qwen3.5's classifier holds the whole vision-language model under its score: 2 steps over
    rlhf_v pairs with images, exported as Qwen3_5ForSequenceClassification, which scores each
    pair's rows with their pixels as the trained reward model does; the run's last line is of the
    plan its last step ran, its measured device peak the predicted one. (transformers maps the
    qwen3_5 model type to its byte-level BPE tokenizer whatever the folder's tokenizer.json holds,
    and the tiny folders' vocabulary is whole words: the run reads the same tokenizer and processor
    from a tiny Qwen3-VL folder, `tokenizer:`.)"""
    from transformers import AutoModelForSequenceClassification
    from tests.train import qwen_files
    tokenizer = qwen_files.model_dir(str(tmp_path / "tokenizer"), family="qwen3_vl")
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **_settings(tmp_path, "qwen3_5", tokenizer=tokenizer)), [])
    result = run(c)
    assert result["steps"] == 2 and 0 < result["measured_device_peak_bytes"] == result["predicted_device_peak_bytes"]
    exported = AutoModelForSequenceClassification.from_pretrained(c.run_dir, dtype=torch.float32).eval()
    assert type(exported).__name__ == "Qwen3_5ForSequenceClassification"
    stage = kind(c)(c, load_tokenizer(c.tokenizer, None), None)
    assert sum(bool(p.media) for p, _ in stage.pairs) == 4
    scorer = RewardModel(exported.model, exported.score).eval()
    with torch.no_grad():
        for pair in stage.pairs:
            batch = stage._rows([pair, pair])
            theirs = exported(**{k: v for k, v in batch.items() if k not in ("last", "margin")}).logits.squeeze(-1)
            ours = scorer(**{k: v for k, v in batch.items() if k != "margin"})
            assert theirs.tolist() == pytest.approx(ours.tolist(), rel=1e-5, abs=1e-6)
