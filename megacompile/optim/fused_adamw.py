"""Host-side fused AdamW over flat FP32 master buffers.

One call updates one block: it reads the gradient as it arrived from the device (float32 or
bfloat16), the float32 master, exp_avg and exp_avg_sq, and writes master, exp_avg, exp_avg_sq and,
when `out` is given, the new master in the compute dtype for the next upload. With a bf16 grad and
a bf16 `out` that is 28 bytes of memory traffic per parameter, in one pass.

The arithmetic is torch.optim.AdamW's (decoupled weight decay, amsgrad off), applied to
grad * grad_scale, in torch's operation order so the two round alike.

The native kernel (csrc/fused_adamw.cpp) is compiled with the system C++ compiler at first use
(megacompile/native.py: cached per CPU) and loaded with ctypes; a call runs without the GIL on
set_num_threads() threads. Without a compiler, or with
MEGACOMPILE_HOST_ADAM=torch, the same update runs as torch ops.
"""

from __future__ import annotations

import ctypes
import math
import numbers
import operator
import os
import threading
import warnings
from pathlib import Path

import torch

from megacompile import native
from megacompile.errors import OptimizerInputError

_SOURCE = Path(__file__).parent / "csrc" / "fused_adamw.cpp"
# -ffp-contract=off: no fused multiply-add but those the source writes, where torch's kernels round
# once (lerp, addcmul). -fno-math-errno lets sqrt vectorize and changes no value. -fopenmp-simd:
# the `omp simd` pragmas only, no OpenMP runtime (the kernel has its own helper threads).
_CXXFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-pthread", "-ffp-contract=off",
             "-fno-math-errno", "-shared", "-fPIC", "-std=c++17"]
_GRAD_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_OUT_KINDS = {torch.bfloat16: 1, torch.float32: 2}
# The torch fallback works in slices of this many elements so its temporaries stay small.
_FALLBACK_SLICE = 1 << 20

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_library_tried = False
_num_threads: int | None = None
_last_threads: int | None = None


# ---------------------------------------------------------------------------------------------
# Building and loading the native kernel


def _build(compiler: str, flags: list[str] = _CXXFLAGS) -> Path:
    return native.build(_SOURCE, compiler, flags)


def _load(path: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(path))
    p, i32, i64, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    library.megacompile_adamw_update.argtypes = [p, p, i32, p, p, p, i32, i64] + [f64] * 8 + [i32]
    library.megacompile_adamw_update.restype = None
    library.megacompile_grad_sq_norm.argtypes = [p, i32, i64, i32]
    library.megacompile_grad_sq_norm.restype = f64
    return library


def _native() -> ctypes.CDLL | None:
    """The loaded kernel, or None for the torch fallback (warned about once per process)."""
    global _library, _library_tried
    if os.environ.get("MEGACOMPILE_HOST_ADAM", "").lower() == "torch":
        return None
    if _library_tried:
        return _library
    with _lock:
        if _library_tried:
            return _library
        try:
            compiler = native.compiler()
            if compiler is None:
                raise RuntimeError("no C++ compiler found (looked for $CXX, g++, c++, clang++)")
            _library = _load(_build(compiler))
        except Exception as error:  # noqa: BLE001 -- any failure means: use the fallback
            warnings.warn(f"megacompile: the native host AdamW kernel is unavailable, using the "
                          f"slower torch fallback: {error}", RuntimeWarning, stacklevel=3)
        _library_tried = True
    return _library


def backend() -> str:
    """"cpp" when the native kernel is in use, "torch" for the fallback."""
    return "cpp" if _native() is not None else "torch"


def set_num_threads(n: int | None) -> None:
    """Threads for the native kernel; None follows torch.get_num_threads()."""
    global _num_threads
    if n is not None and (not isinstance(n, int) or n < 1):
        raise OptimizerInputError(f"num_threads must be a positive int or None, got {n!r}")
    _num_threads = n


def get_num_threads() -> int:
    return _num_threads if _num_threads is not None else torch.get_num_threads()


def last_threads() -> int | None:
    """Threads the last update in this process ran on (None before the first)."""
    return _last_threads


def _threads_for(numel: int) -> int:
    # The kernel hands out chunks of 64K elements; more threads than chunks would only wait.
    return max(1, min(get_num_threads(), numel // (1 << 16)))


# ---------------------------------------------------------------------------------------------
# Input checks: all of them run before any buffer is touched.


def _check_flat(name: str, t, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise OptimizerInputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise OptimizerInputError(f"{name} has dtype {t.dtype}; expected {allowed}")
    if t.device.type != "cpu":
        raise OptimizerInputError(f"{name} is on {t.device}; the host optimizer needs CPU tensors")
    if t.dim() != 1 or not t.is_contiguous():
        raise OptimizerInputError(f"{name} must be a contiguous 1-D tensor, got shape "
                                  f"{tuple(t.shape)} with strides {t.stride()}")


def _check_disjoint(named: dict[str, torch.Tensor]) -> None:
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name)
                   for name, t in named.items() if t.numel() > 0)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise OptimizerInputError(f"{first} and {second} share memory; each buffer must be "
                                      f"its own")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.data_ptr() == b.data_ptr() and a.numel() == b.numel()


def _check_scalar(name: str, value, *, below: float = math.inf) -> None:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or not 0 <= value < below):
        rule = "a finite number >= 0" if below == math.inf else f"in [0, {below})"
        raise OptimizerInputError(f"{name} must be {rule}, got {value!r}")


