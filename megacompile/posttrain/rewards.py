"""Rewards as Python callables, called as TRL's GRPOTrainer calls them: with keywords only,

    f(prompts=..., completions=..., completion_ids=..., trainer_state=..., **columns,
      log_extra=..., log_metric=...) -> one reward each

prompts: each completion's prompt as the record gave it (text, or a list of messages);
completions: the decoded text, or, for a prompt given as messages, a list of one message
[{"role": "assistant", "content": text}]; completion_ids: the completion's token ids (a list);
trainer_state: a TrainerState (global_step, epoch, max_steps); columns: every other column of the
records, one value per completion; log_extra and log_metric: TRL 1.16's callables for a column of
the completions log and a scalar of the step's (reward_logs.py). A reward of None or NaN means
"not scored by this function": it is left out of the weighted sum (a nansum over the functions),
and a completion no function scored has the reward NaN (advantages.py gives it no advantage).
`async def` functions are awaited together. Built in: an exact-match answer and a format check.

A function is named `module:function` or, as TRL's scripts name it, `module.function`. A module
not on the Python path is looked up in the working directory (TRL's scripts put it on sys.path)
and then beside the run.yaml; the folder it is found in is added to the end of sys.path. Or it is
named by its module's file, `FILE.py:function` (in a run.yaml relative to its folder, as its other
paths), the file imported as a module named after it. A folder
of a reward model (a sequence classifier with one label, as stage rm writes) is a reward function
too, as TRL takes one (reward_models.py)."""
from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..errors import ArgumentError
from .reward_logs import RewardLogs
from .reward_models import RewardModelFunction, is_reward_model

RewardFn = Callable[..., Sequence[float | None]]


@dataclass(frozen=True)
class TrainerState:
    """What a reward function reads of the run as TRL's `trainer_state` (transformers'
    TrainerState): global_step, the optimizer steps done before the rollout; epoch, the passes over
    the prompts done (a fraction); max_steps, the run's steps."""
    global_step: int = 0
    epoch: float = 0.0
    max_steps: int = 0


