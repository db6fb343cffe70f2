"""Running a test's body where torchvision imports: transformers builds video processors (Qwen's)
and SmolVLM's processor only with it.

With torchvision installed and importable, the body runs in the test's process. Over the CPU build
of torch, PyPI's torchvision (built against CUDA torch) does not import; .ci/setup then installs
the wheel that matches torch, without its dependencies, into .venv/torchvision-cpu, and the body
runs in a child process with that folder and tests/torchvision_cpu (whose sitecustomize lets its
Python half import) first on PYTHONPATH. Neither: the test is skipped, naming the fix.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from typing import Callable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHEEL_DIR = os.path.join(ROOT, ".venv", "torchvision-cpu")
SHIM = os.path.join(ROOT, "tests", "torchvision_cpu")


def importable() -> bool:
    if importlib.util.find_spec("torchvision") is None:
        return False
    try:
        importlib.import_module("torchvision")
        return True
    except Exception:  # noqa: BLE001 - a torchvision that does not import is not there
        return False


def call(body: Callable, *args, timeout: int = 900) -> None:
    """body(*args) where torchvision imports; args are JSON values (paths as strings)."""
    if importable():
        body(*args)
        return
    if not os.path.isdir(os.path.join(WHEEL_DIR, "torchvision")):
        pytest.skip("torchvision is not installed: bash .ci/setup installs it (or pip install torchvision)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SHIM, WHEEL_DIR, ROOT, os.environ.get("PYTHONPATH", "")]))
    code = (f"import json, importlib; m = importlib.import_module({body.__module__!r}); "
            f"m.{body.__name__}(*json.loads({json.dumps(json.dumps(list(args)))}))")
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=os.getcwd(), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"{body.__module__}.{body.__name__} failed where torchvision imports:\n"
                    f"{done.stdout[-4000:]}\n{done.stderr[-8000:]}", pytrace=False)
