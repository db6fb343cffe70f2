"""Plot benchmarks/results/budget_sweep.csv: step time and device peak against the budget.

    pip install matplotlib && python benchmarks/plot_budget_sweep.py [CSV] [PNG]
"""
from __future__ import annotations

import csv
import os
import sys
from collections import defaultdict


def main() -> None:
    here = os.path.dirname(__file__)
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "results", "budget_sweep.csv")
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "results", "budget_sweep.png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plotting needs matplotlib: pip install matplotlib")
    series = defaultdict(lambda: defaultdict(list))     # model -> metric -> [(MiB, value)]
    with open(path) as f:
        for row in csv.DictReader(f):
            series[row.get("model", "nanogpt")][row["metric"]].append((int(row["budget_bytes"]) / 2**20,
                                                                      float(row["value"])))
    fig, axes = plt.subplots(len(series), 2, figsize=(11, 4 * len(series)), squeeze=False)
    for (model, metrics), (left, right) in zip(series.items(), axes):
        for metric, style in (("predicted_step_s", "--o"), ("measured_step_s", "-o")):
            xs, ys = zip(*sorted(metrics[metric]))
            left.plot(xs, [y * 1e3 for y in ys], style, label=metric.replace("_", " "))
        left.set(xlabel="budget (MiB)", ylabel="step time (ms)", title=f"{model}: step time")
        for metric, style in (("predicted_peak_bytes", "--o"), ("measured_peak_bytes", "-o")):
            xs, ys = zip(*sorted(metrics[metric]))
            right.plot(xs, [y / 2**20 for y in ys], style, label=metric.replace("_", " "))
        xs = sorted(x for x, _ in metrics["predicted_peak_bytes"])
        right.plot(xs, xs, ":", color="gray", label="budget")
        right.set(xlabel="budget (MiB)", ylabel="device peak (MiB)", title=f"{model}: device peak")
        for ax in (left, right):
            ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