def load(name: str, near: str | None = None, device: str = "cpu") -> RewardFn:
    """`module:function` or TRL's `module.function` (as named in a run.yaml), a built-in's name, or
    a reward model's folder (reward_models.py: read at its first call, onto `device`); `near`: the
    run.yaml's folder, where a module or folder not found on the path or in the working directory
    is looked for."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    folder = model_folder(name, near)
    if folder is not None:
        return RewardModelFunction(folder, device)
    return named(name, near, "reward function", f", one of {', '.join(BUILT_IN)}, or a reward model's folder")


def model_folder(name: str, near: str | None = None) -> str | None:
    """The absolute folder `name` is, as given, from the working directory or beside the run.yaml,
    if it holds a model (config.json); else None."""
    for base in ("", os.getcwd(), near):
        if base is not None:
            path = os.path.abspath(os.path.join(base, os.path.expanduser(name)))
            if is_reward_model(path):
                return path
    return None


def named(name: str, near: str | None, what: str, others: str = ""):
    """The object a run.yaml names as `module:function` or `module.function` (a reward function, a
    tool): from the Python path, else the working directory, else `near` (the run.yaml's folder).
    `what` names it in the errors; `others`: what else the name may be. FILE.py:function: the file's."""
    file, sep, attr = name.rpartition(":")
    if sep and file.endswith(".py"):
        found = _file_module(name, file, what)
        if not hasattr(found, attr):
            raise ArgumentError(f"{what} {name!r} cannot be loaded: {found.__file__} has no {attr}")
        return getattr(found, attr)
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    if not module or not attr:
        raise ArgumentError(f"a {what} is named module:function (or TRL's module.function){others}; got {name!r}")
    found = _module(name, module, near, what)
    if not hasattr(found, attr):
        raise ArgumentError(f"{what} {name!r} cannot be loaded: {module} "
                            f"({getattr(found, '__file__', None) or 'a module'}) has no {attr}")
    return getattr(found, attr)


def _file_module(name: str, file: str, what: str):
    """The module of FILE.py (from the working directory where relative), named after the file, as
    importing it from its folder names it; the module of that name where it is that file already."""
    path = os.path.abspath(os.path.expanduser(file))
    if not os.path.isfile(path):
        raise ArgumentError(f"{what} {name!r} cannot be loaded: {path} is not a file")
    module = os.path.basename(path)[:-3]
    known = sys.modules.get(module)
    if known is not None and os.path.abspath(getattr(known, "__file__", None) or "") == path:
        return known
    spec = importlib.util.spec_from_file_location(module, path)
    found = importlib.util.module_from_spec(spec)
    if known is None:       # where another module holds the name, this one is loaded without it
        sys.modules[module] = found
    try:
        spec.loader.exec_module(found)
    except Exception as e:
        if sys.modules.get(module) is found:
            del sys.modules[module]
        raise ArgumentError(f"{what} {name!r} cannot be loaded: {type(e).__name__}: {e}") from e
    return found


def written(name: str, near: str | None) -> str:
    """`name` as a run's training_args.yaml writes it, for a run started elsewhere: a FILE.py:function
    with its file absolute, and a `module:function` (or module.function) whose module the run
    imported from a file MODULE.py in the working directory or `near` (the run.yaml's folder) as
    that file's FILE.py:function; anything else (a module on the Python path, a package's, a
    built-in, a folder) as it is."""
    file, sep, attr = name.rpartition(":")
    if sep and file.endswith(".py"):
        return f"{os.path.abspath(os.path.expanduser(file))}:{attr}"
    if name in BUILT_IN or os.path.isdir(name):
        return name
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    path = getattr(sys.modules.get(module), "__file__", None) if module and "." not in module else None
    if path is None or os.path.basename(path) != module + ".py":
        return name
    path = os.path.abspath(path)
    places = {os.getcwd(), *([os.path.abspath(near)] if near else [])}
    return f"{path}:{attr}" if os.path.dirname(path) in places else name


def _module(name: str, module: str, near: str | None, what: str):
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != top:       # the module is there, and something it imports is not
            raise ArgumentError(f"{what} {name!r} cannot be loaded: {e}") from e
    except ImportError as e:
        raise ArgumentError(f"{what} {name!r} cannot be loaded: {e}") from e
    places = list(dict.fromkeys(p for p in (os.getcwd(), near) if p))
    for folder in places:
        if os.path.isfile(os.path.join(folder, top + ".py")) or os.path.isdir(os.path.join(folder, top)):
            if folder not in sys.path:
                sys.path.append(folder)
                importlib.invalidate_caches()
            try:
                return importlib.import_module(module)
            except ImportError as e:
                raise ArgumentError(f"{what} {name!r} cannot be loaded from {folder}: {e}") from e
    where = " or ".join(f"{place} ({p})" for place, p in zip(("the working directory", "beside the run config"),
                                                             places) if p)
    raise ArgumentError(f"{what} {name!r} cannot be loaded: no module named {top} on the Python path, in "
                        f"{where}; put {top}.py in one of those folders, or add its folder to PYTHONPATH "
                        f"(PYTHONPATH=/path/to/folder megacompile train ...)")


def name_of(f: RewardFn) -> str:
    return getattr(f, "__name__", str(f))


def score(funcs: Sequence[RewardFn], weights: Sequence[float] | None, prompts, completions, *,
          completion_ids=None, trainer_state: TrainerState | None = None, reward_logs: RewardLogs | None = None,
          **columns) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted nansum of every function's rewards, (N,) (NaN where no function scored), and
    each function's own (NaN where it did not score), by its name; what the functions log goes to
    `reward_logs` (dropped where it is None)."""
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    if len(weights) != len(funcs):
        raise ArgumentError(f"reward_weights has {len(weights)} weights for {len(funcs)} reward functions")
    kwargs = {"prompts": list(prompts), "completions": list(completions),
              "completion_ids": [list(x) for x in completion_ids] if completion_ids is not None else None,
              "trainer_state": trainer_state if trainer_state is not None else TrainerState(), **columns}
    logs = reward_logs if reward_logs is not None else RewardLogs()
    kwargs.update(log_extra=logs.log_extra, log_metric=logs.log_metric)     # after the columns, as TRL adds them
    for f in funcs:
        _check_signature(f, kwargs)
    outputs = {i: f(**kwargs) for i, f in enumerate(funcs) if not inspect.iscoroutinefunction(f)}
    waiting = [(i, f) for i, f in enumerate(funcs) if inspect.iscoroutinefunction(f)]
    if waiting:
        async def together():
            return await asyncio.gather(*(f(**kwargs) for _, f in waiting))
        outputs.update(zip([i for i, _ in waiting], asyncio.run(together())))
    each, per_function = {}, []
    for i, f in enumerate(funcs):
        values = list(outputs[i])
        if len(values) != len(completions):
            raise ArgumentError(f"reward function {name_of(f)} returned {len(values)} rewards for "
                                f"{len(completions)} completions")
        r = torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
        each[name_of(f)] = r
        per_function.append(r * weights[i])
    stacked = torch.stack(per_function, dim=1)                          # (N, functions)
    total = torch.nansum(stacked, dim=1)
    total[torch.isnan(stacked).all(dim=1)] = math.nan
    return total, each


KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")
LOGGING = ("log_extra", "log_metric")       # TRL 1.16's, handed after the data's columns


def check_callable(funcs: Sequence[RewardFn], columns: Sequence[str] | None = None) -> None:
    """Each function takes TRL's keywords and, when `columns` (the data's, but the prompt) are
    given, those too: checked before the run folder is written, not at the first rollout. Without
    columns, only TRL's keywords are checked (a parameter may be a column)."""
    kwargs = {k: None for k in KEYWORDS} | {k: None for k in columns or ()} | {k: None for k in LOGGING}
    for f in funcs:
        _check_signature(f, kwargs, partial=columns is None)


