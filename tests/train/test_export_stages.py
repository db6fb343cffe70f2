"""`megacompile export` of a reward model's checkpoint (stage rm) and of a vision-language model's:
written as the run writes its model at its end. An intermediate step's reward model scores the
held-out pairs as the run logged at that step; a vision-language model's export holds the
checkpoint's weights under transformers' names, with the processor's files, and its last step's
export is the run's own, file for file."""
from __future__ import annotations

import filecmp
import os

import pytest
import torch
from safetensors.torch import load_file

from megacompile.cli import main
from megacompile.train import load, log, run
from megacompile.train.data.tokens import load_tokenizer
from megacompile.train.stages.rm import RMStage, scored_rows
from tests.posttrain import stage_files
from tests.train import files, finetune_runs, vlm_files


def _step(run_dir: str, n: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step-{n:06d}")


def _rm_run(folder, name: str, **extra) -> str:
    """A 2-step rm run evaluated and checkpointed at every step; its run.yaml."""
    folder = str(folder)
    work = {"model": os.path.join(folder, "model"), "pairs": os.path.join(folder, "pairs.jsonl")}
    if not os.path.isdir(work["model"]):
        work = stage_files.workspace(folder)
    settings = {**stage_files.dpo(work, os.path.join(folder, name)), "stage": "rm", "steps": 2, "eval_every": 1,
                "save_every": 1, **extra}
    config = files.run_yaml(os.path.join(folder, f"{name}.yaml"), **settings)
    run(load(config))
    return config


@pytest.fixture(scope="module")
def rm(tmp_path_factory):
    return _rm_run(tmp_path_factory.mktemp("rm"), "rm")


def _scores(config: str, classifier) -> tuple[float, float]:
    """The mean rewards of the held-out pairs' chosen and rejected rows, as transformers pools them."""
    c = load(config)
    stage = RMStage(c, load_tokenizer(c.model, None))
    held = scored_rows([p for p, _ in stage.held], [m for _, m in stage.held], c.seq, stage.pad)
    with torch.no_grad():
        scores = classifier.eval()(held["input_ids"]).logits.squeeze(-1)
    n = len(stage.held)
    return scores[:n].mean().item(), scores[n:].mean().item()


def _logged(config: str, step: int) -> tuple[float, float]:
    c = load(config)
    row = next(r for r in log.read(os.path.join(c.run_dir, "log.csv")) if int(r["step"]) == step)
    return float(row["eval_rewards_chosen"]), float(row["eval_rewards_rejected"])


def test_a_reward_models_intermediate_checkpoint_scores_as_the_run_logged_at_its_step(rm, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification
    run_dir = load(rm).run_dir
    out = str(tmp_path / "step1")
    assert main(["export", _step(run_dir, 1), out]) == 0
    assert "AutoModelForSequenceClassification.from_pretrained(" in capsys.readouterr().out
    classifier = AutoModelForSequenceClassification.from_pretrained(out, dtype=torch.float32)
    assert classifier.config.num_labels == 1 and classifier.config.pad_token_id is not None
    assert _scores(rm, classifier) == pytest.approx(_logged(rm, 1), abs=1e-5)
    assert _logged(rm, 2) != pytest.approx(_logged(rm, 1), abs=1e-4)        # step 2's model scores otherwise
    last = str(tmp_path / "step2")      # the last step's export is the run's own
    assert main(["export", _step(run_dir, 2), last]) == 0
    mine = load_file(os.path.join(last, "model.safetensors"))
    its = load_file(os.path.join(run_dir, "model.safetensors"))
    assert mine.keys() == its.keys() and all(torch.equal(mine[k], its[k]) for k in its)


@pytest.mark.slow
def test_a_lora_reward_models_checkpoint_is_its_adapters_and_head(rm, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification
    config = _rm_run(os.path.dirname(load(rm).run_dir), "lora", finetuning_type="lora", lora_rank=4, lora_dropout=0)
    c = load(config)
    adapter, merged = str(tmp_path / "adapter"), str(tmp_path / "merged")
    assert main(["export", _step(c.run_dir, 1), adapter]) == 0
    assert main(["export", _step(c.run_dir, 1), merged, "--merge-adapter"]) == 0
    assert not os.path.exists(os.path.join(adapter, "config.json"))
    base = AutoModelForSequenceClassification.from_pretrained(c.model, num_labels=1, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter)
    whole = AutoModelForSequenceClassification.from_pretrained(merged, dtype=torch.float32)
    assert _scores(config, peft) == pytest.approx(_logged(config, 1), abs=1e-5)
    assert _scores(config, whole) == pytest.approx(_logged(config, 1), abs=1e-5)


def _vlm_run(folder, name: str, **extra) -> str:
    """A 2-step sft run of a tiny LLaVA on records with images, checkpointed at every step; its run folder."""
    folder = str(folder)
    model = os.path.join(folder, "model")
    if not os.path.isdir(model):
        vlm_files.model_dir(model)
        vlm_files.records(os.path.join(folder, "data.jsonl"), 8)
    settings = vlm_files.settings(name, 48, 2, save_every=1, eval_every=None, resume=None, export=None, **extra)
    settings.pop("eval")
    run(load(files.run_yaml(os.path.join(folder, f"{name}.yaml"), **settings), []))
    return os.path.join(folder, name)


@pytest.mark.slow       # a LLaVA run's planning: about 10 s on 2 cores
def test_a_vision_language_models_checkpoint_is_its_model_and_processor(tmp_path):
    from transformers import AutoProcessor, LlavaForConditionalGeneration
    run_dir = _vlm_run(tmp_path, "vlm")
    out, last = str(tmp_path / "step1"), str(tmp_path / "step2")
    assert main(["export", _step(run_dir, 1), out]) == 0
    assert {"processor_config.json", "tokenizer.json", "chat_template.jinja"} <= set(os.listdir(out))
    AutoProcessor.from_pretrained(out)
    exported = LlavaForConditionalGeneration.from_pretrained(out, dtype=torch.float32).state_dict()
    masters = finetune_runs.tables(_step(run_dir, 1), "master")
    assert masters and all(torch.equal(exported[n], t) for n, t in masters.items())
    assert not torch.equal(exported["lm_head.weight"], LlavaForConditionalGeneration.from_pretrained(
        run_dir, dtype=torch.float32).state_dict()["lm_head.weight"])      # not the run's last step
    assert main(["export", _step(run_dir, 2), last]) == 0       # the last step's: the run's own export
    _, differ, missing = filecmp.cmpfiles(run_dir, last, sorted(os.listdir(last)), shallow=False)
    assert differ == [] and missing == []


@pytest.mark.slow
def test_a_vision_language_lora_checkpoint_is_its_adapter_and_processor(tmp_path):
    run_dir = _vlm_run(tmp_path, "lora", finetuning_type="lora", lora_rank=4, lora_target="q_proj,v_proj")
    out = str(tmp_path / "step1")
    assert main(["export", _step(run_dir, 1), out]) == 0
    assert {"adapter_config.json", "processor_config.json", "tokenizer.json"} <= set(os.listdir(out))
    written = load_file(os.path.join(out, "adapter_model.safetensors"))
    trained = finetune_runs.tables(_step(run_dir, 1), "master")
    assert len(written) == len(trained) and all(torch.equal(written[n.replace(".default.", ".")], t)
                                                for n, t in trained.items())
    last = str(tmp_path / "step2")
    assert main(["export", _step(run_dir, 2), last]) == 0
    mine = load_file(os.path.join(last, "adapter_model.safetensors"))
    its = load_file(os.path.join(run_dir, "adapter_model.safetensors"))
    assert mine.keys() == its.keys() and all(torch.equal(mine[k], its[k]) for k in its)
