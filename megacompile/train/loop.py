"""`megacompile train`: a run from its settings to an exported model.

    settings -> checks (seq against the model; a resume against its checkpoint: resume.py)
             -> token files (once; staged) -> checks (seq against the data; the resume's tokens)
             -> token files put in place -> complete already? -> engine -> resume? -> plan
             summary and dump -> steps
             -> per step: CSV row, progress; eval every eval_every; checkpoint every save_every
             -> final checkpoint, the trained model in its folder (trained_model.py)

Nothing of the run folder is written before every check has passed: a refused run leaves it as
it was (a new one leaves none).

A checkpoint carries the data position (rows consumed) beside the engine's own state, so a
resumed run feeds exactly the micro-batches the uninterrupted run would have, and writes the
same log rows from its checkpoint on.
"""
from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
import warnings

import numpy as np

from ..report.outputs import write_run_views
from ..errors import ArgumentError
from ..ir.printer import fmt_bytes
from . import finetune, grid_images, images, mixture, packing, resume, split, streaming, tokens, trained_model
from .config import RunConfig
from .log import Progress, RunLog
from .model import build, check_isolation, check_positions, meta_model
from . import preemption
from .preemption import StopSignals
from .skip_streak import SkipStreak
from .schedule import warmup_steps
from .tokens import TokenFile, load_tokenizer, token_file

CHECKPOINTS = "checkpoints"


def _run_dir(c: RunConfig) -> str:
    return c.run_dir or os.path.join("runs", time.strftime(f"{c.name}-%Y%m%d-%H%M%S"))


