import os
import tempfile

# Compiled artifacts (Triton kernels, the host AdamW library) go to a private temp dir per run.
_TMP = tempfile.mkdtemp(prefix="megacompile-tests-")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_TMP, "triton"))
os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(_TMP, "torch_extensions"))
