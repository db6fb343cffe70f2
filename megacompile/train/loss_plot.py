"""LlamaFactory's `plot_loss: true`: training_loss.png (and training_eval_loss.png once an
evaluation ran) in the run folder after the last step, drawn from trainer_state.json's log_history
(results.py): each record's value, faint, and beside it the curve smoothed as LlamaFactory smooths
it, an exponential moving average whose weight grows with the number of points (a short curve is
left nearly as it is, a long one smoothed hard).

It needs matplotlib (`pip install 'megacompile[plot]'`), which the run checks before it starts."""
from __future__ import annotations

import math
import os

KEYS = ("loss", "eval_loss")


def smoothed(values: list[float]) -> list[float]:
    if not values:
        return []
    weight = 1.8 * (1 / (1 + math.exp(-0.05 * len(values))) - 0.5)
    out, last = [], values[0]
    for value in values:
        last = last * weight + (1 - weight) * value
        out.append(last)
    return out


def draw(run_dir: str, log_history: list[dict]) -> list[str]:
    """The pictures of KEYS that log_history holds, written into run_dir; their names."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for key in KEYS:
        points = [(r["step"], r[key]) for r in log_history if key in r and "train_loss" not in r]
        if not points:
            continue
        steps, values = zip(*points)
        figure = plt.figure()
        plt.plot(steps, values, color="#1f77b4", alpha=0.4, label="original")
        plt.plot(steps, smoothed(list(values)), color="#1f77b4", label="smoothed")
        plt.title(f"training {key} of {run_dir}")
        plt.xlabel("step")
        plt.ylabel(key)
        plt.legend()
        name = f"training_{key}.png"
        plt.savefig(os.path.join(run_dir, name), format="png", dpi=100)
        plt.close(figure)
        written.append(name)
    return written
