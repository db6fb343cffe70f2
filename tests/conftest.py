import os
import tempfile

# Triton decides interpreter-or-compiler when a function is decorated, including its own
# triton.language helpers at import: set it before anything (torch included) imports triton.
# Kernel tests run on the interpreter with host tensors; the sm_80/sm_90 compile check turns it
# off in its own child processes.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Compiled artifacts (Triton kernels, the host AdamW library) go to a private temp dir per run.
_TMP = tempfile.mkdtemp(prefix="megacompile-tests-")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_TMP, "triton"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_TMP, "torch_extensions"))
