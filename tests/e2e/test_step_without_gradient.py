"""A LLaVA whose vision tower and projector train, fed steps without images: those parameters get
no gradient, and torch.optim.AdamW (zero_grad(set_to_none=True)) skips them for the step: no
moment decay, no weight decay, no advance of their own step count, so their bias correction runs
behind the rest's afterwards. megacompile trains it as eagerly: losses to 1e-5, weights to the
noise floor measured per tensor, and the skipped parameters' masters and moments bit for bit as they were.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.acceptance.parity import BETAS, EPS, LR, WD
from megacompile.cost.host_memory import LEVELS, host_costs
from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, weight_errors
from tests.e2e.harness import clone
from tests.vlm import IMAGE_TOKEN, batch, llava

IMAGE_SIDE = ("model.vision_tower.", "model.multi_modal_projector.")


def text_only(seed: int) -> dict[str, torch.Tensor]:
    """Two rows of text: no image token, no pixel_values."""
    b = batch(seed=seed)
    del b["pixel_values"]
    b["input_ids"] = b["input_ids"].masked_fill(b["input_ids"] == IMAGE_TOKEN, 5)
    b["labels"] = b["input_ids"].clone()
    return b


def eager(model, steps: list[list[dict]], max_grad_norm: float | None = None) -> list[float]:
    """torch.optim.AdamW in place; each step a list of micro-batches, (loss / k).backward() each."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS,
                            weight_decay=WD)
    losses = []
    for micro_batches in steps:
        opt.zero_grad(set_to_none=True)
        for inputs in micro_batches:
            loss = model(**inputs).loss
            (loss / len(micro_batches)).backward()
            losses.append(loss.item())
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
    return losses


def double(steps: list[list[dict]]) -> list[list[dict]]:
    return [[{k: v.double() if v.is_floating_point() else v for k, v in b.items()} for b in s] for s in steps]


def image_side(engine) -> dict[str, tuple[torch.Tensor, ...]]:
    host = engine.host
    return {n: tuple(host.view(t, n).clone() for t in ("master", "exp_avg", "exp_avg_sq"))
            for n in host.slots if n.startswith(IMAGE_SIDE)}


def assert_parity(steps: list[list[dict]], grad_accum: int = 1, max_grad_norm: float | None = None,
                  untouched_after: int | None = None, kernel: str = "torch", model=None) -> megacompile.Engine:
    """untouched_after: the image side's state after that (0-based) step is the state after the step
    before it, bit for bit (the step had no image)."""
    model = model if model is not None else llava()
    reference = clone(model)
    losses = eager(reference, steps, max_grad_norm)
    exact = clone(model).double()
    eager(exact, double(steps), max_grad_norm)
    # Per tensor: the attention key biases get no true gradient (softmax ignores a shift), so
    # their float32 noise is their whole size; a floor taken over all tensors would hide the rest.
    noise = weight_errors(exact, reference)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu", grad_accum=grad_accum,
                                 optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                             max_grad_norm=max_grad_norm, kernel=kernel))
    ours, before = [], None
    for i, micro_batches in enumerate(steps):
        for inputs in micro_batches:
            ours.append(engine.step(**inputs))
        engine.synchronize()
        if untouched_after is not None and i == untouched_after - 1:
            before = image_side(engine)
        if untouched_after is not None and i == untouched_after:
            after = image_side(engine)
            assert before.keys() == after.keys() and before
            for n in before:
                assert all(torch.equal(a, b) for a, b in zip(before[n], after[n])), n
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    for name, err in weight_errors(engine, reference).items():
        assert err <= max(1e-5, WEIGHT_NOISE_FACTOR * noise[name]), (name, err, noise[name])
    return engine


@pytest.mark.slow    # a first text-only step stays in the default tier
def test_a_text_only_step_between_image_steps_trains_as_eagerly():
    """Through the native kernel: each run of parameters of one step count is its own call."""
    engine = assert_parity([[batch(seed=0)], [text_only(1)], [batch(seed=2)]], untouched_after=1, kernel="fused")
    missed = engine.state.missed_steps
    tower = [n for n in engine.host.slots if n.startswith(IMAGE_SIDE) and "post_layernorm" not in n]
    assert tower and all(missed[n] == 1 for n in tower)
    # LLaVA's default features come from before the tower's last norm: no step reaches it
    assert missed["model.vision_tower.post_layernorm.weight"] == 3
    assert not any(n in missed for n in engine.host.slots if not n.startswith(IMAGE_SIDE))


