"""One kernel benchmark of benchmarks/kernels/ with Liger-Kernel's op timed beside megacompile's,
torch eager and torch.compile: the same points (shapes, dtypes, inputs, bytes), the same timer,
the same long CSV. Kernels Liger has no op for (AdamW, the casts, softmax with a scale and mask)
run without it.

    python benchmarks/peers/liger.py rms_norm [--smoke] [--csv PATH]     # benchmarks/kernels/bench_rms_norm.py
"""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))

import _common  # noqa: E402


def liger_ops() -> dict:
    """Point.kernel -> Liger's op called as megacompile's kernel is, on the point's inputs."""
    try:
        from liger_kernel.transformers import functional as liger
    except ImportError:
        return {}
    return {
        # eps as the shared reference's; in_place=False: its backward would overwrite the upstream gradient
        "rms_norm": lambda x, w: liger.liger_rms_norm(x, w, 1e-6, 0.0, "llama", False),
        "layer_norm": lambda x, w, b: liger.liger_layer_norm(x, w, b, 1e-5),
        "swiglu": liger.liger_swiglu,
        "geglu_tanh": liger.liger_geglu,          # Liger's GeGLU is the tanh approximation
        "rope": lambda q, k, cos, sin: liger.liger_rope(q, k, cos, sin),
        "fused_linear_ce": lambda h, w, labels: liger.liger_fused_linear_cross_entropy(h, w, labels),
    }


def _runs(op, point) -> bool:
    """Whether Liger's op runs on this point (one that fails loses its own row, not the kernel's)."""
    try:
        op(*point.make_inputs())
        return True
    except Exception as e:  # noqa: BLE001 - said, and the other implementations are timed
        print(f"{point.kernel} {point.shape} {point.dtype}: liger failed ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:200] if str(e) else ''}); timed without it")
        return False


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        sys.exit(__doc__)
    name, rest = argv[0], argv[1:]
    bench = importlib.import_module(f"bench_{name}")
    ops = liger_ops()
    if not ops:
        print(f"{name}: liger-kernel is not installed (benchmarks/peers/wheels.sh fetches it); timed without it")

    def points(smoke: bool):
        out = bench.points(smoke)
        for point in out:
            if point.kernel in ops and _runs(ops[point.kernel], point):
                point.impls["liger"] = ops[point.kernel]
        return out
    return _common.main(name, points, rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
