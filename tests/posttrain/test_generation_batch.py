"""TRL's generation batch through the engine: a rollout batch cut into grad_accum micro-batches of
one optimizer step, with dapo's loss divided by the whole rollout batch's completion tokens
(token_count) and each token weighed by the sampler's correction (sampling_ratio). The engine's
step at its smallest budget against eager torch.optim.AdamW on TRL's formula written out here:
the micro-batches' losses to 1e-6 and the first step's gradients (AdamW's first moment) to 1e-5."""
import copy

import pytest
import torch

from megacompile import AdamW, Engine, compile, minimum_budget
from megacompile.acceptance.parity import BETAS, EPS, LR, WD, moment_error
from megacompile.posttrain import IGNORE, GRPOLoss, GRPOObjective, group_advantages, token_logprobs
from megacompile.posttrain.rollout_batch import rollout_batch
from megacompile.train import load, log, run
from megacompile.train.stages import grpo as grpo_stage
from tests.posttrain import stage_files
from tests.posttrain.test_parity import _completions, _policy
from tests.train import files

ROWS, MICRO = 8, 4          # a rollout batch of 8 completions, micro-batches of 4: grad_accum 2


def _trl_loss(logps, old, advantages, mask, ratio, tokens):
    """TRL's dapo micro-batch loss, element by element in float64: -min(w A, clip(w) A) x the
    sampler's ratio per token, summed, over the rollout batch's completion tokens."""
    total = 0.0
    for r in range(logps.shape[0]):
        for t in range(logps.shape[1]):
            if mask[r, t]:
                w = torch.exp(logps[r, t].double() - old[r, t].double())
                a = float(advantages[r])
                term = -torch.minimum(w * a, w.clamp(0.8, 1.2) * a)
                total = total + term * float(ratio[r, t])
    return total / tokens


