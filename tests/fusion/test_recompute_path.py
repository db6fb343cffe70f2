"""The recompute path runs the fused kernels: a selective variant's backward redoes the block's cheap
forward ops (norms, rotary embeddings, activations) before the gradients that read them, and the
forward patterns rewrite those copies as they rewrite the forward's, so a block saving selectively
trains exactly, through the same kernels, with less memory traffic in its backward."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

import megacompile.planner.search as planner
from megacompile.acceptance.parity import moment_error
from megacompile.cost import recomputed_bytes, recomputed_region
from megacompile.fusion import FORWARD_PATTERNS, REWRITES, fuse, fusion_report
from megacompile.passes import ScheduleChoice
from tests.e2e.harness import assert_same_weights, clone, eager_losses, megacompile_run, weight_noise
from tests.fusion.test_patterns import GONE, captured
from tests.fusion.training import BUILDERS, batches

# Kernels expected in a block's recomputed region: the forward kernels of the norms, rotary
# embeddings and activation that the selective backward redoes.
RECOMPUTED = {"llama": {"rms_norm": 2, "rope": 2, "swiglu": 1}, "gpt2": {"layer_norm": 2, "gelu": 1}}


def _kernels(nodes) -> Counter:
    return Counter(n.meta["kernel"] for n in nodes if "kernel" in n.meta)


def _block(c):
    return next(t for t in c.templates if t.kind == "block")


def _region(t):
    return recomputed_region(t.backward, len(t.tangent_outputs))


def _region_bytes(t) -> float:
    return recomputed_bytes(t.backward, len(t.tangent_outputs))


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("llama", torch.bfloat16), ("gpt2", torch.float32)])
def test_recomputed_block_runs_the_fused_kernels(kind, dtype):
    before = captured(kind, dtype)
    after = fuse(before)
    full = _block(after)
    variant = full.selective
    region = _region(variant)
    assert _kernels(region) == RECOMPUTED[kind], fusion_report(after)
    # the gradient side is the full block's backward, kernel for kernel; nothing of it is recomputed
    rest = [n for n in variant.backward.body if n not in set(region)]
    assert _kernels(rest) == _kernels(full.backward.body)
    assert not _kernels(_region(full))
    # no ATen op any pattern covers is left in the variant's backward, forward ops included
    left = {n.target for n in variant.backward.body} & GONE[kind]
    assert not left, f"the recomputed region still runs {left}"
    if dtype == torch.bfloat16:   # the norm kernels read x in bf16: no fp32 copy of it is recomputed
        assert not [n for n in region if n.target == torch.ops.aten._to_copy.default
                    and n.meta["val"].dtype == torch.float32 and n.meta["val"].dim() == 3]
    # Fewer bytes in the region than unfused, and for RMSNorm and RoPE (several ATen passes each)
    # than with the recompute path left to the generated kernels; LayerNorm is one ATen op and
    # GPT-2's GELU one generated kernel either way. The saved set does not change.
    eager_path = fuse(before, only={name for name, _ in REWRITES} - FORWARD_PATTERNS)
    moved = [_region_bytes(_block(c).selective) for c in (after, eager_path, before)]
    assert (moved[0] < moved[1] if kind == "llama" else moved[0] == moved[1]) and moved[1] < moved[2], moved
    assert variant.saved == _block(eager_path).selective.saved


def test_fused_recompute_trains_as_eager(monkeypatch):
    """fp32 tiny Llama, every block saving selectively and the first recomputed whole: losses and
    first-step gradients within 1e-5 of eager torch.optim.AdamW, weights within eager's noise floor."""
    torch.manual_seed(0)
    model = BUILDERS["llama"]()
    data = batches(steps=3)
    reference = clone(model)
    eager_first: dict = {}
    losses = eager_losses(reference, data, "llama", first_moments=eager_first)
    monkeypatch.setattr(planner, "solve", lambda blocks, *a, **k: (
        ScheduleChoice(1, frozenset(blocks[:1]), selective=frozenset(blocks)), 0))
    first: dict = {}
    run = megacompile_run(clone(model), data, "llama", 1.0, fuse=True, first_moments=first)
    stages = run.engine.plan.captured.stages
    blocks = [st.template for st in stages if st.template.kind == "block"]
    assert blocks and all(t.full is not None for t in blocks), "the forced choice must run the selective variants"
    assert all(_kernels(_region(t)) == RECOMPUTED["llama"] for t in blocks)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert moment_error(first, eager_first) <= 1e-5
    assert_same_weights(run.engine, reference, noise=weight_noise(model, data, "llama", reference))
    assert all(peak == run.predicted for peak in run.peaks)
