"""Kernel tests run under the Triton interpreter, on host tensors.

TRITON_INTERPRET is read when a kernel is decorated, so it is set here at import time, before the
test modules import the kernels (the kernels package would set it too, but only without a GPU).
On a machine with a GPU these tests still run on the interpreter; `python -m megacompile.kernels
--check` is the run that exercises the device there. Compiled artifacts (the sm_80/sm_90 compile)
go to a per-session temporary TRITON_CACHE_DIR.
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    # the interpreter evaluates exp/sigmoid with numpy, which warns where fp32 overflows to inf;
    # the kernels rely on that inf (sigmoid(-100) = 1 / (1 + inf) = 0), as the GPU does silently
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")


@pytest.fixture(scope="session", autouse=True)
def triton_cache_dir(tmp_path_factory):
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    yield os.environ["TRITON_CACHE_DIR"]
    if previous is None:
        os.environ.pop("TRITON_CACHE_DIR", None)
    else:
        os.environ["TRITON_CACHE_DIR"] = previous
