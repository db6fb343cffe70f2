"""The held-out loss of stages sft and pt as transformers' Trainer evaluates it (so LlamaFactory's
and TRL's): the held-out rows in eval batches of `eval_batch` rows (per_device_eval_batch_size),
each batch's loss the mean over its target tokens, averaged with a weight of the batch's rows (the
Trainer repeats a batch's loss once a row); the last batch holds the rows that are left, and a
batch with no target is left out, as the Trainer filters that NaN. The perplexity is the loss's
exponential.

The engine runs micro-batches of `batch` rows, the shape it planned. Where an eval batch and a
micro-batch differ, each micro-batch is run once for each eval batch it overlaps, the rows of the
others masked out of the labels: the engine's mean over that part, times the part's target tokens,
is the part's sum, and an eval batch's parts add up to its mean. Forward passes only.
"""
from __future__ import annotations

import math

from ..data import packing


def evaluate(engine, rows: packing.Rows, batch: int, eval_batch: int, limit: int | None, shifted: bool,
             padding_mask: bool, accuracy: list | None = None, scaled=lambda inputs: inputs) -> tuple[float, float]:
    """(loss, perplexity) over `rows` (at most `limit` eval batches of them). `accuracy`: a list
    given gets each row's token accuracy (row_accuracies); `scaled`: the stage's inputs of the
    objective (its routers' term whole)."""
    total = rows.rows_per_epoch if limit is None else min(rows.rows_per_epoch, limit * eval_batch)
    sums, counts = {}, {}           # eval batch -> its target tokens' loss summed, and their count
    training = engine.model.training
    engine.model.eval()             # dropout (lora_dropout, a model's own) off, as in eager evaluation
    try:
        for start in range(0, total, batch):
            # A micro-batch keeps its shape past the held-out rows (no new plan); the rows past
            # them, the next epoch's first, count nothing.
            inputs = packing.batch(rows, start, batch, shifted=shifted, padding_mask=padding_mask)
            end = min(start + batch, total)
            for lo, hi in _parts(start, end, eval_batch):
                part = _only(inputs, lo - start, hi - start, batch)
                n = packing.target_count(part, shifted=shifted)
                if n == 0:
                    continue
                out = engine(**scaled(part))
                group = lo // eval_batch
                sums[group] = sums.get(group, 0.0) + float(out.loss if hasattr(out, "loss") else out) * n
                counts[group] = counts.get(group, 0) + n
                if accuracy is not None:
                    accuracy += row_accuracies(out.logits, part["labels"])
    finally:
        engine.model.train(training)
    weights = {g: min(eval_batch, total - g * eval_batch) for g in sums}
    mean = sum(weights[g] * sums[g] / counts[g] for g in sums) / sum(weights.values()) if sums else float("nan")
    return mean, math.exp(min(mean, 700.0))


def _parts(start: int, end: int, eval_batch: int) -> list[tuple[int, int]]:
    """Rows [start, end) cut where eval batches begin."""
    cuts = [start] + list(range((start // eval_batch + 1) * eval_batch, end, eval_batch)) + [end]
    return list(zip(cuts[:-1], cuts[1:]))


def _only(inputs: dict, lo: int, hi: int, batch: int) -> dict:
    """`inputs` with the labels of rows outside [lo, hi) ignored (the inputs themselves where none is)."""
    if lo == 0 and hi == batch:
        return inputs
    labels = inputs["labels"].clone()
    labels[:lo] = packing.IGNORE
    labels[hi:] = packing.IGNORE
    return {**inputs, "labels": labels}


def row_accuracies(logits, labels) -> list[float]:
    """LlamaFactory's compute_accuracy, per row: the share of its target tokens that are the
    logits' argmax at the position before them (rows without a target count none)."""
    predicted, target = logits[:, :-1].argmax(dim=-1), labels[:, 1:]
    counted = target != packing.IGNORE
    return [float((p[m] == t[m]).float().mean()) for p, t, m in zip(predicted, target, counted) if m.any()]