def _check_signature(f: RewardFn, kwargs: dict, partial: bool = False) -> None:
    """A function that cannot take TRL's keywords is refused naming them, not with Python's TypeError
    from inside the run."""
    try:
        signature = inspect.signature(f)
        signature.bind_partial(**kwargs) if partial else signature.bind(**kwargs)
    except TypeError as e:
        columns = [k for k in kwargs if k not in KEYWORDS + LOGGING]
        raise ArgumentError(f"reward function {name_of(f)} is called as TRL calls reward functions, with keywords "
                            f"{', '.join(KEYWORDS + LOGGING)} and the data's columns"
                            + (f" ({', '.join(columns)})" if columns else "")
                            + f"; name its parameters prompts and completions and end them with **kwargs: {e}") from e
    except ValueError:
        pass                # a builtin without a signature: called as it is


def text_of(completion) -> str:
    """A completion's text, given as text or as TRL's list of one assistant message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_answer(prompts, completions, answer=None, **_) -> list[float]:
    """1.0 where the completion's text, stripped, is the record's `answer` column, else 0.0."""
    if answer is None:
        raise ArgumentError("the exact_answer reward needs an `answer` column in the data")
    return [float(text_of(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_check(prompts, completions, pattern: str = r"^<answer>.*</answer>$", **_) -> list[float]:
    """1.0 where the completion matches `pattern` (by default: the whole of it in <answer> tags)."""
    rx = re.compile(pattern, re.DOTALL)
    return [float(bool(rx.match(text_of(c).strip()))) for c in completions]


BUILT_IN: dict[str, RewardFn] = {"exact_answer": exact_answer, "format_check": format_check}
