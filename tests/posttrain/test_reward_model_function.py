"""A reward model's folder as a reward function (posttrain/reward_models.py), as TRL's GRPOTrainer
takes one: text prompts followed by their completion, conversations through the reward model's
chat template, tokenized without special tokens and padded on the right, the reward its one logit.
A GRPO run named with the folder (beside its run.yaml) logs those rewards; a folder that is not a
one-label classifier is refused before anything is written."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from megacompile.errors import ArgumentError
from megacompile.posttrain import rewards
from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files


def _reward_model(path: str, labels: int = 1) -> str:
    tok = files.tokenizer()
    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=labels, pad_token_id=tok.pad_token_id, initializer_range=0.5)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _trl_scores(folder: str, texts: list[str]) -> list[float]:
    """TRL's scoring, written out: one text at a time (no padding at all), the last token's logit."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        return [model(**tok(t, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item() for t in texts]


def test_text_and_conversational_prompts_are_scored_as_trl_scores_them(tmp_path):
    folder = _reward_model(str(tmp_path / "rm"))
    score = rewards.load(folder)
    assert score.__name__ == "rm" and score.model is None            # read at the first call
    prompts, completions = ["the cat sat", "a dog ran far"], [" on the mat", " away"]
    got = score(prompts=prompts, completions=completions)
    assert got == pytest.approx(_trl_scores(folder, [p + c for p, c in zip(prompts, completions)]), abs=1e-5)
    assert len(set(got)) == 2
    chats = [[{"role": "user", "content": p}] for p in prompts]
    replies = [[{"role": "assistant", "content": c.strip()}] for c in completions]
    texts = [score.tokenizer.apply_chat_template(m + r, tokenize=False) for m, r in zip(chats, replies)]
    assert texts[0] != prompts[0] + completions[0] and completions[0].strip() in texts[0]
    assert score(prompts=chats, completions=replies) == pytest.approx(_trl_scores(folder, texts), abs=1e-5)


def test_a_folder_that_is_not_a_one_label_classifier_is_refused(tmp_path):
    with pytest.raises(ArgumentError, match=r"reward model .* must be a sequence classifier with one label .*"
                                            r"num_labels 2"):
        rewards.load(_reward_model(str(tmp_path / "two"), labels=2))
    lm = files.model_dir(str(tmp_path / "lm"), dim=32)
    with pytest.raises(ArgumentError, match=r"architectures \['LlamaForCausalLM'\]"):
        rewards.load(lm)
    with pytest.raises(ArgumentError, match="one of exact_answer, format_check, or a reward model's folder; got "
                                            "'no_such_folder'"):
        rewards.load("no_such_folder")


def test_a_grpo_run_is_rewarded_by_a_reward_model_beside_its_run_yaml(tmp_path):
    work = stage_files.workspace(tmp_path)
    _reward_model(str(tmp_path / "rm"))
    stage_files.CALLS.clear()
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), steps=1, reward_funcs=["rm", "tests.posttrain.stage_files:starts_like_prompt"],
        reward_weights=[1.0, 0.0]))
    c = load(config, [])
    assert c.reward_funcs[0] == str(tmp_path / "rm")      # found beside the run.yaml, kept as a path
    run(c)
    (call,) = stage_files.CALLS
    scored = _trl_scores(str(tmp_path / "rm"), [p + t for p, t in zip(call["prompts"], call["completions"])])
    (row,) = log.read(str(tmp_path / "run" / "log.csv"))
    assert float(row["rewards/rm/mean"]) == pytest.approx(sum(scored) / len(scored), abs=1e-5)
    assert float(row["reward"]) == pytest.approx(sum(scored) / len(scored), abs=1e-5)     # weight 0 on the other
