"""`megacompile train`: a run from its settings to an exported model.

    settings -> token files (once) -> engine (plan summary and dump) -> resume? -> steps
             -> per step: CSV row, progress; eval every eval_every; checkpoint every save_every
             -> final checkpoint, export

A checkpoint carries the data position (rows consumed) beside the engine's own state, so a
resumed run feeds exactly the micro-batches the uninterrupted run would have, and writes the
same log rows from its checkpoint on.
"""
from __future__ import annotations

import math
import os
import time

import numpy as np
import torch

from ..view.files import write_run_views
from ..errors import ArgumentError
from ..ir.printer import fmt_bytes
from . import packing
from .config import RunConfig
from .log import Progress, RunLog
from .model import build, check_isolation, meta_model
from .tokens import load_tokenizer, token_file

CHECKPOINTS = "checkpoints"


def _run_dir(c: RunConfig) -> str:
    return c.run_dir or os.path.join("runs", time.strftime(f"{c.name}-%Y%m%d-%H%M%S"))


def _data(c: RunConfig, run_dir: str, row_len: int):
    """Training rows and eval rows (None without held-out data), from the token files."""
    tokenizer_dir = None if c.bundled else (c.tokenizer or c.model)
    tokenizer = load_tokenizer(tokenizer_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    folder = os.path.join(run_dir, "tokens")
    train = token_file(folder, "train", c.data, tokenizer, tokenizer_dir, c.train_on_prompt)
    docs, eval_rows = np.arange(train.n_docs), None
    if c.eval:
        held = token_file(folder, "eval", c.eval, tokenizer, tokenizer_dir, c.train_on_prompt)
        eval_rows = packing.Rows(held, row_len, c.packing, c.seed, shuffle=False, pad_id=pad)
    elif c.eval_fraction:
        if train.n_docs < 2:
            raise ArgumentError(f"eval_fraction holds out whole documents, and the data has {train.n_docs}; "
                                "give an eval file instead")
        n_eval = min(train.n_docs - 1, max(1, round(c.eval_fraction * train.n_docs)))
        picked = np.random.default_rng([c.seed, 1 << 20]).permutation(train.n_docs)
        docs = np.sort(picked[n_eval:])
        eval_rows = packing.Rows(train, row_len, c.packing, c.seed, docs=np.sort(picked[:n_eval]), shuffle=False,
                                 pad_id=pad)
    rows = packing.Rows(train, row_len, c.packing, c.seed, docs=docs, pad_id=pad)
    return tokenizer, train.fingerprint, rows, eval_rows


def _latest_checkpoint(c: RunConfig, run_dir: str) -> str | None:
    from ..io.checkpoint import committed_beside
    folder = os.path.join(run_dir, CHECKPOINTS)
    found = committed_beside(os.path.join(folder, "latest")) if os.path.isdir(folder) else []
    if c.resume is None:
        if found:
            raise ArgumentError(f"run_dir {run_dir} already holds checkpoints ({os.path.basename(found[-1])}); "
                                "resume: auto goes on from the latest, or give another run_dir")
        return None
    if c.resume == "auto":
        return found[-1] if found else None
    return c.resume


def _check_export(c: RunConfig, resume_from: str | None) -> None:
    """Before training: a new run does not replace an export it did not write. A resumed run owns
    the export folder's model files (its first run found none there, or was refused here), and
    replaces them at its end (overwrite=True); whatever else the folder holds is kept either way."""
    from ..io.hf_save import export_files
    if c.export is None or resume_from is not None:
        return
    found = export_files(c.export)
    if found:
        raise ArgumentError(f"export {c.export} already holds a model export ({', '.join(found[:6])}"
                            f"{', ...' if len(found) > 6 else ''}), which this new run would replace: give another "
                            "export folder, or remove those files (a run resumed from its checkpoints replaces "
                            "its own export)")


def _evaluate(engine, rows: packing.Rows, batch: int, limit: int | None, shifted: bool) -> tuple[float, float]:
    """Mean loss per target token over the held-out rows, and its perplexity (forward only)."""
    n_batches = -(-rows.rows_per_epoch // batch)
    if limit is not None:
        n_batches = min(n_batches, limit)
    total, count = 0.0, 0
    for i in range(n_batches):
        inputs = packing.batch(rows, i * batch, batch, shifted=shifted)
        n = packing.target_count(inputs, shifted=shifted)
        if n == 0:
            continue
        out = engine(**inputs)
        loss = out.loss if hasattr(out, "loss") else out
        total += float(loss) * n
        count += n
    mean = total / count if count else float("nan")
    return mean, math.exp(min(mean, 700.0))


def _rows_layout(c: RunConfig) -> dict:
    """What decides which rows a data position counts (packing.py cuts rows from seed and row index)."""
    return {"seq": c.seq, "packing": c.packing, "seed": c.seed}


def run(c: RunConfig, trace: str | None = None) -> dict:
    """Train as `c` says; returns the figures the final line prints. After the last step the run dir
    gets that step's Chrome trace (step.json, or `trace`) and memory.png (docs/plan-format.md)."""
    run_dir = _run_dir(c)
    resume_from = _latest_checkpoint(c, run_dir) if os.path.isdir(run_dir) else None
    if c.resume not in (None, "auto"):
        resume_from = c.resume
    _check_export(c, resume_from)
    meta = meta_model(c)
    if c.packing == "isolated":
        check_isolation(meta)     # before the data is read: the model decides whether it can be done
    os.makedirs(run_dir, exist_ok=True)
    shifted = c.bundled
    tokenizer, fingerprint, rows, eval_rows = _data(c, run_dir, c.seq + shifted)
    per_step = c.global_batch or c.batch * c.grad_accum
    if c.steps is None:
        c.steps = max(1, math.ceil(c.epochs * rows.rows_per_epoch / per_step))
    setup = build(c, meta, lambda b: packing.batch(rows, 0, b, shifted=shifted))
    try:
        result = _train(c, setup, run_dir, resume_from, tokenizer, fingerprint, rows, eval_rows)
        if result["first_loss"] is not None:      # a step ran here: its record is the one to show
            write_run_views(setup.engine, run_dir, trace)
        return result
    finally:
        setup.engine.close()


def _train(c: RunConfig, setup, run_dir: str, resume_from: str | None, tokenizer, fingerprint: str,
           rows: packing.Rows, eval_rows: packing.Rows | None) -> dict:
    engine, shifted = setup.engine, setup.shifted
    first = packing.batch(rows, 0, setup.batch, shifted=shifted)
    plan = engine.prepare(**first)
    print(plan.summary(), flush=True)
    print(f"  weights        {fmt_bytes(setup.weight_bytes)} in {c.compute_dtype}; budget is "
          f"{100 * plan.budget_bytes / setup.weight_bytes:.0f}% of them", flush=True)
    print(f"  batch          {setup.batch} x {setup.grad_accum} accumulated x {c.seq} tokens per optimizer step; "
          f"{c.steps} steps, {rows.rows_per_epoch} rows an epoch", flush=True)
    plan.dump(os.path.join(run_dir, "plan"))
    print(f"  plan dump      {os.path.join(run_dir, 'plan')}/plan.txt, plan.json", flush=True)

    consumed = 0
    if resume_from is not None:
        extra = engine.load_checkpoint(resume_from) or {}
        if extra.get("data") != fingerprint:
            raise ArgumentError(f"{resume_from} was saved by a run on other tokens (token file {extra.get('data')}, "
                                f"now {fingerprint}: the data, the tokenizer or train_on_prompt changed); resume it "
                                "with the same data, or start a new run_dir")
        layout = _rows_layout(c)
        saved = extra.get("rows_layout", layout)
        changed = [f"{k} {saved.get(k)!r} -> {v!r}" for k, v in layout.items() if saved.get(k) != v]
        if changed:     # the rows a position counts would be other rows: the resumed run would see other data
            raise ArgumentError(f"{resume_from} was saved by a run that cut its rows otherwise ({', '.join(changed)}); "
                                "resume it with the same seq, packing and seed, or start a new run_dir")
        consumed = int(extra["rows"])
        print(f"  resumed        from {resume_from} at step {engine.steps_done}", flush=True)
    start_step = engine.steps_done
    log = RunLog(run_dir, c.log, start_step)
    progress = Progress(c.steps, start_step, c.log_every)
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    saved_at, losses_seen, started = None, [], time.perf_counter()
    try:
        while engine.steps_done < c.steps:
            t0, losses, tokens, done = time.perf_counter(), [], 0, engine.steps_done
            while engine.steps_done == done:     # the micro-batches of one optimizer step
                inputs = packing.batch(rows, consumed, setup.batch, shifted=shifted)
                consumed += setup.batch
                if packing.target_count(inputs, shifted=shifted) == 0:
                    continue      # all prompt or padding: its loss would be 0/0; the next rows instead
                losses.append(engine.step(**inputs))
                record = engine.last_step
                tokens += record.tokens
                if record.skipped:
                    break
            seconds = time.perf_counter() - t0
            if None in losses:      # a layer-major step: its losses exist once its last micro-batch ran
                losses = list(engine.accumulated_losses) if record.updated else [x for x in losses if x is not None]
            if done == start_step:
                plan.dump(os.path.join(run_dir, "plan"))      # now with the measured peak beside the prediction
            step = record.step
            row = {"step": step, "loss": sum(losses) / len(losses), "lr": record.lr, "grad_norm": record.grad_norm,
                   "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                   "device_peak_bytes": record.device_peak_bytes,
                   "predicted_device_peak_bytes": record.predicted_device_peak_bytes, "skipped": record.skipped}
            if record.skipped:
                log.write(row)
                continue
            losses_seen.append(row["loss"])
            if eval_rows is not None and c.eval_every and (step % c.eval_every == 0 or step == c.steps):
                row["eval_loss"], row["eval_perplexity"] = _evaluate(engine, eval_rows, setup.batch, c.eval_batches,
                                                                     shifted)
            log.write(row)
            progress.update(step, f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | device peak "
                            f"{fmt_bytes(row['device_peak_bytes'])} / {fmt_bytes(plan.budget_bytes)}"
                            + (f" | eval loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""),
                            {"loss": f"{row['loss']:.4f}", "tok/s": f"{row['tokens_per_s']:,.0f}",
                             "peak": fmt_bytes(row["device_peak_bytes"])})
            if (c.save_every and step % c.save_every == 0) or step == c.steps:
                engine.save_checkpoint(os.path.join(checkpoints, f"step-{step:06d}"),
                                       extra={"rows": consumed, "data": fingerprint, "rows_layout": _rows_layout(c)}, keep_last=c.keep_last)
                saved_at = step
    finally:
        progress.close()
        log.close()
    elapsed = time.perf_counter() - started
    if c.export is not None:
        # overwrite: only a resumed run gets here with model files in the folder, its own (_check_export)
        engine.save_pretrained(c.export, dtype=getattr(torch, c.export_dtype), overwrite=resume_from is not None)
        if not os.path.isfile(os.path.join(c.export, "tokenizer_config.json")):
            tokenizer.save_pretrained(c.export)
        print(f"  exported       {c.export}", flush=True)
    result = {"steps": engine.steps_done, "skipped_steps": engine.skipped_steps, "run_dir": run_dir,
              "first_loss": losses_seen[0] if losses_seen else None,
              "final_loss": losses_seen[-1] if losses_seen else None,
              "seconds": elapsed, "last_checkpoint": saved_at, "budget_bytes": plan.budget_bytes,
              "predicted_device_peak_bytes": plan.predicted_peak_bytes,
              "measured_device_peak_bytes": plan.measured_peak_bytes}
    if losses_seen:
        print(f"done: loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {elapsed:.1f} s, measured "
              f"device peak {fmt_bytes(plan.measured_peak_bytes or 0)} (predicted "
              f"{fmt_bytes(plan.predicted_peak_bytes)}); log in {os.path.join(run_dir, 'log.csv')}", flush=True)
    return result
