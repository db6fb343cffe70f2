"""Which records a post-training stage's failed step read (stages dpo, kto, rm and grpo), in the
words stage sft names its rows' (sft.py): the error of a run stopped by a non-finite loss or
gradient under on_nonfinite: raise names them (resume.failed_step)."""
from __future__ import annotations


def named(engine, wheres: list[list[str]], first: int, batch: int, items: str) -> tuple[str, list[str]]:
    """`wheres`: each micro-batch of the step, the places (data/reading.py: `file:line`, `file row
    N`) of the records it read; the micro-batches are `batch` items ("pairs", "examples") each,
    drawn from item `first` of the run on; engine.last_step says what failed. A loss is its
    micro-batch's where the micro-batch ran alone; a gradient, or the loss of a layer-major step
    (one program runs the step's micro-batches together, on its last call), is the step's."""
    micro = _failed(engine, len(wheres))
    lo, hi = first + micro[0] * batch, first + (micro[-1] + 1) * batch - 1
    span = f"{items[:-1]} {lo}" if lo == hi else f"{items} {lo} to {hi}"
    what = "the micro-batch that failed" if len(micro) == 1 else "the step's micro-batches"
    return f"{what} ({span} of the run)", list(dict.fromkeys(w for m in micro for w in wheres[m]))


def prompts_named(engine, drawn: list[list[tuple[int, str]]]) -> tuple[str, list[str]]:
    """Stage grpo's, in named()'s words: `drawn`, each micro-batch of the step, for each of its rows
    the prompt it completes: (the prompt's place among those the run drew, its record's place). A
    rollout batch's rows, shuffled or not, each keep their prompt, so the prompts named are exactly
    those of the failed micro-batch's rows (of the step's, where named() says the step failed)."""
    micro = _failed(engine, len(drawn))
    prompts = dict(sorted({p for m in micro for p in drawn[m]}))
    what = "the micro-batch that failed" if len(micro) == 1 else "the step's micro-batches"
    # a rollout batch across an epoch's end may draw a record twice
    return f"{what} (completions of {_spans(list(prompts))} of the run)", list(dict.fromkeys(prompts.values()))


def _failed(engine, count: int) -> list[int]:
    """Which of a step's `count` micro-batches failed: its own where a loss's micro-batch ran alone,
    else all of them."""
    record = engine.last_step
    # Under accumulation: micro each micro-batch runs alone; under layer or auto a layer-major
    # step's calls before its last only wait, so a failed last one may have run them all.
    alone = record.skipped == "loss" and (getattr(engine, "accumulation", "micro") == "micro"
                                          or record.micro_batch < count - 1)
    return [record.micro_batch] if alone else list(range(count))


def _spans(numbers: list[int]) -> str:
    """Sorted prompt numbers in runs: `prompt 4`, `prompts 4 to 7`, `prompts 2, 5 to 6 and 9`."""
    runs: list[list[int]] = []
    for k in numbers:
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    said = [str(r[0]) if len(r) == 1 else f"{r[0]} to {r[-1]}" for r in runs]
    if len(numbers) == 1:
        return f"prompt {said[0]}"
    return "prompts " + (said[0] if len(said) == 1 else f"{', '.join(said[:-1])} and {said[-1]}")
