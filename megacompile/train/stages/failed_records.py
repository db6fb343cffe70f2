"""Which records a preference stage's failed step read (stages dpo, kto and rm), in the words stage
sft names its rows' (sft.py): the error of a run stopped by a non-finite loss or gradient under
on_nonfinite: raise names them (resume.failed_step)."""
from __future__ import annotations


def named(engine, wheres: list[list[str]], first: int, batch: int, items: str) -> tuple[str, list[str]]:
    """`wheres`: each micro-batch of the step, the places (data/reading.py: `file:line`, `file row
    N`) of the records it read; the micro-batches are `batch` items ("pairs", "examples") each,
    drawn from item `first` of the run on; engine.last_step says what failed. A loss is its
    micro-batch's where the micro-batch ran alone; a gradient, or the loss of a layer-major step
    (one program runs the step's micro-batches together, on its last call), is the step's."""
    record = engine.last_step
    # Under accumulation: micro each micro-batch runs alone; under layer or auto a layer-major
    # step's calls before its last only wait, so a failed last one may have run them all.
    alone = record.skipped == "loss" and (getattr(engine, "accumulation", "micro") == "micro"
                                          or record.micro_batch < len(wheres) - 1)
    micro = [record.micro_batch] if alone else list(range(len(wheres)))
    lo, hi = first + micro[0] * batch, first + (micro[-1] + 1) * batch - 1
    span = f"{items[:-1]} {lo}" if lo == hi else f"{items} {lo} to {hi}"
    what = "the micro-batch that failed" if len(micro) == 1 else "the step's micro-batches"
    return f"{what} ({span} of the run)", list(dict.fromkeys(w for m in micro for w in wheres[m]))
