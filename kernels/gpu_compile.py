"""Compile every kernel for real GPUs without one: the second witness next to the interpreter.

`record_launches()` notes each kernel launch (argument types, constexprs, num_warps) while the
kernels run under the interpreter; `compile_launches()` then builds exactly those specializations
with `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))` for every target in ARCHS and
checks that each produced PTX. The compile runs in child processes (one per architecture) with
TRITON_INTERPRET=0, because `triton.jit` picks the interpreter when a kernel is decorated, and the
code generator cannot read interpreted functions.

    python -m megacompile.kernels.gpu_compile < launches.json   # the child: JSON in, JSON out
"""
import contextlib
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

# Every target a hardware profile names (megacompile/cost/hardware.py TARGETS): A100; RTX 3090;
# RTX 4090, RTX 6000 Ada, L40S; H100, H200, GH200; B200; RTX 5090. The default tests build
# FAST_ARCHS; the slow tier sm_89, and `-m long` the others (three to four minutes each on 2 cores).
ARCHS = (80, 86, 89, 90, 100, 120)
FAST_ARCHS = (80, 90)
# Kernels whose results the checks hold bit-exact (or to 1e-6) against torch: on the device they
# must use IEEE-rounded division and square root, and launch with enable_fp_fusion=False. The
# others may use the approximate forms (ex2.approx, div.full: within 2 ulp) under their tolerances.
# Shared memory one block may opt into, by target (CUDA's sharedMemPerBlockOptin): a kernel that asks
# for more compiles but fails at launch.
SHARED_PER_BLOCK = {80: 166912, 86: 101376, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
IEEE_KERNELS = {"adamw_kernel", "scale_kernel", "cast_kernel", "accumulate_kernel"}
APPROXIMATE = ("div.full.f32", "div.approx", "sqrt.approx", "rcp.approx", "rsqrt.approx")

_POINTER_TYPES = {
    torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16",
    torch.int64: "*i64", torch.int32: "*i32", torch.int16: "*i16", torch.uint8: "*u8", torch.bool: "*i1",
}


@dataclass(frozen=True)
class Launch:
    """One kernel specialization as launched: enough to compile it again without running it."""
    module: str  # e.g. "rms_norm"
    kernel: str  # e.g. "rms_norm_forward_kernel"
    signature: dict  # argument name -> Triton type ("*fp32", "i32", "fp32", "constexpr")
    constexprs: dict  # constexpr argument name -> value
    num_warps: int
    fp_fusion: bool = True  # enable_fp_fusion as launched (False: no multiply-add contraction)
    num_stages: int | None = None  # software pipelining depth as launched (None: Triton's default)

    @property
    def key(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def kernels():
    """(module name, kernel name, kernel) for every launchable kernel (a jit function named `*_kernel`)
    defined in any module of this package."""
    package = importlib.import_module(__package__)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("__"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        for name, obj in vars(module).items():
            defined_here = getattr(getattr(obj, "fn", None), "__module__", None) == module.__name__
            if name.endswith("_kernel") and defined_here and hasattr(obj, "run"):
                yield info.name, name, obj


def _constexpr_names(fn) -> set[str]:
    return {
        name for name, p in inspect.signature(fn).parameters.items()
        if p.annotation is tl.constexpr or "constexpr" in str(p.annotation)
    }


def _arg_type(value) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a kernel argument of type {type(value).__name__}")


def _launch(module_name, kernel_name, kernel, args, kwargs) -> Launch:
    params = inspect.signature(kernel.fn).parameters
    bound = inspect.signature(kernel.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    constexpr_names = _constexpr_names(kernel.fn)
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if name in constexpr_names:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name] = _arg_type(value)
    stages = kwargs.get("num_stages")
    return Launch(module_name, kernel_name, signature, constexprs, int(kwargs.get("num_warps", 4)),
                  bool(kwargs.get("enable_fp_fusion", True)), None if stages is None else int(stages))


@contextlib.contextmanager
def record_launches():
    """Yield a dict that fills with {Launch.key: Launch} for every kernel launched inside the block."""
    launches: dict[str, Launch] = {}
    patched = []  # (kernel, the instance's own `run` before this block, if an outer block set one)
    for module_name, kernel_name, kernel in kernels():
        def run(*args, grid, warmup, _names=(module_name, kernel_name), _kernel=kernel, _run=kernel.run, **kwargs):
            launch = _launch(*_names, _kernel, args, kwargs)
            launches.setdefault(launch.key, launch)
            return _run(*args, grid=grid, warmup=warmup, **kwargs)

        patched.append((kernel, vars(kernel).get("run")))
        kernel.run = run  # `kernel[grid](...)` calls self.run: the instance attribute shadows the method
    try:
        yield launches
    finally:
        for kernel, previous in patched:
            if previous is None:
                del kernel.run
            else:
                kernel.run = previous


def compile_one(launch: Launch, arch: int) -> str:
    """'ok', or why it failed; run only where TRITON_INTERPRET is off."""
    module = importlib.import_module(f"{__package__}.{launch.module}")
    kernel = getattr(module, launch.kernel)
    try:
        src = triton.compiler.ASTSource(fn=kernel, signature=launch.signature, constexprs=launch.constexprs)
        options = {"num_warps": launch.num_warps, "enable_fp_fusion": launch.fp_fusion}
        if launch.num_stages is not None:
            options["num_stages"] = launch.num_stages
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        ptx = compiled.asm.get("ptx", "")
        if ".entry" not in ptx:
            return "no PTX"
        shared, limit = compiled.metadata.shared, SHARED_PER_BLOCK[arch]
        if shared > limit:
            return f"needs {shared} B of shared memory, sm_{arch} gives a block {limit} B"
        approximate = sorted({op for op in APPROXIMATE if op in ptx})
        if launch.kernel in IEEE_KERNELS and (approximate or launch.fp_fusion):
            return f"claims IEEE rounding but {'uses ' + ', '.join(approximate) if approximate else 'contracts FMAs'}"
        return "ok"
    except Exception as e:  # report every failure, not only the first
        while (e.__cause__ or e.__context__) is not None:  # a CompilationError wraps the real reason
            e = e.__cause__ or e.__context__
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def compile_launches(launches, archs=ARCHS, timeout: float = 600) -> dict[str, dict[int, str]]:
    """{Launch.key: {arch: 'ok' or the error}}, compiled with the interpreter off, one child process per arch."""
    launches = list(launches)
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning

    def child(arch: int) -> list[str]:
        payload = json.dumps({"arch": arch, "launches": [asdict(x) for x in launches]})
        proc = subprocess.run(
            [sys.executable, "-m", f"{__package__}.gpu_compile"],
            input=payload, capture_output=True, text=True, env=env, timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"sm_{arch} compile child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(len(archs)) as pool:
        per_arch = dict(zip(archs, pool.map(child, archs)))
    return {x.key: {arch: per_arch[arch][i] for arch in archs} for i, x in enumerate(launches)}


def _child() -> None:
    request = json.loads(sys.stdin.read())
    print(json.dumps([compile_one(Launch(**spec), request["arch"]) for spec in request["launches"]]))


if __name__ == "__main__":
    _child()