def test_a_rollout_batch_in_micro_batches_trains_as_trl_divides_it():
    policy = _policy()
    ids, labels = _completions(ROWS, 5)
    with torch.no_grad():
        old, mask = token_logprobs(policy(ids), labels)
    old = old + 0.03                                     # a sampling policy a little off the trained one
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 1.0, 3.0]), 4)
    ratio = torch.rand(ROWS, ids.shape[1], generator=torch.Generator().manual_seed(1)) * 2
    tokens = mask.sum()
    micro = [slice(0, MICRO), slice(MICRO, ROWS)]
    parts = [dict(input_ids=ids[s], labels=labels[s], old_logps=old[s], advantages=advantages[s],
                  sampling_ratio=ratio[s], token_count=tokens / 2) for s in micro]

    reference = GRPOObjective(copy.deepcopy(policy), GRPOLoss(loss_type="dapo"))
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    eager = []
    for s in micro:         # TRL: each micro-batch's loss over the rollout batch's tokens, no 1/grad_accum
        logps, m = token_logprobs(reference.policy(ids[s]), labels[s])
        loss = _trl_loss(logps, old[s], advantages[s], m, ratio[s], float(tokens))
        loss.backward()
        eager.append(loss.item())
    opt.step()
    names = {p: n for n, p in reference.named_parameters()}
    eager_moments = {names[p]: s["exp_avg"].clone() for p, s in opt.state.items()}

    objective = GRPOObjective(copy.deepcopy(policy), GRPOLoss(loss_type="dapo"))
    smallest = minimum_budget(copy.deepcopy(objective), compute_dtype=torch.float32, hardware="cpu",
                              inputs=parts[0])
    engine = compile(objective, hbm_budget=smallest, device="cpu", compute_dtype=torch.float32, grad_accum=2,
                     optimizer=AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch"))
    # the engine divides each micro-batch's gradient by grad_accum, so token_count is the rollout
    # batch's count over grad_accum, and each loss it reports is grad_accum times TRL's
    ours = [engine.step(**part) / 2 for part in parts]
    engine.synchronize()
    assert engine.steps_done == 1
    moments = {n: engine.host.view("exp_avg", n).clone() for n in engine.host.slots}
    engine.close()
    assert ours == pytest.approx(eager, rel=1e-6, abs=1e-8), (ours, eager)
    assert moment_error(moments, eager_moments) <= 1e-5


def test_a_grpo_run_samples_one_rollout_batch_for_the_optimizer_steps_it_makes(tmp_path, monkeypatch):
    """batch 4, grad_accum 2, steps_per_generation 4: one rollout of 16 completions (4 prompts x 4)
    trains 2 optimizer steps of 2 micro-batches of 4 rows, each row once, shuffled; dapo divides
    by the rollout batch's completion tokens over steps_per_generation (TRL's x grad_accum /
    steps_per_generation, with the engine's 1 / grad_accum of each micro-batch's gradient)."""
    work = stage_files.workspace(tmp_path)
    stage_files.CALLS.clear()
    steps = []
    step = Engine.step

    def recorded(engine, *args, **kwargs):
        steps.append({k: v.clone() for k, v in kwargs.items()})
        return step(engine, *args, **kwargs)

    monkeypatch.setattr(Engine, "step", recorded)
    rollouts = []

    def kept(*args, **kwargs):
        rollouts.append(rollout_batch(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(grpo_stage, "rollout_batch", kept)
    settings = stage_files.grpo(work, str(tmp_path / "run"), batch=4, grad_accum=2, steps_per_generation=4,
                                loss_type="dapo", max_completion_length=4)
    result = run(load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings), []))
    assert result["steps"] == 2
    call, = stage_files.CALLS                        # one rollout batch for both steps
    rollout, = rollouts
    assert len(call["completions"]) == 16 == rollout["input_ids"].shape[0]
    assert len(steps) == 4 and all(s["input_ids"].shape[0] == 4 for s in steps)
    def table(b):
        return torch.cat([b["input_ids"].double(), b["labels"].double(), b["advantages"][:, None].double()], 1)

    trained, sampled = torch.cat([table(s) for s in steps]), table(rollout)
    # each completion trained once, with its own labels and advantage, in a shuffled order
    assert sorted(map(tuple, trained.tolist())) == sorted(map(tuple, sampled.tolist()))
    assert not torch.equal(trained, sampled)
    counted = (rollout["labels"] != IGNORE).sum().item()
    assert all(s["token_count"].item() == pytest.approx(counted / 4) for s in steps)
    logged = log.read(str(tmp_path / "run" / "log.csv"))
    assert [int(r["step"]) for r in logged] == [1, 2] and logged[0]["reward"] == logged[1]["reward"]


def text_length(completions, **_):
    return [float(len(c)) for c in completions]


def test_dapo_with_more_generation_steps_than_accumulated_logs_trls_loss(tmp_path, monkeypatch):
    """batch 4, grad_accum 1, steps_per_generation 2: TRL 1.16's _compute_loss divides a micro-batch's
    token sum by num_items_in_batch (the generation batch's completion tokens) x
    gradient_accumulation_steps / steps_per_generation, and logs the window's sum of those losses. The
    policy stays the sampling one (lr 1e-9: ratio 1, nothing clipped), so each token's loss is -A: TRL's
    loss of a step is -sum(A x completion tokens) of its micro-batch / (N x 1 / 2)."""
    work = stage_files.workspace(tmp_path)
    steps, rollouts = [], []
    step = Engine.step

    def recorded(engine, *args, **kwargs):
        steps.append({k: v.clone() for k, v in kwargs.items()})
        return step(engine, *args, **kwargs)

    def kept(*args, **kwargs):
        rollouts.append(rollout_batch(*args, **kwargs))
        return rollouts[-1]

    monkeypatch.setattr(Engine, "step", recorded)
    monkeypatch.setattr(grpo_stage, "rollout_batch", kept)
    # one prompt's 8 completions, rewarded by their length: each micro-batch's half of the group
    # has advantages that do not cancel
    settings = stage_files.grpo(work, str(tmp_path / "run"), batch=4, grad_accum=1, steps_per_generation=2,
                                num_generations=8, loss_type="dapo", max_completion_length=4, steps=2, lr=1e-9,
                                reward_funcs=["tests.posttrain.test_generation_batch:text_length"],
                                reward_weights=[1.0])
    run(load(files.run_yaml(str(tmp_path / "grpo.yaml"), **settings), []))
    rollout, = rollouts                            # one generation batch of 8 for both steps
    assert len(steps) == 2
    num_items_in_batch = (rollout["labels"] != IGNORE).sum().item()
    ga, spg = 1, 2
    trl = []
    for micro in steps:
        tokens = (micro["labels"] != IGNORE).sum(-1).double()
        assert tokens.sum() < num_items_in_batch      # a micro-batch is half the generation batch
        trl.append(-(micro["advantages"].double() * tokens).sum().item() / (num_items_in_batch * ga / spg))
    logged = [float(r["loss"]) for r in log.read(str(tmp_path / "run" / "log.csv"))]
    assert max(map(abs, trl)) > 1e-3
    assert logged == pytest.approx(trl, rel=1e-4, abs=1e-6)
