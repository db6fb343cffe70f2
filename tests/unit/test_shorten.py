"""The solver judges choices on a short stack (megacompile/planner/shorten.py): its peaks must be the whole
stack's, exactly, and its step times close to the whole stack's prediction."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megacompile.capture import capture
from megacompile.cost import get_profile, predict
from megacompile.ir.simulate import simulate
from megacompile.passes import StepKind, build_schedule
from megacompile.passes.lower import lower
from megacompile.passes.selective import with_selective
from megacompile.planner.shorten import shorten
from megacompile.planner.solve import candidates
from megacompile.planner.search import judges, search_space
from tests import models


@pytest.mark.slow       # about 30 s on 2 cores: every kind of choice over a whole stack
def test_short_stack_gives_the_whole_stacks_peak_for_every_kind_of_choice():
    captured = models.captured_llama(layers=14, d=32, rows=8, seq=32)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    hardware = get_profile("h100")

    def whole(choice):
        return build_schedule(captured, choice, check=False)
    peak_of, seconds_of = judges(captured, blocks, hardware, whole, lower, StepKind())
    # Every way to hold a block, and copies that span one or three compute nodes.
    # Strides of 3 and 4 need a deeper stack than this to be cut: the whole-stack judge is exact.
    # Weights resident from each block's forward to its backward too (offered where they fit twice).
    space = [f for f in search_space(captured, blocks, hardware, device_room=2 ** 40) if f.depth and f.stride in (0, 2)]
    assert any(set(blocks) <= f.resident for f in space)
    space += [dataclasses.replace(f, lag=3) for f in space if f.offloaded or f.boundary]
    cut, periodic, resident = 0, 0, 0
    for family in space:
        for choice in candidates(blocks, family)[::6]:
            short = shorten(captured, blocks, choice, max(choice.offload_lag, choice.prefetch_depth) + 1)
            cut += bool(short.runs) and not family.stride
            periodic += any(r.period > 1 for r in short.runs)
            resident += bool(short.runs) and set(blocks) <= choice.resident
            # one micro-batch, and three run layer by layer (each block's holds three times over)
            for c in (choice, dataclasses.replace(choice, micro_batches=3))[:1 + (family in space[::5])]:
                program = whole(c)
                peak = simulate(program).peak
                if c.micro_batches > 1 and c.boundary and len(c.offload) == len(blocks):
                    # Every block's input and saved values sent out, three micro-batches deep: there
                    # the short stack's peak may err high, never low (a fit passed over, never a
                    # plan over its budget chosen: the chosen plan is verified on the whole stack).
                    assert peak_of(c) >= peak, c
                else:
                    assert peak_of(c) == peak, c
                exact = predict(program, with_selective(captured, c.selective), hardware).step_s
                assert abs(seconds_of(c) - exact) <= 0.02 * exact, c
    assert cut > len([f for f in space if not f.stride])     # most choices were judged on a short stack
    assert resident >= 10       # weights resident from forward to backward among them
    # and some that recompute every m-th offloaded block, cut by whole periods of that pattern
    assert periodic >= 10


def test_a_frozen_run_ahead_of_the_trained_blocks_is_cut_at_the_whole_stacks_peak():
    # finetuning_type freeze (or a frozen vision tower): the first ten blocks have no backward, and a
    # run that long is cut; its blocks span their forwards only.
    torch.manual_seed(0)
    model = models.hf_llama(layers=14, d=32)
    for module in (model.model.embed_tokens, *model.model.layers[:10]):
        module.requires_grad_(False)
    ids = models.batch(96, 8, 32)
    captured = capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    blocks = [s for s, st in enumerate(captured.stages) if st.template.kind == "block"]
    hardware = get_profile("h100")

    def whole(choice):
        return build_schedule(captured, choice, check=False)
    peak_of, _ = judges(captured, blocks, hardware, whole, lower, StepKind())
    cut = 0
    for family in search_space(captured, blocks, hardware, device_room=2 ** 40)[::3]:
        for choice in candidates(blocks, family)[::12]:
            cut += bool(shorten(captured, blocks, choice, max(choice.offload_lag, choice.prefetch_depth) + 1).runs)
            assert peak_of(choice) == simulate(whole(choice)).peak, choice
    assert cut >= 10
