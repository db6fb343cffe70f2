"""Reward functions called as TRL calls them: keywords only (prompts, completions, completion_ids,
trainer_state, the data's other columns, TRL 1.16's log_extra and log_metric), None or NaN left out
of the weighted sum, a completion no function scored NaN, async functions awaited."""
import math

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain.reward_logs import RewardLogs
from megacompile.posttrain.rewards import TrainerState, check_callable, exact_answer, format_check, score


def test_a_function_written_for_trl_is_called_with_keywords():
    seen = {}

    def trl_style(completions, **kwargs):            # TRL's documented signature
        seen.update(kwargs, completions=completions)
        return [float(len(c)) for c in completions]

    state = TrainerState(global_step=3, epoch=0.5, max_steps=10)
    total, each = score([trl_style], None, ["p", "q"], ["ab", "c"], completion_ids=[(1, 2), (3,)],
                        trainer_state=state, answer=["x", "y"])
    assert total.tolist() == [2.0, 1.0] and each["trl_style"].tolist() == [2.0, 1.0]
    assert seen["prompts"] == ["p", "q"] and seen["completions"] == ["ab", "c"] and seen["answer"] == ["x", "y"]
    assert seen["completion_ids"] == [[1, 2], [3]] and seen["trainer_state"] is state
    assert (state.global_step, state.epoch, state.max_steps) == (3, 0.5, 10)


def test_none_and_nan_are_left_out_of_the_weighted_sum():
    def first(completions, **_):
        return [1.0, None, None, 2.0]

    def second(completions, **_):
        return [float("nan"), 3.0, None, 4.0]

    total, each = score([first, second], [1.0, 0.5], ["p"] * 4, ["a"] * 4)
    assert total.tolist()[:2] == [1.0, 1.5] and total[3].item() == 4.0
    assert math.isnan(total[2].item())                  # scored by none: NaN, no advantage
    assert torch.isnan(each["first"]).tolist() == [False, True, True, False]


def test_async_functions_are_awaited_together():
    async def later(completions, **_):
        return [0.25] * len(completions)

    total, each = score([later, exact_answer], None, ["p"], ["a"], answer=["a"])
    assert total.tolist() == [1.25] and each["later"].tolist() == [0.25]


def test_a_function_that_cannot_take_the_keywords_is_refused_by_name():
    def positional(p, c):
        return [0.0] * len(c)

    with pytest.raises(ArgumentError, match="reward function positional is called as TRL calls reward functions"):
        score([positional], None, ["p"], ["a"])


def test_built_ins_read_conversational_completions():
    messages = [[{"role": "assistant", "content": " 4 "}], [{"role": "assistant", "content": "<answer>4</answer>"}]]
    assert exact_answer(prompts=None, completions=messages, answer=["4", "4"]) == [1.0, 0.0]
    assert format_check(prompts=None, completions=messages) == [0.0, 1.0]


def test_trl_116_log_metric_and_log_extra_are_handed_and_what_they_log_is_kept():
    def logging(prompts, completions, log_metric, log_extra, **kwargs):      # as TRL 1.16's docs write one
        lengths = [float(len(c)) for c in completions]
        log_metric("length", sum(lengths) / len(lengths))
        log_metric("length", 0.0)                   # twice in a scoring: averaged, as TRL averages them
        log_extra("length_text", [str(x) for x in lengths])
        return lengths

    check_callable([logging], ["answer"])          # its required keywords are handed: not refused
    logs = RewardLogs()
    total, _ = score([logging], None, ["p", "q"], ["ab", "c"], reward_logs=logs, answer=["x", "y"])
    assert total.tolist() == [2.0, 1.0]
    assert logs.metrics() == {"length": 0.75} and logs.metrics("eval_") == {"eval_length": 0.75}
    assert logs.extra(2) == {"length_text": ["2.0", "1.0"]}
    with pytest.raises(ArgumentError, match=r"log_extra\('length_text', values\) was given 2 values for 3 completions"):
        logs.extra(3)
    with pytest.raises(ArgumentError, match="logged 'length' .*a figure the stage logs itself as length"):
        logs.metrics(own=("step", "length"))
    with pytest.raises(ArgumentError, match=r"log_metric\('bad', value\) takes one number"):
        logs.log_metric("bad", "high")
