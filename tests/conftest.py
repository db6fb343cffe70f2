import os
import tempfile

# Triton decides interpreter-or-compiler when a function is decorated, including its own
# triton.language helpers at import: set it before anything (torch included) imports triton.
# Kernel tests run on the interpreter with host tensors; the sm_80/sm_90 compile check turns it
# off in its own child processes.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist the workers share the cores: each one's torch gets its share, not all of them
# (two workers of two threads each on 2 cores wait on each other's OpenMP threads: the same tests
# took 5-8% longer). The processes a test starts inherit it. An OMP_NUM_THREADS given is kept.
_SHARE = None
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and "OMP_NUM_THREADS" not in os.environ:
    _SHARE = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)

# Compiled artifacts (Triton kernels, the host AdamW library) go to a private temp dir per run.
_TMP = tempfile.mkdtemp(prefix="megacompile-tests-")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_TMP, "triton"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_TMP, "torch_extensions"))

# torch's structured trace (the `torch.__trace` logger, read by tlparse) is always at DEBUG and
# never propagates; torch writes a record to it whenever it has a handler, and its own handler
# only sees that TORCH_TRACE is unset at the first record, and goes. pytest (9.1 on) attaches its
# capture handlers to every logger that does not propagate, so the trace ran in every test: the
# fake tensors of each capture, serialized, showed as empty `DEBUG torch.__trace` lines under a
# failure. Without TORCH_TRACE the logger gets no handler and propagates, so pytest leaves it be.
import logging  # noqa: E402

import torch  # noqa: E402 - torch sets the logger up at import

if _SHARE is not None:
    torch.set_num_threads(_SHARE)

if not os.environ.get("TORCH_TRACE"):
    _trace = logging.getLogger("torch.__trace")
    for _handler in list(_trace.handlers):
        _trace.removeHandler(_handler)
    _trace.propagate = True
