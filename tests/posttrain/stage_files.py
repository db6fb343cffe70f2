"""Prompt and preference files for run.yaml's post-training stages, and a reward defined here that
records what it was handed (the run's own rewards, recomputed from the calls)."""
from __future__ import annotations

import json
import os

from tests.train import files

CALLS: list[dict] = []


def starts_like_prompt(prompts, completions, answer=None, **_):
    """1.0 where the completion's first word is the record's `answer`; 0.5 where it has any word of
    the prompt; else 0."""
    rewards = [1.0 if c.split()[:1] == [a] else 0.5 if set(c.split()) & set(p.split()) else 0.0
               for p, c, a in zip(prompts, completions, answer)]
    CALLS.append({"prompts": list(prompts), "completions": list(completions), "answer": list(answer),
                  "rewards": rewards})
    return rewards


def prompts(path: str) -> str:
    with open(path, "w") as f:
        for s in files.SENTENCES:
            f.write(json.dumps({"prompt": s, "answer": s.split()[-1]}) + "\n")
    return path


def pairs(path: str) -> str:
    with open(path, "w") as f:
        for i, s in enumerate(files.SENTENCES):
            if i % 2:
                record = {"prompt": [{"role": "user", "content": s}],
                          "chosen": [{"role": "assistant", "content": s}],
                          "rejected": [{"role": "assistant", "content": files.SENTENCES[(i + 3) % 10]}]}
            else:
                record = {"prompt": s, "chosen": s, "rejected": files.SENTENCES[(i + 3) % 10]}
            f.write(json.dumps(record) + "\n")
    return path


def workspace(tmp) -> dict:
    tmp = str(tmp)
    return {"model": files.model_dir(os.path.join(tmp, "model"), dim=32),
            "prompts": prompts(os.path.join(tmp, "prompts.jsonl")), "pairs": pairs(os.path.join(tmp, "pairs.jsonl"))}


def grpo(work: dict, name: str, **more) -> dict:
    return {"model": work["model"], "stage": "grpo", "data": work["prompts"], "batch": 8, "num_generations": 4,
            "max_prompt_length": 8, "max_completion_length": 3, "temperature": 1.0,
            "reward_funcs": ["tests.posttrain.stage_files:starts_like_prompt", "format_check"],
            "reward_weights": [1.0, 0.5], "steps": 2, "lr": 1e-2, "warmup": 0, "schedule": "constant",
            "device": "cpu", "hbm_budget": 1, "run_dir": name, "log_every": 1, **more}


def dpo(work: dict, name: str, **more) -> dict:
    return {"model": work["model"], "stage": "dpo", "data": work["pairs"], "batch": 2, "seq": 16, "steps": 3,
            "lr": 1e-2, "schedule": "constant", "device": "cpu", "hbm_budget": 1, "run_dir": name, "log_every": 1,
            "eval_fraction": 0.2, "eval_every": 2, **more}


def run_counting_widths(monkeypatch, settings: dict, yaml_path: str, run_dir: str,
                        labelled_only: bool = False) -> tuple[list[dict], dict[str, list[int]]]:
    """`megacompile train` of `settings`, counting the row width of every engine.step and every
    forward-only call (`labelled_only`: those given labels, not a sampling forward): the run's
    log.csv rows and {"step": [...], "forward": [...]}."""
    from megacompile.engine import Engine
    from megacompile.train import load, log, run
    widths: dict[str, list[int]] = {"step": [], "forward": []}
    forward, step = Engine.__call__, Engine.step

    def counted_forward(self, *args, **kwargs):
        if not labelled_only or "labels" in kwargs:
            widths["forward"].append(kwargs["input_ids"].shape[1])
        return forward(self, *args, **kwargs)

    def counted_step(self, **inputs):
        widths["step"].append(inputs["input_ids"].shape[1])
        return step(self, **inputs)
    monkeypatch.setattr(Engine, "__call__", counted_forward)
    monkeypatch.setattr(Engine, "step", counted_step)
    run(load(files.run_yaml(yaml_path, **settings), []))
    monkeypatch.undo()
    return log.read(os.path.join(run_dir, "log.csv")), widths