def test_a_first_step_without_images_still_trains_the_tower_later_as_eagerly():
    """torch makes a parameter's AdamW state at its first gradient: the tower's first update is its
    own step 1, at the run's step 2."""
    assert_parity([[text_only(0)], [batch(seed=1)], [batch(seed=2)]])


@pytest.mark.slow    # the step without a gradient stays in the default tier
def test_accumulation_steps_a_parameter_any_micro_batch_reaches():
    """Step 1: image then text; step 2: text then image (the tower's gradient starts from zero at
    the second micro-batch, not from the buffer's old sum); step 3: text alone."""
    assert_parity([[batch(seed=0), text_only(1)], [text_only(2), batch(seed=3)], [text_only(4), text_only(5)]],
                  grad_accum=2)


def test_clipping_takes_the_norm_over_the_gradients_that_exist():
    """A small max_grad_norm clips every step: a norm that counted the skipped parameters' stale
    sums (or left out a sum made by the step's first micro-batch only) would scale the step
    otherwise."""
    assert_parity([[batch(seed=0), text_only(1)], [text_only(2), text_only(3)], [text_only(4), batch(seed=5)]],
                  grad_accum=2, max_grad_norm=0.05)


def test_with_the_vision_side_frozen_text_only_steps_train_as_eagerly():
    """Frozen, the tower and projector are constants of every program."""
    model = llava()
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith(IMAGE_SIDE))
    assert_parity([[batch(seed=0)], [text_only(1)], [batch(seed=2)]], model=model)


@pytest.mark.slow     # 9 s
def test_with_masters_and_moments_on_disk_the_skipped_parameters_stay_as_in_ram(tmp_path, monkeypatch):
    """The disk tier streams each owner in pieces of 4096 parameters; the runs of stepped
    parameters cross the pieces' edges, and the run agrees bit for bit with the same run in RAM."""
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "4096")
    monkeypatch.setenv("MEGACOMPILE_TIER_VERIFY", "1")
    steps = [batch(seed=0), text_only(1), batch(seed=2)]
    model = llava()
    runs = []
    for where in (None, LEVELS[2]):
        options = {}
        if where is not None:
            ram = host_costs(runs[0].plan.captured, torch.float32)[2].ram_bytes
            options = {"nvme_dir": str(tmp_path / "tier"), "host_budget": ram / 2 ** 30}
        engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu", **options,
                                     optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                                 kernel="torch"))
        losses = [engine.step(**b) for b in steps]
        engine.synchronize()
        assert engine.host_cost.placement == (where or LEVELS[0])
        runs.append(engine)
        runs[-1].losses = losses
    assert runs[0].losses == runs[1].losses
    for name in runs[0].host.slots:
        for table in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(runs[0].host.view(table, name), runs[1].host.view(table, name)), (table, name)
    assert runs[1].state.missed_steps == runs[0].state.missed_steps != {}


def test_the_host_cost_counts_the_parameters_the_first_program_does_not_reach():
    """A text-only first step lays out the tower too: what the plan counts is what is allocated."""
    engine = megacompile.compile(llava(), hbm_budget=1.0, device="cpu")
    engine.step(**text_only(0))
    assert engine.host.slots.keys() == {n for n, p in llava().named_parameters() if p.requires_grad}
    assert engine.host.nbytes == host_costs(engine.plan.captured, torch.float32)[0].ram_bytes


def test_one_call_per_owner_when_every_parameter_steps_alike(monkeypatch):
    """The update calls AdamW once per run of one step count: once per owner at an image step;
    a text-only step updates no owner that holds only the image side (the prologue's, with the
    tower's embeddings, and the tower's blocks'); at the image step after it those are at their
    step 2, and the bridge's owner holds two runs: the token embedding at step 3, the projector at
    its step 2."""
    from megacompile.optim import host_update
    calls = []
    real = host_update.adamw_update_
    monkeypatch.setattr(host_update, "adamw_update_", lambda *a, **k: (calls.append(k["step"]), real(*a, **k)))
    engine = megacompile.compile(llava(), hbm_budget=1.0, device="cpu")
    per_step = []
    for b in (batch(seed=0), text_only(1), batch(seed=2)):
        calls.clear()
        engine.step(**b)
        engine.synchronize()
        per_step.append(sorted(calls))
    owners = len(engine.host.owners)
    held: dict[int, list[str]] = {}
    for name, slot in engine.host.slots.items():
        held.setdefault(slot.owner, []).append(name)
    image_side = sum(all(n.startswith(IMAGE_SIDE) for n in names) for names in held.values())
    assert image_side == 3
    assert per_step[0] == [1] * owners and per_step[1] == [2] * (owners - image_side)
    assert per_step[2] == [2] * (image_side + 1) + [3] * (owners - image_side)
