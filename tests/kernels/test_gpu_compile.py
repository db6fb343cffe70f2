"""Every kernel compiles for every target a hardware profile names, in the specializations the
interpreter ran: sm_80 and sm_90 and sm_89's attention in the slow tier (a minute and a half of the
default tier's CPU; CI runs both tiers), every target with `-m long`.

Attention (causal, over a sliding window, within packed documents, over padding, with sinks, softcapped) is compiled in the tiles, pipeline stages and warps
each target launches instead (kernels/attention.py `tiles`): under the interpreter its tiles are small and widened to fp32,
which no GPU runs. A compile that asks for more shared memory than the target gives a block fails."""
import dataclasses

import pytest
import torch

from megacompile.kernels import check
from megacompile.kernels.attention import attention_backward, attention_forward, tiles
from megacompile.kernels.gpu_compile import ARCHS, FAST_ARCHS, compile_launches, record_launches

# DeepSeek's latent attention: q and k heads of 192, v heads of 128.
HEAD_DIMS = [(128, torch.bfloat16), (192, torch.bfloat16, 128)]
# Gemma's 256 is the one that tests a target's shared memory; fp32 attention on a GPU is torch's
# memory-efficient op (the fusion pass leaves it), so the kernel's fp32 tiles only run on sm_80/90 here.
WIDE_HEADS = [(128, torch.bfloat16), (256, torch.bfloat16)]
OTHER_HEADS = [(64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float32)]


def attention_launches(arch: int, head_dim: int, dtype: torch.dtype, value_dim: int | None = None) -> list:
    """The attention kernels' launches as a GPU of `arch` makes them: the interpreter's recorded
    launches with that target's tiles, stages and warps, and no widening of bf16 tiles. With a
    `value_dim` (latent attention), causal attention alone."""
    q, k, v = (torch.randn(1, 8, h, d).to(dtype).transpose(1, 2)
               for h, d in ((2, head_dim), (1, head_dim), (1, value_dim or head_dim)))
    starts = torch.tensor([[0, 0, 0, 3, 3, 3, 3, 3]], dtype=torch.int32)
    kept = torch.tensor([[False, True, True, True, True, True, True, True]])
    sinks = torch.zeros(2, dtype=dtype)
    with record_launches() as recorded:
        # causal, a sliding window, packed documents, padding, sinks, softcapping (WINDOWED, DOCUMENTS,
        # PADDED, SINKS, SOFTCAP; the backward passes take no sinks: the lse holds their share)
        variants = ((None, None, None, None, 0.0), (3, None, None, None, 0.0), (None, starts, None, None, 0.0),
                    (3, None, kept, None, 0.0), (3, None, None, sinks, 0.0), (3, None, None, None, 50.0))
        for window, documents, padding, logits, cap in variants[:1] if value_dim else variants:
            o, lse = attention_forward(q, k, v, True, window=window, starts=documents, kept=padding, sinks=logits,
                                       softcap=cap)
            attention_backward(torch.ones_like(o), q, k, v, o, lse, True, window=window, starts=documents,
                               kept=padding, softcap=cap)
    forward, backward = tiles(head_dim, dtype, arch, value_dim)
    launches = []
    for launch in recorded.values():
        cfg = forward if launch.kernel == "attention_forward_kernel" else backward
        constexprs = {**launch.constexprs, **{key: cfg[key] for key in launch.constexprs if key in cfg}}
        if launch.kernel == "attention_backward_q_kernel":    # tall query tiles, short key steps
            constexprs.update(BLOCK_M=cfg["BLOCK_N"], BLOCK_N=cfg["BLOCK_M"])
        if launch.kernel == "attention_delta_kernel":        # it reads o and do: the value head dims
            constexprs.update(BLOCK_M=cfg["BLOCK_N"], BLOCK_D=cfg["BLOCK_DV"])
        if "UPCAST" in constexprs:
            constexprs["UPCAST"] = dtype == torch.float32
        launches.append(dataclasses.replace(launch, constexprs=constexprs, num_warps=cfg["num_warps"],
                                            num_stages=cfg["num_stages"]))
    # forward six times, key pass and dq pass five times, delta once; latent: each once
    assert len(launches) == (4 if value_dim else 17)
    return launches


def _compile(archs, head_dims, every_kernel: bool = True):
    launches = {}
    if every_kernel:
        rows = check.run("test", compile_gpu=False)
        assert not check.uncovered(rows), "kernels that no check case launches"
        launches = {x.key: x for r in rows for x in r.launches if x.module != "attention"}
        # the frozen norms' backward (dx alone) is its own specialization
        frozen = {x.kernel for x in launches.values() if x.constexprs.get("WEIGHT_GRAD") is False}
        assert {"rms_norm_backward_kernel", "layer_norm_backward_kernel"} <= frozen, frozen
    # The targets compiled together launch attention alike (both hold three stages in shared memory).
    per_arch = {arch: [x for dims in head_dims for x in attention_launches(arch, *dims)] for arch in archs}
    assert all(per_arch[arch] == per_arch[archs[0]] for arch in archs)
    launches.update({x.key: x for x in per_arch[archs[0]]})
    results = compile_launches(launches.values(), archs=archs)
    failures = [
        f"{launches[key].kernel} {launches[key].signature} {launches[key].constexprs} sm_{arch}: {result}"
        for key, per in results.items() for arch, result in per.items() if result != "ok"
    ]
    assert not failures, "\n".join(failures)
    assert all(set(per) == set(archs) for per in results.values())


@pytest.mark.slow
def test_every_kernel_compiles_to_ptx_for_sm80_and_sm90():
    _compile(FAST_ARCHS, HEAD_DIMS)


# sm_89 (RTX 4090, L40S) stands in the slow tier for the targets of 100 KB of shared memory a block,
# with attention at Gemma's head dim of 256 alone: its tiles are what a target's shared memory decides
# (the other kernels' launches are the same on every target, compiled above for sm_80 and sm_90).
# Every kernel for each other target, sm_89 included, with `-m long` (three to four minutes a target
# on two cores).
@pytest.mark.slow
def test_attention_compiles_for_the_targets_of_100_kb_of_shared_memory():
    _compile((89,), [(256, torch.bfloat16)], every_kernel=False)


@pytest.mark.long
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in FAST_ARCHS])
def test_every_kernel_compiles_for_the_other_profiles_targets(arch):
    _compile((arch,), WIDE_HEADS)


@pytest.mark.long       # seven minutes on two cores; the head dims of the default tier's test stand for it
def test_attention_compiles_at_the_other_head_dims_on_sm80_and_sm90():
    _compile(FAST_ARCHS, OTHER_HEADS, every_kernel=False)
