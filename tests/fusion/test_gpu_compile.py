"""Every generated elementwise kernel compiles to PTX for every target a hardware profile names,
without a GPU: sm_80, sm_90 and sm_89 in the slow tier, sm_86, sm_100 and sm_120 with `-m long`."""
from __future__ import annotations

import pytest
import torch

from megacompile.fusion import fuse
from megacompile.fusion.elementwise import generated_kernels
from megacompile.fusion.gpu_check import ARCHS, FAST_ARCHS, compile_generated
from tests.fusion.test_elementwise import fused, many_ops
from tests.fusion.test_patterns import captured


def _compile(archs):
    # generate what the models and the op-table test generate, whatever ran before in this session
    for kind, dtype in [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.bfloat16)]:
        fuse(captured(kind, dtype))
    fused(many_ops, torch.randn(8, 16), torch.randn(8, 16))
    fused(lambda x, b, s: torch.exp((x * b) * s) > 0.5, torch.randn(4, 8), torch.randn(8), torch.tensor(2.0))
    kernels = generated_kernels()
    assert len(kernels) >= 6
    results = compile_generated(kernels, archs=archs)
    failures = [f"{key} sm_{arch}: {r}" for key, per_arch in results.items()
                for arch, r in per_arch.items() if r != "ok"]
    assert not failures, "\n".join(failures)
    assert all(set(per_arch) == set(archs) for per_arch in results.values())


@pytest.mark.slow
def test_generated_kernels_compile_for_sm80_and_sm90():
    _compile(FAST_ARCHS)


# sm_89 (100 KB of shared memory a block) in the slow tier, the other targets (20-26 s each) with -m long
@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow if a == 89 else pytest.mark.long)
                                  for a in ARCHS if a not in FAST_ARCHS])
def test_generated_kernels_compile_for_the_other_profiles_targets(arch):
    _compile((arch,))
