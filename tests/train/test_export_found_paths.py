"""What a run found beside its run.yaml or in the working directory (a reward model's folder and a
reward function's module, a tools file, a starting adapter) is no matter to `megacompile export`:
the run folder's training_args.yaml names the folders and files absolute, and export reads the run
back from it without importing the reward functions, reading the tools file or looking for the
adapter (the checkpoint holds the adapters it trained)."""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megacompile.cli import main
from megacompile.errors import ArgumentError
from megacompile.train import load, run, run_args
from tests.posttrain import stage_files
from tests.train import files, finetune_runs

REWARDS = "found_rewards"       # a module beside the run.yaml, a name no other test imports
MODULE = "def short(prompts, completions, **_):\n    return [-float(len(str(c))) for c in completions]\n"


def _training_args(run_dir: str) -> dict:
    with open(os.path.join(run_dir, run_args.NAME)) as f:
        return yaml.safe_load(f)


def test_a_grpo_runs_checkpoint_exports_with_its_reward_module_and_model_gone(tmp_path, monkeypatch):
    from transformers import AutoModelForSequenceClassification
    project = tmp_path / "project"
    work = stage_files.workspace(project)
    (project / f"{REWARDS}.py").write_text(MODULE)
    judge = AutoModelForSequenceClassification.from_pretrained(work["model"], num_labels=1)
    judge.save_pretrained(str(project / "judge"))
    shutil.copy(os.path.join(work["model"], "tokenizer.json"), project / "judge")
    shutil.copy(os.path.join(work["model"], "tokenizer_config.json"), project / "judge")
    settings = stage_files.grpo(work, "run", reward_funcs=[f"{REWARDS}:short", "judge"], reward_weights=None,
                                save_every=1)
    monkeypatch.chdir(tmp_path)     # not the run.yaml's folder: both are found beside it
    run(load(files.run_yaml(str(project / "grpo.yaml"), **settings), []))
    run_dir = str(project / "run")
    module = str(project / f"{REWARDS}.py")
    assert _training_args(run_dir)["reward_funcs"] == [f"{module}:short", str(project / "judge")]
    monkeypatch.delitem(sys.modules, REWARDS)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(project)])    # as a run started afresh
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    again = load(os.path.join(run_dir, run_args.NAME), [])      # its module read from its file
    assert again.reward_funcs == [f"{module}:short", str(project / "judge")] and sys.modules[REWARDS].__file__ == module
    shutil.rmtree(project / "judge")
    os.remove(module)
    monkeypatch.delitem(sys.modules, REWARDS)
    with pytest.raises(ArgumentError, match=f"reward function '{module}:short' cannot be loaded"):
        load(os.path.join(run_dir, run_args.NAME), [])      # a run still imports them
    step = os.path.join(run_dir, "checkpoints", "step-000001")
    out = str(tmp_path / "out")
    assert main(["export", step, out]) == 0
    assert REWARDS not in sys.modules       # not imported by the export
    exported = load_file(os.path.join(out, "model.safetensors"))
    trained = finetune_runs.tables(step, "master")
    assert trained and all(torch.equal(exported[n.removeprefix("policy.")], t) for n, t in trained.items())


def test_a_tools_file_and_a_starting_adapter_are_named_absolute_and_not_needed_for_the_model(tmp_path, monkeypatch):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    project = tmp_path / "project"
    project.mkdir()
    model = files.model_dir(str(project / "llama"), dim=32)
    files.chats(str(project / "chats.jsonl"))
    (project / "tools.json").write_text('[{"name": "search", "description": "look it up", "parameters": {}}]')
    monkeypatch.chdir(tmp_path)     # the adapter is read from the working directory, as LlamaFactory reads it
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(model), LoraConfig(r=4, lora_alpha=8,
                                                                                  target_modules=["q_proj", "v_proj"]))
    lora.save_pretrained("start")
    config = files.run_yaml(str(project / "run.yaml"), model="llama", data=["chats.jsonl"], seq=32, batch=2, steps=1,
                            device="cpu", run_dir="run", tools="tools.json", finetuning_type="lora", lora_rank=4,
                            lora_target="q_proj,v_proj", adapter_name_or_path="start")
    c = load(config, [])
    run_dir = str(project / "run")
    os.makedirs(run_dir)
    run_args.write(c, run_dir)
    given = _training_args(run_dir)
    assert given["tools"] == str(project / "tools.json")
    assert given["adapter_name_or_path"] == str(tmp_path / "start")
    os.remove(project / "tools.json")
    shutil.rmtree(tmp_path / "start")
    with pytest.raises(ArgumentError, match="adapter: .*start holds no PEFT adapter"):
        load(os.path.join(run_dir, run_args.NAME), [])      # a run still starts from it
    read = load(os.path.join(run_dir, run_args.NAME), [], model_only=True)
    assert read.adapter == str(tmp_path / "start") and read.tools == str(project / "tools.json")


def test_relative_paths_given_on_the_command_line_are_written_as_the_run_read_them(tmp_path, monkeypatch):
    project, work = tmp_path / "project", tmp_path / "work"
    project.mkdir()
    work.mkdir()
    files.model_dir(str(tmp_path / "models" / "llama"), dim=32)
    files.chats(str(project / "chats.jsonl"))
    files.chats(str(work / "extra.jsonl"))
    (project / "tools.json").write_text('[{"name": "search", "description": "look it up", "parameters": {}}]')
    config = files.run_yaml(str(project / "run.yaml"), model="bundled", data=["chats.jsonl"], seq=32, batch=2,
                            steps=1, device="cpu", run_dir="run")
    monkeypatch.chdir(work)     # the overrides' paths are read from here, a tools file beside the run.yaml
    c = load(config, ["model_name_or_path=../models/llama", "data=extra.jsonl", "tools=tools.json"])
    run_dir = str(project / "run")
    os.makedirs(run_dir)
    run_args.write(c, run_dir)
    given = _training_args(run_dir)
    assert all(os.path.isabs(given[k]) for k in ("model_name_or_path", "data", "tools"))
    monkeypatch.chdir(tmp_path)     # a run started from it elsewhere reads the same files
    again = load(os.path.join(run_dir, run_args.NAME), [])
    assert os.path.samefile(again.model, tmp_path / "models" / "llama")
    assert [os.path.samefile(e["path"], work / "extra.jsonl") for e in again.data] == [True]
    assert again.tools == c.tools and given["tools"] == str(project / "tools.json")