def _data(c: RunConfig, run_dir: str, row_len: int):
    """The tokenizer (for a vision-language model its images.Media, which saves the processor),
    the token files (train, eval or None; made now if new, and not yet in place: tokens.commit),
    the training and eval rows (None without held-out data) and what the
    training data's position refers to (its token file's sha256; the sources' when streamed)."""
    tokenizer_dir = None if c.bundled else (c.tokenizer or c.model)
    tokenizer = load_tokenizer(tokenizer_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    folder = os.path.join(run_dir, "tokens")
    if c.streaming:
        return _stream(c, folder, tokenizer, tokenizer_dir, row_len, pad)
    media = grid_images.media(tokenizer_dir) if images.has_processor(tokenizer_dir) else None
    if media is not None and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = media.chat_template()     # a processor may hold the template alone
    pixels = media.inputs if media is not None else None
    train = token_file(folder, "train", c.data, tokenizer, tokenizer_dir, c.train_on_prompt, media)
    held, eval_rows = None, None
    try:
        source, docs = train, np.arange(train.n_docs)
        if media is not None:
            media.check_packing(c.packing, train)
        if c.eval:
            held = token_file(folder, "eval", c.eval, tokenizer, tokenizer_dir, c.train_on_prompt, media)
            if media is not None:
                media.check_packing(c.packing, held)
            eval_rows = packing.Rows(held, row_len, c.packing, c.seed, shuffle=False, pad_id=pad, pixels=pixels)
            print(f"  data           {_count(train, docs)} to train; {_count(held, np.arange(held.n_docs))} in "
                  f"{', '.join(e['path'] for e in c.eval)} to evaluate", flush=True)
        elif c.eval_fraction:
            cut = split.hold_out(train, c.eval_fraction, c.seed)
            source, docs = cut.tokens, cut.train
            eval_rows = packing.Rows(cut.tokens, row_len, c.packing, c.seed, docs=cut.held, shuffle=False, pad_id=pad,
                                     pixels=pixels)
            print(f"  data           {_count(cut.tokens, cut.train)} to train; {_count(cut.tokens, cut.held)} held "
                  f"out to evaluate (eval_fraction {c.eval_fraction:g} of the tokens"
                  + ("; one document cut between them)" if cut.cut else ")"), flush=True)
        else:
            print(f"  data           {_count(train, docs)} to train", flush=True)
        rows = packing.Rows(source, row_len, c.packing, c.seed, docs=docs, pad_id=pad, mix=_mix(c, source, docs),
                            pixels=pixels)
    except BaseException:
        for made in (train, held):
            if made is not None:
                tokens.discard(made)
        raise
    return media or tokenizer, (train, held), rows, eval_rows, train.fingerprint


def _stream(c: RunConfig, folder: str, tokenizer, tokenizer_dir: str | None, row_len: int, pad: int):
    """_data for `streaming: true` (streaming.py): eval files still go to a token file."""
    weights = [e["weight"] for e in c.data]
    held = eval_rows = None
    if c.eval:
        held = token_file(folder, "eval", c.eval, tokenizer, tokenizer_dir, c.train_on_prompt)
        eval_rows = packing.Rows(held, row_len, c.packing, c.seed, shuffle=False, pad_id=pad)
    print(f"  data           streamed from {', '.join(e['path'] for e in c.data)} ({c.mix_strategy}), tokenised "
          "as training reads it" + (f"; {_count(held, np.arange(held.n_docs))} to evaluate" if held else ""),
          flush=True)
    rows = streaming.StreamRows(c.data, weights if weights[0] is not None else None, c.mix_strategy, tokenizer,
                                c.train_on_prompt, row_len, c.packing, pad)
    return tokenizer, (None, held), rows, eval_rows, tokens.fingerprint(c.data, tokenizer_dir, c.train_on_prompt)


def _mix(c: RunConfig, source: TokenFile, docs: np.ndarray):
    """The epoch order of a weighted mixture (mixture.py), or None: every document once an epoch."""
    weights = [e["weight"] for e in c.data]
    if weights[0] is None:
        return None
    labels = mixture.source_of(source, docs)
    by_source = [docs[labels == i] for i in range(len(c.data))]
    print("  mixture        " + "; ".join(f"{os.path.basename(e['path'])} weight {w:.0%} ({len(d):,} documents)"
                                         for e, w, d in zip(c.data, weights, by_source))
          + f"; {c.mix_strategy}", flush=True)
    return lambda epoch: mixture.epoch_order(by_source, weights, c.mix_strategy, c.seed, epoch)


def _count(tokens: TokenFile, docs: np.ndarray) -> str:
    n = int((tokens.docs[docs + 1] - tokens.docs[docs]).sum())
    return f"{n:,} tokens ({len(docs):,} document{'s' if len(docs) != 1 else ''})"


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


def _check_images(c: RunConfig, rows) -> None:
    """With records that have images and a vision tower or projector that trains, the micro-batch
    is given (batch, grad_accum), not left to the planner. A micro-batch may hold no image: the
    tower and projector then get no gradient, and the engine skips them for the step as
    torch.optim.AdamW does (engine/gradless.py)."""
    if not getattr(getattr(rows, "tokens", None), "images", None):
        return
    if c.finetuning_type == "lora" or (c.freeze_vision_tower and c.freeze_multi_modal_projector):
        return
    if c.global_batch is not None:
        raise ArgumentError("global_batch: the data has records with images and the vision tower or projector "
                            "trains, and the planner does not pick the micro-batch of such a run; give batch and "
                            "grad_accum (or freeze_vision_tower and freeze_multi_modal_projector)")


def _evaluate(engine, rows: packing.Rows, batch: int, limit: int | None, shifted: bool) -> tuple[float, float]:
    """Mean loss per target token over the held-out rows, and its perplexity (forward only)."""
    n_batches = -(-rows.rows_per_epoch // batch)
    if limit is not None:
        n_batches = min(n_batches, limit)
    total, count = 0.0, 0
    training = engine.model.training
    engine.model.eval()         # dropout (lora_dropout, a model's own) off, as in eager evaluation
    try:
        for i in range(n_batches):
            inputs = packing.batch(rows, i * batch, batch, shifted=shifted)
            n = packing.target_count(inputs, shifted=shifted)
            if n == 0:
                continue
            out = engine(**inputs)
            loss = out.loss if hasattr(out, "loss") else out
            total += float(loss) * n
            count += n
    finally:
        engine.model.train(training)
    mean = total / count if count else float("nan")
    return mean, math.exp(min(mean, 700.0))


def starting_point(c: RunConfig) -> tuple[str, str | None, resume.Saved | None]:
    """The run folder, the checkpoint to resume from (None: a new run) and its manifest, checked;
    and the trained model's folder checked against a new run."""
    run_dir = _run_dir(c)
    resume_from = _latest_checkpoint(c, run_dir) if os.path.isdir(run_dir) else None
    if c.resume not in (None, "auto"):
        resume_from = c.resume
    saved = resume.read(resume_from) if resume_from is not None else None
    trained_model.check_new_run(c, run_dir, resume_from)
    return run_dir, resume_from, saved


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:06d}")


def save_checkpoint(c: RunConfig, engine, folder: str, step: int, position: int, fingerprint: str,
                    force: bool = False, **more) -> bool:
    """At every save_every-th step and the last one (or now: `force`, when a stop signal came), a
    checkpoint in `folder` with what a resume checks and goes on from: the data position (rows, or
    a stage's pairs or prompts), what it refers to, the settings; `more`: a stage's own state.
    Whether it saved one."""
    if not force and (c.save_every is False or not ((c.save_every and step % c.save_every == 0)
                                                     or step == c.steps)):
        return False        # save_every false (TRL's save_strategy: no): none but a stop signal's
    engine.save_checkpoint(checkpoint_path(folder, step),
                           extra={"rows": position, "data": fingerprint, "rows_layout": resume.rows_layout(c),
                                  "settings": resume.settings(c), "finetuning": finetune.saved(c), **more},
                           keep_last=c.keep_last)
    return True


def run(c: RunConfig, trace: str | None = None) -> dict:
    """Train as `c` says; returns the figures the final line prints. After the last step the run dir
    gets that step's Chrome trace (step.json, or `trace`) and memory.png (docs/plan-format.md).
    Every check (settings against the model and the data, a resume against its checkpoint) comes
    before any file of the run folder is written and before the engine exists."""
    if c.stage != "sft":
        raise ArgumentError(f"stage {c.stage} runs by megacompile.train.run (train/start.py), not the SFT loop")
    run_dir, resume_from, saved = starting_point(c)
    meta = meta_model(c)
    if c.packing == "isolated":
        check_isolation(meta)     # before the data is read: the model decides whether it can be done
    check_positions(c, meta)
    meta = finetune.apply(c, meta)      # the names it gives checked against the model, before the data is read
    if saved is not None:
        resume.check_rows(c, saved)
        finetune.check_resume(c, saved.extra)
    fresh = not os.path.exists(run_dir)
    shifted, made = c.bundled, (None, None)
    try:
        tokenizer, made, rows, eval_rows, fingerprint = _data(c, run_dir, c.seq + shifted)
        available = rows.epoch_tokens
        if available is not None and c.seq > available:
            raise ArgumentError(f"seq {c.seq:,} is longer than the training data, {available:,} tokens"
                                f"{' (after eval_fraction)' if c.eval_fraction else ''}: every row would be mostly "
                                f"padding; give seq <= {available:,}, or more data")
        if saved is not None:
            resume.check_data(saved, fingerprint)
        per_step = c.global_batch or c.batch * c.grad_accum
        if c.steps is None:
            c.steps = max(1, math.ceil(c.epochs * rows.rows_per_epoch / per_step))
        c.warmup = warmup_steps(c.warmup, c.steps)      # a fraction of the steps, now that they are known
        _check_images(c, rows)
    except BaseException:
        for tokens_made in made:
            if tokens_made is not None:
                tokens.discard(tokens_made)
        if fresh:       # the run folder was made for this run alone: nothing of it is left
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    os.makedirs(run_dir, exist_ok=True)
    for tokens_made in made:
        if tokens_made is not None:
            tokens.commit(tokens_made, os.path.join(run_dir, "tokens"))
    done = saved is not None and resume.complete(c, saved, run_dir)
    if done:
        print(f"  complete       {done}", flush=True)
        place = trained_model.folder(c, run_dir)
        if place is None or trained_model.holds_model(place):
            print(trained_model.last_line(c, place, saved.path), flush=True)
            return {"steps": saved.steps_done, "skipped_steps": None, "run_dir": run_dir, "first_loss": None,
                    "final_loss": None, "seconds": 0.0, "last_checkpoint": saved.steps_done, "complete": True,
                    "model": place or saved.path}
    elif saved is not None:
        for note in resume.notes(c, saved):
            print(f"  resume note    {note}", flush=True)
    try:
        setup = build(c, meta, lambda b: packing.batch(rows, 0, b, shifted=shifted))
    except BaseException:
        if c.streaming:
            rows.close()        # its tokenising thread, started by the rows build() read
        raise
    try:
        result = _train(c, setup, run_dir, resume_from, tokenizer, fingerprint, rows, eval_rows,
                        saved_settings=saved is not None and isinstance(saved.extra.get("settings"), dict))
        if result["first_loss"] is not None:      # a step ran here: its record is the one to show
            write_run_views(setup.engine, run_dir, trace)
        print(trained_model.last_line(c, trained_model.folder(c, run_dir), result["model"]), flush=True)
        return result
    finally:
        setup.engine.close()
        if c.streaming:
            rows.close()


def _train(c: RunConfig, setup, run_dir: str, resume_from: str | None, tokenizer, fingerprint: str,
           rows: packing.Rows, eval_rows: packing.Rows | None, saved_settings: bool = False) -> dict:
    engine, shifted = setup.engine, setup.shifted
    first = packing.batch(rows, 0, setup.batch, shifted=shifted)
    plan = engine.prepare(**first)
    consumed = 0
    if resume_from is not None:     # its own checks (model, files, checksums) before the plan is written
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # strict=False: resume.py has refused what would make the resume inexact and noted the
            # rest; the engine keeps this run's settings and the model its config's own buffers
            # (a difference there is one more note below).
            extra = engine.load_checkpoint(resume_from, strict=False) or {}
        consumed = int(extra["rows"])
        said = set()
        for w in caught:
            message = str(w.message)
            if saved_settings and "was saved with other settings" in message:
                continue        # resume.notes said what each change does
            if message not in said:
                print(f"  resume note    {message}", flush=True)
                said.add(message)
    print(plan.summary(), flush=True)
    print(f"  weights        {fmt_bytes(setup.weight_bytes)} in {c.compute_dtype}; budget is "
          f"{100 * plan.budget_bytes / setup.weight_bytes:.0f}% of them", flush=True)
    print(f"  batch          {setup.batch} x {setup.grad_accum} accumulated x {c.seq} tokens per optimizer step; "
          f"{c.steps} steps" + (f", {rows.rows_per_epoch} rows an epoch" if rows.rows_per_epoch else ""), flush=True)
    plan.dump(os.path.join(run_dir, "plan"))
    print(f"  plan dump      {os.path.join(run_dir, 'plan')}/plan.txt, plan.json", flush=True)
    if resume_from is not None:
        print(f"  resumed        from {resume_from} at step {engine.steps_done}", flush=True)
    start_step = engine.steps_done
    log = RunLog(run_dir, c.log, start_step, settings=dataclasses.asdict(c))
    progress = Progress(c.steps, start_step, c.log_every)
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    saved_at, losses_seen, started = None, [], time.perf_counter()
    latest = (start_step, resume_from) if resume_from is not None else (0, None)    # (step, checkpoint)

    def save_now() -> str:
        save_checkpoint(c, engine, checkpoints, engine.steps_done, consumed, fingerprint, force=True)
        return checkpoint_path(checkpoints, engine.steps_done)

    skips = SkipStreak(c.max_consecutive_skips)
    try:
        with StopSignals(c.stop_signals) as stop_signals:
            while engine.steps_done < c.steps:
                preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
                t0, losses, tokens, done = time.perf_counter(), [], 0, engine.steps_done
                while engine.steps_done == done:     # the micro-batches of one optimizer step
                    inputs = packing.batch(rows, consumed, setup.batch, shifted=shifted)
                    consumed += setup.batch
                    if packing.target_count(inputs, shifted=shifted) == 0:
                        continue      # all prompt or padding: its loss would be 0/0; the next rows instead
                    losses.append(engine.step(**inputs))
                    record = engine.last_step
                    tokens += record.tokens or 0      # a skipped step counts none
                    if record.skipped:
                        break
                seconds = time.perf_counter() - t0
                if None in losses:      # a layer-major step: its losses exist once its last micro-batch ran
                    losses = (list(engine.accumulated_losses) if record.updated
                              else [x for x in losses if x is not None])
                if done == start_step:
                    plan.dump(os.path.join(run_dir, "plan"))      # now with the measured peak beside the prediction
                step = record.step
                row = {"step": step, "loss": sum(losses) / len(losses), "lr": record.lr,
                       "grad_norm": record.grad_norm, "tokens": tokens, "seconds": seconds,
                       "tokens_per_s": tokens / seconds, "device_peak_bytes": record.device_peak_bytes,
                       "predicted_device_peak_bytes": record.predicted_device_peak_bytes, "skipped": record.skipped}
                if record.skipped:
                    log.write(row)
                    skips.skipped(record)
                    continue
                skips.updated()
                losses_seen.append(row["loss"])
                if eval_rows is not None and c.eval_every and (step % c.eval_every == 0 or step == c.steps):
                    row["eval_loss"], row["eval_perplexity"] = _evaluate(engine, eval_rows, setup.batch,
                                                                         c.eval_batches, shifted)
                log.write(row)
                progress.update(step, f"loss {row['loss']:.4f} | {row['tokens_per_s']:,.0f} tok/s | device peak "
                                f"{fmt_bytes(row['device_peak_bytes'])} / {fmt_bytes(plan.budget_bytes)}"
                                + (f" | eval loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""),
                                {"loss": f"{row['loss']:.4f}", "tok/s": f"{row['tokens_per_s']:,.0f}",
                                 "peak": fmt_bytes(row["device_peak_bytes"])}, eval_loss=row.get("eval_loss"))
                if save_checkpoint(c, engine, checkpoints, step, consumed, fingerprint):
                    saved_at, latest = step, (step, checkpoint_path(checkpoints, step))
            preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
    finally:
        progress.close()
        log.close()
    elapsed = time.perf_counter() - started
    place = trained_model.folder(c, run_dir)
    if place is not None:
        # overwrite: only a resumed run gets here with model files in the folder, its own (check_new_run)
        trained_model.write(c, engine, tokenizer, place, overwrite=resume_from is not None)
    result = {"steps": engine.steps_done, "skipped_steps": engine.skipped_steps, "run_dir": run_dir,
              "first_loss": losses_seen[0] if losses_seen else None,
              "final_loss": losses_seen[-1] if losses_seen else None,
              "seconds": elapsed, "last_checkpoint": saved_at, "budget_bytes": plan.budget_bytes,
              "predicted_device_peak_bytes": plan.predicted_peak_bytes,
              "measured_device_peak_bytes": plan.measured_peak_bytes, "model": place or latest[1]}
    if losses_seen:
        print(f"done: loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {elapsed:.1f} s, measured "
              f"device peak {fmt_bytes(plan.measured_peak_bytes or 0)} (predicted "
              f"{fmt_bytes(plan.predicted_peak_bytes)}); log in {os.path.join(run_dir, 'log.csv')}", flush=True)
    return result
