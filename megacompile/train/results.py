"""The run's figures, as transformers' Trainer and LlamaFactory leave them in output_dir for the
scripts that read them:

    train_results.json   epoch, total_flos, train_loss, train_runtime, train_samples_per_second,
                         train_steps_per_second (Trainer.save_metrics("train", ...))
    eval_results.json    the evaluation of the model the run leaves (eval_loss, ...): the last
                         step's, where it evaluated; under load_best_model_at_end the best
                         checkpoint's step's (its weights are the model written)
    all_results.json     both together
    trainer_state.json   TrainerState's fields: global_step, max_steps, epoch, num_train_epochs,
                         the intervals, train_batch_size, total_flos, best_metric, best_global_step
                         and best_model_checkpoint, the process flags, and log_history: a record per
                         logging step (the mean loss since the one before, learning_rate,
                         grad_norm), one per evaluation and the train figures last
                         (Trainer.save_state())

Each checkpoint (RUN/checkpoints/step-NNNNNN) carries a trainer_state.json of its own, of the run
up to its step, as the Trainer's checkpoint-N does: written in the folder before it is committed
(checkpoint_files), never read back by a resume. Its log_history is the run folder's, cut at the
step, without the train figures.

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

from ..io import durable
from . import log
from .stages import epochs
from .trainer_log import epoch_of

STATE = "trainer_state.json"


def finish(c, run_dir: str, result: dict, stage, model, best: dict | None, best_path: str | None) -> str:
    """After the run's last step: the files above (and the plot_loss pictures); the line the run
    prints. `model`: the trained module (its parameters counted as transformers counts them)."""
    written = write(c, run_dir, result, epoch_steps(c, stage), counted_parameters(model), best, best_path)
    names = list(written)
    if c.plot_loss:
        from .loss_plot import draw
        names += draw(run_dir, written[STATE]["log_history"])
    return f"  results        {', '.join(names)} in {run_dir} (as transformers' Trainer writes them)"


def epoch_steps(c, stage) -> float | None:
    """The steps of an epoch, a fraction where an epoch is not whole steps (stages/epochs.py: the
    logged epoch counts the items read); None when streamed (an epoch's length is unknown)."""
    if c.streaming:
        return None
    items = stage.epoch_items()
    return stage.steps_for(1.0) if items is None else items[0] / epochs.per_step(c)


def counted_parameters(model) -> int:
    """The parameters transformers' floating-point estimate counts: all but the embeddings'."""
    import torch.nn as nn
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return sum(p.numel() for p in model.parameters()) - embeddings


def write(c, run_dir: str, result: dict, steps_per_epoch: int | None, params: int, best: dict | None,
          best_path: str | None) -> dict[str, dict]:
    """The files above in `run_dir` after the run's last step: name -> content. `result` is the
    run's (its steps, this process's seconds and steps_run), `params` the model's parameters less
    its embeddings'."""
    rows = _rows(run_dir)
    trained = [r for r in rows if r["step"] > 0 and not r["skipped"] and _finite(r.get("loss"))]
    steps = result["steps"]
    state = trainer_state(c, rows, steps, steps_per_epoch, params, best, best_path,
                          last=rows[-1]["step"] if rows else 0)
    seconds, ran = result["seconds"], result["steps_run"]
    per_step = c.global_batch or c.batch * c.grad_accum
    train = {"epoch": state["epoch"], "total_flos": state["total_flos"],
             "train_loss": sum(r["loss"] for r in trained) / len(trained) if trained else None,
             "train_runtime": round(seconds, 4),
             "train_samples_per_second": round(ran * per_step / seconds, 3) if seconds > 0 else None,
             "train_steps_per_second": round(ran / seconds, 3) if seconds > 0 else None}
    train = {k: v for k, v in train.items() if v is not None}
    evaluated = final_evaluation(c, run_dir, rows, steps, best)
    written = {"train_results.json": train, "all_results.json": {**train, **evaluated}}
    if evaluated:
        written["eval_results.json"] = {**epoch_of(steps, steps_per_epoch), **evaluated}
    state["log_history"].append({"epoch": state["epoch"], "step": steps, **train})
    written[STATE] = state
    for name, content in written.items():
        durable.replace_text(os.path.join(run_dir, name), as_json(content))
    return written


def final_evaluation(c, run_dir: str, rows: list[dict], steps: int, best: dict | None) -> dict:
    """The evaluation of the model the run leaves, as LlamaFactory's Trainer.evaluate() after
    train() measures it: under load_best_model_at_end, where that model is the best checkpoint's
    (written to the model's folder), the evaluation of the best step, made on those very weights;
    else the last step's, where it evaluated. {} where none did."""
    from .trained_model import folder
    at = steps
    if c.load_best_model_at_end and best is not None and folder(c, run_dir) is not None:
        at = best["step"]
    row = next((r for r in reversed(rows) if r["step"] == at and not r["skipped"]), {})
    return {k: v for k, v in row.items() if k.startswith("eval_") and _finite(v)}


def checkpoint_files(c, run_dir: str, step: int, steps_per_epoch: int | None, params: int, best: dict | None,
                     best_path: str | None, final: bool) -> dict[str, str]:
    """The files a checkpoint at `step` carries beside its tensors: {trainer_state.json: its text},
    the run up to `step` as log.csv holds it (the rows the checkpoint's step logged included);
    `final`: no step follows it (the last, or the one early stopping ends at), whose record
    log_history has whether or not it is a logging step."""
    rows = [r for r in _rows(run_dir) if r["step"] <= step]
    state = trainer_state(c, rows, step, steps_per_epoch, params, best, best_path, last=step if final else None)
    return {STATE: as_json(state)}


def trainer_state(c, rows: list[dict], steps: int, steps_per_epoch: int | None, params: int, best: dict | None,
                  best_path: str | None, last: int | None) -> dict:
    """TrainerState's fields after `steps`, from log.csv's `rows` up to it (`last`: history's).
    num_input_tokens_seen: the input tokens the steps read (log.csv's `tokens`), as the Trainer
    counts them with include_num_input_tokens_seen; one process writes, so both process flags hold."""
    tokens = sum(r.get("tokens") or 0 for r in rows if r["step"] > 0)
    return {
        "epoch": epoch_of(steps, steps_per_epoch).get("epoch"), "global_step": steps, "max_steps": c.steps,
        "num_train_epochs": math.ceil(c.epochs) if c.epochs is not None else
        math.ceil(c.steps / math.ceil(steps_per_epoch)) if steps_per_epoch else None,
        "logging_steps": c.log_every, "eval_steps": _interval(c.eval_every), "save_steps": _interval(c.save_every),
        "train_batch_size": c.batch, "num_input_tokens_seen": tokens, "total_flos": float(6 * params * tokens),
        "log_history": history(rows, c.log_every, steps_per_epoch, last),
        "best_metric": (best or {}).get("value"), "best_global_step": (best or {}).get("step"),
        "best_model_checkpoint": best_path,
        "is_local_process_zero": True, "is_world_process_zero": True, "is_hyper_param_search": False,
        "trial_name": None, "trial_params": None, "stateful_callbacks": {}}


def history(rows: list[dict], every: int, steps_per_epoch: int | None, last: int | None) -> list[dict]:
    """log_history's records, as the Trainer logs them: every `every` steps (and at `last`, the
    run's last step) the mean loss of the steps since the record before (rounded to 4 places), the
    step's learning rate and gradient norm; a record of its own for each evaluation. A skipped
    step's row (log.csv's `skipped`) makes none and adds no loss."""
    out, losses = [], []
    for r in rows:
        step = r["step"]
        if step > 0 and not r["skipped"] and _finite(r.get("loss")):
            losses.append(r["loss"])
        if step > 0 and not r["skipped"] and (step % every == 0 or step == last):
            record = {**epoch_of(step, steps_per_epoch), "grad_norm": r.get("grad_norm"), "learning_rate": r.get("lr"),
                      "loss": round(sum(losses) / len(losses), 4) if losses else None, "step": step}
            out.append({k: v for k, v in record.items() if v is not None})
            losses = []
        evaluated = {k: v for k, v in r.items() if k.startswith("eval_") and _finite(v)}
        if evaluated:
            out.append({**epoch_of(step, steps_per_epoch), **evaluated, "step": step})
    return out


def as_json(content: dict) -> str:
    """As transformers' TrainerState.save_to_json writes it (and save_metrics, sorted too)."""
    return json.dumps(content, indent=2, sort_keys=True) + "\n"


def _rows(run_dir: str) -> list[dict]:
    return [_parsed(r) for r in log.read(os.path.join(run_dir, "log.csv"))]


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
