"""Reward functions written for TRL's GRPOTrainer, as its users write them: keyword arguments,
completions as message lists for a conversational dataset, None for samples a function does not
score. Each call is recorded (what it was handed) for the tests to recompute the run's rewards."""
from __future__ import annotations

CALLS: list[dict] = []


def says_answer(completions, answer, **kwargs):
    """1.0 where the completion's first word is the record's answer, else 0; records its keywords."""
    CALLS.append({"completions": completions, "answer": answer, "keys": sorted(kwargs),
                  "trainer_state": kwargs["trainer_state"], "completion_ids": kwargs["completion_ids"],
                  "prompts": kwargs["prompts"]})
    return [1.0 if c[0]["content"].split()[:1] == [a] else 0.0 for c, a in zip(completions, answer)]


def long_only(completions, **kwargs):
    """Scores only the completions of three words or more (their length / 3); None for the others."""
    return [len(c[0]["content"].split()) / 3 if len(c[0]["content"].split()) >= 3 else None for c in completions]


async def never(completions, **kwargs):
    """Scores nothing (an async function, awaited as TRL awaits them)."""
    return [float("nan")] * len(completions)


def says_the(completions, **kwargs):
    """A toy reward a tiny policy learns: 1.0 where the completion's first word is "the"."""
    return [1.0 if c[0]["content"].split()[:1] == ["the"] else 0.0 for c in completions]


def with_metric(prompts, completions, log_metric, log_extra, **kwargs):
    """TRL 1.16's logging keywords: each completion's length in characters, their mean as a metric and
    each as a column of the completions log."""
    lengths = [float(len(c[0]["content"] if isinstance(c, list) else c)) for c in completions]
    log_metric("mean_chars", sum(lengths) / len(lengths))
    log_extra("chars", [str(x) for x in lengths])
    return lengths