def _check_update(master, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps, weight_decay,
                  step, grad_scale) -> int:
    _check_flat("master", master, (torch.float32,))
    _check_flat("grad", grad, tuple(_GRAD_KINDS))
    _check_flat("exp_avg", exp_avg, (torch.float32,))
    _check_flat("exp_avg_sq", exp_avg_sq, (torch.float32,))
    named = {"master": master, "grad": grad, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if out is not None:
        _check_flat("out", out, tuple(_OUT_KINDS))
        # out may be grad itself (the gradient landed in the compute copy): each element's
        # gradient is read before its new weight is written. Any other overlap is refused.
        if not _same_memory(out, grad):
            named["out"] = out
    numel = master.numel()
    for name, t in named.items():
        if t.numel() != numel:
            raise OptimizerInputError(f"{name} has {t.numel()} elements, master has {numel}")
    _check_disjoint(named)

    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay),
                        ("grad_scale", grad_scale)):
        _check_scalar(name, value)
    _check_scalar("beta1", beta1, below=1)
    _check_scalar("beta2", beta2, below=1)
    try:
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise OptimizerInputError(f"step must be an int, got {step!r}") from None
    if step < 1:
        raise OptimizerInputError(f"step is 1-based (the count after this update), got {step!r}")
    return step


# ---------------------------------------------------------------------------------------------
# The update


def adamw_update_(master, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step,
                  grad_scale=1.0, out=None, backend=None) -> None:
    """One AdamW step in place on a block's flat buffers, as torch.optim.AdamW on grad*grad_scale.

    step is the 1-based count after this update. out, if given, receives the new master cast to
    out.dtype (round to nearest even for bfloat16). backend: None for the native kernel when it
    is available, "torch" for torch's own ops (they round exactly as torch.optim.AdamW does),
    "cpp" to insist on the native kernel.
    """
    step = _check_update(master, grad, exp_avg, exp_avg_sq, out, lr, beta1, beta2, eps,
                         weight_decay, step, grad_scale)
    if backend not in (None, "cpp", "torch"):
        raise OptimizerInputError(f"backend must be None, 'cpp' or 'torch', got {backend!r}")
    library = None if backend == "torch" else _native()
    if backend == "cpp" and library is None:
        raise OptimizerInputError("backend='cpp' was asked for, but the native kernel is "
                                  "unavailable (see the warning, or MEGACOMPILE_HOST_ADAM)")
    numel = master.numel()
    if numel == 0:
        return
    # The scalars as torch.optim.adam._single_tensor_adam computes them, in double.
    decay = 1 - lr * weight_decay
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2 ** 0.5

    global _last_threads
    if library is None:
        _last_threads = torch.get_num_threads()
        _update_torch(master, grad, exp_avg, exp_avg_sq, out, decay=decay, weight=1 - beta1,
                      beta2=beta2, bias_correction2_sqrt=bias_correction2_sqrt, eps=eps,
                      step_size=step_size, grad_scale=grad_scale, weight_decay=weight_decay)
        return
    _last_threads = threads = _threads_for(numel)
    library.megacompile_adamw_update(
        master.data_ptr(), grad.data_ptr(), _GRAD_KINDS[grad.dtype], exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(), 0 if out is None else out.data_ptr(),
        0 if out is None else _OUT_KINDS[out.dtype], numel,
        float(decay), float(1 - beta1), float(beta2), float(1 - beta2),
        float(bias_correction2_sqrt), float(eps), float(-step_size), float(grad_scale), threads)


@torch.no_grad()
def _update_torch(master, grad, exp_avg, exp_avg_sq, out, *, decay, weight, beta2,
                  bias_correction2_sqrt, eps, step_size, grad_scale, weight_decay) -> None:
    for start in range(0, master.numel(), _FALLBACK_SLICE):
        block = slice(start, start + _FALLBACK_SLICE)
        param, m, v = master[block], exp_avg[block], exp_avg_sq[block]
        g = grad[block].to(torch.float32)
        if grad_scale != 1.0:
            g = g.mul(grad_scale)  # never in place: g may be the caller's grad
        if weight_decay != 0:
            param.mul_(decay)
        m.lerp_(g, weight)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        param.addcdiv_(m, denom, value=-step_size)
        if out is not None:
            out[block].copy_(param)


def grad_sq_norm(grad) -> float:
    """Sum of squares of a flat float32 or bfloat16 gradient, accumulated in float64."""
    _check_flat("grad", grad, tuple(_GRAD_KINDS))
    numel = grad.numel()
    if numel == 0:
        return 0.0
    library = _native()
    if library is None:
        with torch.no_grad():
            return sum(float(torch.sum(torch.square(grad[i:i + _FALLBACK_SLICE].to(torch.float64))))
                       for i in range(0, numel, _FALLBACK_SLICE))
    return float(library.megacompile_grad_sq_norm(grad.data_ptr(), _GRAD_KINDS[grad.dtype], numel,
                                                  _threads_for(numel)))
