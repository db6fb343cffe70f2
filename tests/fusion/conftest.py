"""Fusion tests run the fused graphs on host tensors, so every Triton kernel runs under the
interpreter (tests/conftest.py sets TRITON_INTERPRET before anything imports triton). Generated
elementwise kernels and Triton's own artifacts go to a temporary TRITON_CACHE_DIR of this session.
"""
import os
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="megacompile-fusion-triton-")


def pytest_configure(config):
    # the interpreter evaluates exp/sigmoid with numpy, which warns where fp32 overflows to inf
    config.addinivalue_line("filterwarnings", "ignore::RuntimeWarning:triton.runtime.interpreter")
