"""GRPO through megacompile with rollouts from the engine itself: a tiny model learns to answer a
prompt with a given token; mean reward from chance to >= 0.9 in a fixed number of steps, seeded."""
import random

import pytest
import torch

from megacompile import AdamW, compile
from megacompile.errors import ArgumentError
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.posttrain import GRPOLoss, GRPOObjective
from megacompile.posttrain.rewards import exact_answer, format_check, load, score
from megacompile.posttrain.rollout import Completion, EngineGenerator
from megacompile.posttrain.rollout_batch import rollout_batch

V, TARGET, N, NEW = 16, 7, 8, 2


def _answers_target(prompts, completions, **_):
    return [float(c[0] == TARGET) for c in completions]


def _engine(seed=0):
    torch.manual_seed(seed)
    policy = TinyLlama(LlamaConfig(vocab=V, dim=32, layers=2, heads=4, kv_heads=2, ffn=64))
    return compile(GRPOObjective(policy, GRPOLoss(loss_type="dapo")), hbm_budget=0.01, device="cpu",
                   compute_dtype=torch.float32, optimizer=AdamW(lr=3e-3, weight_decay=0.0))


def _iteration(engine, generator, rng):
    prompts = [[rng.randrange(1, V) for _ in range(3)] for _ in range(4)]
    completions = generator.generate(prompts, N, NEW, temperature=1.0)
    rewards, _ = score([_answers_target], None, prompts, [c.tokens for c in completions])
    batch = rollout_batch(completions, rewards, N, width=3 + NEW)
    old = torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"]))
    engine.step(**batch, old_logps=old)
    return rewards.mean().item()


def test_rollout_batch_labels_the_completion_and_groups_the_advantages():
    completions = [Completion(0, (3, 4), (5, 6)), Completion(0, (3, 4), (9,)), Completion(1, (2,), (8, 8, 8))]
    batch = rollout_batch(completions + [Completion(1, (2,), (1,))], torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, width=4)
    assert batch["input_ids"].tolist() == [[3, 4, 5, 6], [3, 4, 9, 0], [2, 8, 8, 8], [2, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6, -100], [-100, 9, -100, -100], [8, 8, 8, -100],
                                        [1, -100, -100, -100]]
    adv = batch["advantages"].tolist()
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0.0


def test_rewards_are_summed_with_weights_and_named():
    total, each = score([exact_answer, format_check], [1.0, 0.5], ["q", "q"], ["<answer>4</answer>", "4"],
                        answer=["<answer>4</answer>", "4"])
    assert total.tolist() == [1.5, 1.0] and set(each) == {"exact_answer", "format_check"}
    assert load("exact_answer") is exact_answer and load("tests.posttrain.test_grpo_learns:_answers_target")
    with pytest.raises(ArgumentError, match="module:function"):
        load("nonsense")
    with pytest.raises(ArgumentError, match="2 weights for 1"):
        score([exact_answer], [1.0, 2.0], ["q"], ["a"], answer=["a"])


@pytest.mark.slow
def test_grpo_raises_mean_reward_from_chance_to_0_9():
    engine = _engine()
    generator = EngineGenerator(engine, seed=0)
    rng = random.Random(0)
    rewards = [_iteration(engine, generator, rng) for _ in range(40)]
    engine.close()
    assert sum(rewards[:3]) / 3 < 0.3, rewards                 # chance is 1/16
    assert sum(rewards[-3:]) / 3 >= 0.9, rewards


@pytest.mark.slow
def test_generation_is_reproducible_from_its_state():
    engine = _engine()
    generator = EngineGenerator(engine, seed=3)
    state = generator.state()
    first = generator.generate([[1, 2, 3]], 4, 3)
    generator.set_state(state)
    assert generator.generate([[1, 2, 3]], 4, 3) == first
    greedy = generator.generate([[1, 2, 3]], 2, 3, temperature=0)
    assert greedy[0].tokens == greedy[1].tokens
    engine.close()
