"""The run's end figures, as transformers' Trainer and LlamaFactory leave them in output_dir for the
scripts that read them:

    train_results.json   epoch, total_flos, train_loss, train_runtime, train_samples_per_second,
                         train_steps_per_second (Trainer.save_metrics("train", ...))
    eval_results.json    the last step's evaluation (eval_loss, ...), where the last step evaluated
    all_results.json     both together
    trainer_state.json   global_step, max_steps, epoch, the intervals, best_metric and
                         best_model_checkpoint, and log_history: a record per logging step (the mean
                         loss since the one before, learning_rate, grad_norm), one per evaluation
                         and the train figures last (Trainer.save_state())

Every figure but the runtime's is the whole run's, read back from log.csv (a resumed run's too):
train_loss is the mean loss of the steps that updated, total_flos is transformers' estimate, 6 x
the model's parameters but its embeddings' x the tokens the steps read. train_runtime and the rates
are this process's, as the Trainer's are. With LlamaFactory's `plot_loss`, training_loss.png (and
training_eval_loss.png once an evaluation ran) draws the loss and its smoothed curve, as
LlamaFactory's plot_loss draws them (plot.py).
"""
from __future__ import annotations

import json
import math
import os

from . import log

STATE = "trainer_state.json"


def finish(c, run_dir: str, result: dict, stage, model, best: dict | None, best_path: str | None) -> str:
    """After the run's last step: the files above (and the plot_loss pictures); the line the run
    prints. `model`: the trained module (its parameters counted as transformers counts them)."""
    import torch.nn as nn
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    params = sum(p.numel() for p in model.parameters()) - embeddings
    steps_per_epoch = None if c.streaming else stage.steps_for(1.0)     # streamed: an epoch's length is unknown
    written = write(c, run_dir, result, steps_per_epoch, params, best, best_path)
    names = list(written)
    if c.plot_loss:
        from .loss_plot import draw
        names += draw(run_dir, written[STATE]["log_history"])
    return f"  results        {', '.join(names)} in {run_dir} (as transformers' Trainer writes them)"


def write(c, run_dir: str, result: dict, steps_per_epoch: int | None, params: int, best: dict | None,
          best_path: str | None) -> dict[str, dict]:
    """The files above in `run_dir` after the run's last step: name -> content. `result` is the
    run's (its steps, this process's seconds and steps_run), `params` the model's parameters less
    its embeddings'."""
    rows = [_parsed(r) for r in log.read(os.path.join(run_dir, "log.csv"))]
    trained = [r for r in rows if r["step"] > 0 and not r["skipped"] and _finite(r.get("loss"))]
    steps = result["steps"]
    epoch = round(steps / steps_per_epoch, 4) if steps_per_epoch else None
    seconds, ran = result["seconds"], result["steps_run"]
    per_step = c.global_batch or c.batch * c.grad_accum
    train = {"epoch": epoch,
             "total_flos": float(6 * params * sum(r.get("tokens") or 0 for r in rows if r["step"] > 0)),
             "train_loss": sum(r["loss"] for r in trained) / len(trained) if trained else None,
             "train_runtime": round(seconds, 4),
             "train_samples_per_second": round(ran * per_step / seconds, 3) if seconds > 0 else None,
             "train_steps_per_second": round(ran / seconds, 3) if seconds > 0 else None}
    train = {k: v for k, v in train.items() if v is not None}
    last = rows[-1] if rows and rows[-1]["step"] == steps else {}
    evaluated = {k: v for k, v in last.items() if k.startswith("eval_") and _finite(v)}
    written = {"train_results.json": train, "all_results.json": {**train, **evaluated}}
    if evaluated:
        written["eval_results.json"] = {**({"epoch": epoch} if epoch is not None else {}), **evaluated}
    written[STATE] = {
        "global_step": steps, "max_steps": c.steps, "epoch": epoch,
        "num_train_epochs": math.ceil(c.steps / steps_per_epoch) if steps_per_epoch else None,
        "logging_steps": c.log_every, "eval_steps": _interval(c.eval_every), "save_steps": _interval(c.save_every),
        "train_batch_size": c.batch, "total_flos": train["total_flos"],
        "best_metric": None if best is None else best["value"], "best_model_checkpoint": best_path,
        "log_history": history(rows, c.log_every, steps_per_epoch) + [{"epoch": epoch, "step": steps, **train}]}
    for name, content in written.items():
        _write_json(os.path.join(run_dir, name), content)
    return written


def history(rows: list[dict], every: int, steps_per_epoch: int | None) -> list[dict]:
    """log_history's records, as the Trainer logs them: every `every` steps (and at the last) the
    mean loss of the steps since the record before (rounded to 4 places), the step's learning rate
    and gradient norm; a record of its own for each evaluation."""
    out, losses = [], []
    last = rows[-1]["step"] if rows else 0

    def epoch(step: int) -> dict:
        return {"epoch": round(step / steps_per_epoch, 4)} if steps_per_epoch else {}

    for r in rows:
        step = r["step"]
        if step > 0 and not r["skipped"] and _finite(r.get("loss")):
            losses.append(r["loss"])
        if step > 0 and not r["skipped"] and (step % every == 0 or step == last):
            record = {**epoch(step), "grad_norm": r.get("grad_norm"), "learning_rate": r.get("lr"),
                      "loss": round(sum(losses) / len(losses), 4) if losses else None, "step": step}
            out.append({k: v for k, v in record.items() if v is not None})
            losses = []
        evaluated = {k: v for k, v in r.items() if k.startswith("eval_") and _finite(v)}
        if evaluated:
            out.append({**epoch(step), **evaluated, "step": step})
    return out


def _parsed(row: dict) -> dict:
    """A log.csv row read back: numbers as numbers, empty cells as None; `skipped` a bool."""
    out = {}
    for key, text in row.items():
        if key == "skipped":
            out[key] = text not in ("", "None", "False")
        elif text in ("", None):
            out[key] = None
        else:
            try:
                out[key] = int(text) if key in ("step", "tokens") else float(text)
            except ValueError:
                out[key] = text
    return out


def _finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def _interval(every) -> int | None:
    """An interval in steps, as trainer_state.json holds it (epoch-wise or none: null)."""
    return every if isinstance(every, int) and not isinstance(every, bool) else None


def _write_json(path: str, content: dict) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(content, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)
