"""reward_funcs name modules as TRL's scripts find them: on the Python path, in the working
directory, or (megacompile's addition) beside the run.yaml, as module:function or TRL's
module.function, or by the module's file as FILE.py:function (relative to the run.yaml's folder);
one found nowhere is refused saying where it was looked for, and a function that cannot take TRL's
keywords (or the data's columns) is refused before the run folder is written."""
from __future__ import annotations

import os
import sys

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from tests.posttrain import stage_files
from tests.train import files


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return stage_files.workspace(tmp_path_factory.mktemp("reward_modules"))


@pytest.fixture(autouse=True)
def own_path(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))       # what a lookup adds goes with the test


def _module(folder, name: str, body: str) -> str:
    os.makedirs(folder, exist_ok=True)
    (folder / f"{name}.py").write_text(body)
    return name


def _config(work, tmp_path, funcs: list[str]) -> str:
    settings = {**stage_files.grpo(work, str(tmp_path / "run")), "reward_funcs": funcs, "reward_weights": None}
    os.makedirs(tmp_path / "conf", exist_ok=True)
    return files.run_yaml(str(tmp_path / "conf" / "run.yaml"), **settings)


GOOD = "def correct(prompts, completions, answer=None, **kwargs):\n    return [1.0] * len(completions)\n"


@pytest.mark.parametrize("place, spelled", [("conf", ":"), ("cwd", ":"), ("conf", ".")])
def test_a_reward_module_beside_the_run_yaml_or_in_the_working_directory_loads(work, tmp_path, monkeypatch,
                                                                              place, spelled):
    name = _module(tmp_path / place, f"rewards_{place}_{spelled == '.'}_{tmp_path.name}", GOOD)
    os.makedirs(tmp_path / "cwd", exist_ok=True)
    monkeypatch.chdir(tmp_path / "cwd")
    c = load(_config(work, tmp_path, [f"{name}{spelled}correct"]))
    assert c.reward_funcs == [f"{name}{spelled}correct"]
    # training_args.yaml (run_args.py) names its file, for a run started from it elsewhere
    assert c.given["reward_funcs"] == [f"{tmp_path / place / name}.py:correct"]


def test_a_reward_function_named_by_its_file_is_read_from_the_run_yamls_folder(work, tmp_path, monkeypatch):
    name = _module(tmp_path / "conf" / "mine", f"file_rewards_{tmp_path.name}", GOOD)
    os.makedirs(tmp_path / "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    c = load(_config(work, tmp_path, [f"mine/{name}.py:correct"]))
    path = str(tmp_path / "conf" / "mine" / f"{name}.py")
    assert c.reward_funcs == c.given["reward_funcs"] == [f"{path}:correct"]
    assert sys.modules[name].__file__ == path and str(tmp_path / "conf" / "mine") not in sys.path
    with pytest.raises(ArgumentError, match=f"reward function .*: {tmp_path / 'conf' / name}.py is not a file"):
        load(_config(work, tmp_path, [f"{name}.py:correct"]))
    with pytest.raises(ArgumentError, match=f"{name}.py has no wrong"):
        load(_config(work, tmp_path, [f"mine/{name}.py:wrong"]))


def test_a_reward_module_found_nowhere_is_refused_saying_where_it_looked(work, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentError) as e:
        load(_config(work, tmp_path, ["no_such_rewards:correct"]))
    assert (f"no module named no_such_rewards on the Python path, in the working directory ({tmp_path}) or beside "
            f"the run config ({tmp_path / 'conf'}); put no_such_rewards.py in one of those folders, or add its folder "
            "to PYTHONPATH") in str(e.value)


@pytest.mark.parametrize("body, message", [
    ("def f(p, c):\n    return [0.0] * len(c)\n", "got an unexpected keyword argument 'prompts'"),
    # TRL 1.16 hands its logging callables to every function
    ("def f(prompts, completions, completion_ids, trainer_state):\n    return [0.0] * len(completions)\n",
     r"log_extra, log_metric and the data's columns.*got an unexpected keyword argument 'log_extra'"),
    # TRL hands every column of the data: `answer` here, which f neither names nor takes as **kwargs
    ("def f(prompts, completions, completion_ids, trainer_state, log_extra, log_metric):\n"
     "    return [0.0] * len(completions)\n",
     r"the data's columns \(answer\).*got an unexpected keyword argument 'answer'"),
])
def test_a_reward_function_of_the_wrong_signature_is_refused_before_the_run_folder_is_written(
        work, tmp_path, body, message):
    name = _module(tmp_path / "conf", f"bad_rewards_{tmp_path.name}", body)
    with pytest.raises(ArgumentError, match=f"reward function f is called as TRL calls reward functions.*{message}"):
        run(load(_config(work, tmp_path, [f"{name}:f"])))
    assert not os.path.exists(tmp_path / "run")
