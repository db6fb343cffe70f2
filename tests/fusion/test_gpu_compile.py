"""Every generated elementwise kernel compiles to PTX for sm_80 and sm_90, without a GPU."""
from __future__ import annotations

import torch

from megacompile.fusion import fuse
from megacompile.fusion.elementwise import generated_kernels
from megacompile.fusion.gpu_check import ARCHS, compile_generated
from tests.fusion.test_elementwise import fused, many_ops
from tests.fusion.test_patterns import captured


def test_generated_kernels_compile_for_sm80_and_sm90():
    # generate what the models and the op-table test generate, whatever ran before in this session
    for kind, dtype in [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.bfloat16)]:
        fuse(captured(kind, dtype))
    fused(many_ops, torch.randn(8, 16), torch.randn(8, 16))
    fused(lambda x, b, s: torch.exp((x * b) * s) > 0.5, torch.randn(4, 8), torch.randn(8), torch.tensor(2.0))
    kernels = generated_kernels()
    assert len(kernels) >= 6
    results = compile_generated(kernels)
    failures = [f"{key} sm_{arch}: {r}" for key, per_arch in results.items()
                for arch, r in per_arch.items() if r != "ok"]
    assert not failures, "\n".join(failures)
    assert all(set(per_arch) == set(ARCHS) for per_arch in results.values())
