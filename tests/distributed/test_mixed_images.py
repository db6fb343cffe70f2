"""Data parallelism over micro-batches with and without images while a vision tower trains: two
ranks (gloo, the cpu backend) held against one process that accumulates the same micro-batches.

Eager DDP (find_unused_parameters), like one process accumulating the ranks' micro-batches, counts
a zero gradient for the tower from a rank whose micro-batch has no image: the tower steps with
(g_0 + 0) / 2. Only a step where no rank's micro-batch reaches it leaves it as it was.
"""
from __future__ import annotations

import json

import pytest
import torch

from megacompile.acceptance.parity import BETAS, LR, WD, WEIGHT_NOISE_FACTOR, weight_errors
from tests.e2e.harness import clone
from tests.e2e.test_step_without_gradient import IMAGE_SIDE, double

from . import ranks

TOL = 1e-5


def eager(model, steps: list[list[dict]]) -> None:
    """torch.optim.AdamW in place, with the ranks' settings; each step its micro-batches'
    (loss / k).backward(), clipped."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=ranks.EPS,
                            weight_decay=WD)
    for micro_batches in steps:
        opt.zero_grad(set_to_none=True)
        for inputs in micro_batches:
            (model(**inputs).loss / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ranks.CLIP)
        opt.step()


def one_process(steps: list[list[dict]]) -> dict:
    """The same micro-batches in one process, grad_accum=2: rank 0's, then rank 1's."""
    engine = ranks.llava_trained(grad_accum=2)
    losses, unchanged = [], []
    for i, micro_batches in enumerate(steps):
        if i == ranks.NO_IMAGE_STEP:
            vision = [n for n in engine.host.slots if n.startswith(IMAGE_SIDE)]
            before = ranks.image_side(engine.host, vision)
        losses.append([engine.step(**b) for b in micro_batches])
        if i == ranks.NO_IMAGE_STEP:
            after = ranks.image_side(engine.host, vision)
            unchanged = [n for n in vision if all(torch.equal(a, b) for a, b in zip(before[n], after[n]))]
    return {"losses": losses, "weights": engine.state_dict(), "missed": dict(engine.state.missed_steps),
            "vision": vision, "unchanged": unchanged,
            "layout": [[n, s.owner, s.offset] for n, s in engine.host.slots.items()]}


@pytest.mark.long   # about 50 s on 2 cores
def test_micro_batches_with_and_without_images_train_the_tower_as_one_process(tmp_path):
    """ranks.MIXED: an image on rank 0 only (rank 1's first program has none, yet lays the tower
    out as rank 0's does), on both, on neither, on rank 1 only; clipped every step, so the norm
    must count the summed zeros. Each rank is a node of its own: the new weights of every owner
    cross between them, which needs the ranks to update the same owners in one order whatever
    their programs."""
    ranks.spawn("mixed_images", 2, str(tmp_path), nodes=2)
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    steps = ranks.mixed_micro_batches()
    one = one_process(steps)

    for rank, result in enumerate(results):
        theirs = [step[rank] for step in one["losses"]]
        assert max(abs(a - b) / abs(b) for a, b in zip(result["losses"], theirs, strict=True)) <= TOL
        assert result["layout"] == one["layout"]
        assert result["missed"] == one["missed"]
        # the step without images left every vision parameter this rank holds as it was, bit for bit
        assert result["unchanged"] == result["held"]
    assert sorted(results[0]["held"] + results[1]["held"]) == sorted(one["vision"]) == sorted(one["unchanged"])
    assert results[0]["held"] and results[1]["held"]     # the shares cut through the tower
    tower = [n for n in one["vision"] if "post_layernorm" not in n]    # LLaVA's features skip the last norm
    assert {one["missed"][n] for n in tower} == {1}

    # The noise floor: float32 eager against float64 eager on the same steps, per tensor (an
    # attention key bias gets no true gradient, so its float32 noise is its whole size).
    model = ranks.llava_model()
    reference, exact = clone(model), clone(model).double()
    eager(reference, steps)
    eager(exact, double(steps))
    noise = weight_errors(exact, reference)
    eager_weights = reference.state_dict()
    for name, err in _errors(one["weights"], eager_weights).items():     # the one process is right
        assert err <= max(TOL, WEIGHT_NOISE_FACTOR * noise[name]), (name, err, noise[name])
    for name, err in _errors(torch.load(tmp_path / "weights.pt"), one["weights"]).items():
        assert err <= max(TOL, WEIGHT_NOISE_FACTOR * noise[name]), (name, err, noise[name])


def _errors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per tensor: max |ours - theirs| relative to the tensor's largest entry."""
    assert ours.keys() == theirs.keys()
    return {name: (ours[name].float() - t.float()).abs().max().item() / (t.abs().max().item() or 1.0)
            for name, t in theirs.items()}
