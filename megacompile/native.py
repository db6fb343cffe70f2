"""The project's C++ sources, compiled with the system compiler at first use and loaded with ctypes.

Two of them: the host AdamW (optim/csrc/fused_adamw.cpp) and the arena's offset placement
(ir/csrc/arena_place.cpp). Each is built once per source, compiler, flags and CPU into a cache
folder (MEGACOMPILE_CACHE_DIR, default ~/.cache/megacompile) and reused by every later process.
A caller that cannot build keeps a slower path of its own; this module only builds.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("MEGACOMPILE_CACHE_DIR", Path.home() / ".cache" / "megacompile"))


def compiler() -> str | None:
    """$CXX, else the first of g++, c++, clang++ on the PATH; None without one."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def cpu_signature() -> str:
    """-march=native code is only valid on the CPU it was built for; the cache key says which."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def build(source: Path, compiler: str, flags: list[str]) -> Path:
    """The shared library of `source` built with `compiler` and `flags` (cached); raises
    RuntimeError with the compiler's message when the build fails."""
    key = hashlib.sha256(b"\0".join(
        [source.read_bytes(), compiler.encode(), " ".join(flags).encode(), cpu_signature().encode()]
    )).hexdigest()[:20]
    target = cache_dir() / f"{source.stem}_{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Compile under a private name and rename: another process may load `target` at any moment,
    # and must never see a half-written file.
    fd, partial = tempfile.mkstemp(prefix=f"{target.stem}.", suffix=".so.partial", dir=target.parent)
    os.close(fd)
    try:
        result = subprocess.run([compiler, *flags, "-o", partial, str(source)],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"{compiler} failed:\n{result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
