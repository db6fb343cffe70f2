"""Compile the generated elementwise kernels for real GPUs without one (as kernels/gpu_compile.py does
for the hand-written kernels), so a code-generation error cannot hide behind the interpreter.

`compile_generated(kernels)` builds each kernel's source file with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` for each arch in ARCHS, in a child
process per architecture (with TRITON_INTERPRET=0: interpreted functions cannot be code-generated) and reports
'ok' when PTX came out, or the reason it did not.

    python -m megacompile.fusion.gpu_check < request.json     # the child: JSON in, JSON out
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

# Every target a hardware profile names (megacompile/cost/hardware.py TARGETS): A100; RTX 3090;
# RTX 4090, RTX 6000 Ada, L40S; H100, H200, GH200; B200; RTX 5090. The default tests build
# FAST_ARCHS; the others, about a minute each on 2 cores, are in the slow tier.
ARCHS = (80, 86, 89, 90, 100, 120)
FAST_ARCHS = (80, 90)
BLOCK, NUM_WARPS = 1024, 4


def compile_generated(kernels, archs=ARCHS, timeout: float = 600) -> dict[str, dict[int, str]]:
    """{kernel key: {arch: 'ok' or the error}} for ElementwiseKernel objects."""
    kernels = list(kernels)
    specs = [{"key": k.key, "path": k.path, "signature": k.signature()} for k in kernels]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

    def child(arch: int) -> list[str]:
        proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps({"arch": arch, "kernels": specs}),
                              capture_output=True, text=True, env=env, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"sm_{arch} compile child failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    with ThreadPoolExecutor(len(archs)) as pool:
        per_arch = dict(zip(archs, pool.map(child, archs)))
    return {s["key"]: {arch: per_arch[arch][i] for arch in archs} for i, s in enumerate(specs)}


def compile_one(path: str, signature: dict, arch: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    try:
        spec = importlib.util.spec_from_file_location(f"generated_{abs(hash(path))}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        src = triton.compiler.ASTSource(fn=module.elementwise_kernel, signature=signature, constexprs={"BLOCK": BLOCK})
        options = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}   # as the launcher runs it
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
        return "ok" if ".entry" in compiled.asm.get("ptx", "") else "no PTX"
    except Exception as e:  # report every failure, not only the first
        while (e.__cause__ or e.__context__) is not None:
            e = e.__cause__ or e.__context__
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def _child() -> None:
    request = json.loads(sys.stdin.read())
    print(json.dumps([compile_one(k["path"], k["signature"], request["arch"]) for k in request["kernels"]]))


if __name__ == "__main__":
    _child()
