"""`megacompile train`: a run of any stage (stages/: sft, pt, dpo, kto, grpo) from its settings to the
trained model, in one loop.

    settings -> checks (the model against the stage; a resume against its checkpoint: resume.py)
             -> the stage reads its data (token files staged; pairs or prompts in memory)
             -> checks (the data against the settings; the resume's data) -> put in place
             -> complete already? -> engine over the stage's objective -> resume? -> plan summary
             and dump -> steps
             -> per step: CSV row, progress; evaluation every eval_every; checkpoint every save_every
             -> final checkpoint, the trained model in its folder (trained_model.py)

Nothing of the run folder is written before every check has passed: a refused run leaves it as
it was (a new one leaves none).

A checkpoint carries the data position (rows, pairs or prompts consumed) and the stage's own state
beside the engine's, so a resumed run feeds exactly the micro-batches the uninterrupted run would
have, and writes the same log rows from its checkpoint on.
"""
from __future__ import annotations

import dataclasses
import errno
import math
import os
import re
import shutil
import sys
import time
import warnings
from typing import Callable

from ..errors import ArgumentError, CheckpointError, NonFiniteError, PartialStepError, WeightsFileError
from ..ir import fmt_bytes
from ..report import write_run_views
from ..io import trainer_checkpoint
from . import (aliases, best_model, early_stopping, intervals, methods, preemption, resume, resume_model,
               rope_scaling, results, router_loss, run_args, run_lock, tokenized, trained_model, vocab)
from .config import KEYS, RunConfig
from .data.tokens import sources as fingerprint_sources
from .log import Progress, RunLog
from .model import build, check_import, file_key, meta_model
from .reference_model import reference_engine
from .preemption import StopSignals
from .schedule import warmup_steps
from .skip_streak import SkipStreak
from .host_watch import watch_host
from .stages import Stage, kind, open_stage
from .stages.epochs import note as epochs_note
from .stages.stage import CHECKPOINTS


def _run_dir(c: RunConfig) -> str:
    return c.run_dir or os.path.join("runs", time.strftime(f"{c.name}-%Y%m%d-%H%M%S"))


def _own_checkpoints(run_dir: str) -> list[str]:
    """The committed checkpoints this run folder holds, oldest first."""
    from ..io.checkpoint import committed_beside
    folder = os.path.join(run_dir, CHECKPOINTS)
    return committed_beside(os.path.join(folder, "latest")) if os.path.isdir(folder) else []


def _latest_checkpoint(c: RunConfig, run_dir: str) -> str | None:
    found = _own_checkpoints(run_dir)
    if c.resume is None:
        if found:
            raise ArgumentError(f"run_dir {run_dir} already holds checkpoints ({os.path.basename(found[-1])}); "
                                "resume: auto goes on from the latest, or give another run_dir")
        return None
    if c.resume == "auto":
        return found[-1] if found else None
    return c.resume


def starting_point(c: RunConfig, run_dir: str) -> tuple[str | None, resume.Saved | None, str | None]:
    """The checkpoint to resume from (None: a new run) and its manifest, checked; the Trainer
    checkpoint a new run starts from (`resume` naming one: io/trainer_checkpoint.py), or None; and
    the trained model's folder checked against a new run."""
    if c.resume not in (None, "auto"):
        # A run folder of megacompile's (RUN, RUN/checkpoints or RUN/checkpoints/latest): its latest
        # committed checkpoint, as export takes it. Checked first: a finished LoRA run's folder
        # holds an adapter and a trainer_state.json, as a Trainer's checkpoint-N does.
        latest = resume.checkpoint_of(c.resume)
        if latest != os.path.normpath(c.resume):
            print(f"  resume         {c.resume} is a run folder: going on from its latest checkpoint, "
                  f"{os.path.relpath(latest, c.resume)}", flush=True)
            c.resume = latest
    imported = c.resume if c.resume not in (None, "auto") and trainer_checkpoint.is_trainer_checkpoint(c.resume) \
        else None
    if imported is not None:
        # The Trainer's checkpoint starts this run; once the run saved checkpoints of its own (it
        # was stopped), the same command goes on from its latest instead.
        found = _own_checkpoints(run_dir)
        resume_from = found[-1] if found else None
    else:
        resume_from = _latest_checkpoint(c, run_dir) if os.path.isdir(run_dir) else None
        if c.resume not in (None, "auto"):
            resume_from = c.resume
        elif c.resume == "auto" and resume_from is None and os.path.isdir(run_dir):
            # LlamaFactory's resume_from_checkpoint: true over its own output_dir: the latest
            # checkpoint-N its Trainer left there starts this run.
            imported = _latest_trainer_checkpoint(run_dir)
    saved = resume.read(resume_from) if resume_from is not None else None
    trained_model.check_new_run(c, run_dir, resume_from)
    return resume_from, saved, imported if resume_from is None else None


def _set_aside_later(run_dir: str, resume_from: str) -> str | None:
    """Resumed from a checkpoint of its own folder that later ones follow (the run branches: other
    settings from an earlier step), those later ones are the abandoned branch's. Left in place, a
    later `resume: auto` would go on from them, and this run's saves would replace some of them.
    They are moved, whole, to checkpoints/set-aside-at-<step>/; what is said of it, or None."""
    found = _own_checkpoints(run_dir)
    mine = [os.path.realpath(f) for f in found]
    if os.path.realpath(resume_from) not in mine:
        return None
    later = found[mine.index(os.path.realpath(resume_from)) + 1:]
    if not later:
        return None
    name = f"set-aside-at-{os.path.basename(os.path.normpath(resume_from))}"
    aside = os.path.join(run_dir, CHECKPOINTS, name)
    n = 1
    while os.path.exists(aside):        # a second branch from the same checkpoint: its own folder
        n += 1
        aside = os.path.join(run_dir, CHECKPOINTS, f"{name}-{n}")
    os.makedirs(aside)
    for path in later:
        os.replace(path, os.path.join(aside, os.path.basename(path)))
    from ..io.durable import fsync_dir
    fsync_dir(os.path.dirname(later[0]))
    names = ", ".join(os.path.basename(p) for p in later)
    return (f"the checkpoints after the one resumed from ({names}) are of the run it branches from: moved to "
            f"{aside}, so that resume: auto goes on from this run's")


def _dump(plan, run_dir: str) -> None:
    """The plan into RUN/plan; a disk that refuses it is the run's error, naming the folder."""
    folder = os.path.join(run_dir, "plan")
    try:
        plan.dump(folder)
    except OSError as e:
        cause = f"the disk is full ({e.strerror})" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise CheckpointError(f"cannot write the plan dump {folder}: {cause}") from e


def _first_missing(path: str) -> str | None:
    """The outermost folder of `path` that does not exist yet (path itself when only it is missing);
    None when path exists."""
    path, missing = os.path.abspath(path), None
    while not os.path.exists(path):
        path, missing = os.path.dirname(path), path
    return missing


def _latest_trainer_checkpoint(run_dir: str) -> str | None:
    """The Trainer checkpoint (checkpoint-N, io/trainer_checkpoint.py) of the highest N in run_dir."""
    found = [(int(name.rpartition("-")[2]), os.path.join(run_dir, name)) for name in os.listdir(run_dir)
             if re.fullmatch(r"checkpoint-\d+", name)]
    found = [(n, path) for n, path in sorted(found) if trainer_checkpoint.is_trainer_checkpoint(path)]
    return found[-1][1] if found else None


def _saved_on_stop(save_now: Callable[[], str], step: int, latest: tuple[int, str | None]
                   ) -> tuple[tuple[int, str | None], str | None]:
    """The checkpoint of the whole step `step` as the run stops on a fault that left the state
    sound, unless `latest` holds it already (or no step ran): the newest (step, checkpoint), and
    why it could not be written, or None."""
    if step == latest[0]:
        return latest, None
    try:
        return (step, save_now()), None
    except CheckpointError as e:
        return latest, f"the checkpoint of step {step} could not be written ({e})"


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, f"step-{step:06d}")


def save_checkpoint(c: RunConfig, engine, folder: str, step: int, position: int, fingerprint: str,
                    force: bool = False, keep: tuple[str, ...] = (),
                    side_files: Callable[[], dict[str, str]] | None = None, **more) -> bool:
    """At every save_every-th step (or each epoch's end: intervals.py) and the last one (or now:
    `force`, when a stop signal came), a checkpoint in `folder` with what a resume checks and goes
    on from: the data position (rows, or a stage's pairs or prompts), what it refers to, the
    settings; `more`: a stage's own state; `side_files`: called for the files it carries beside its
    tensors (results.checkpoint_files), which its commit includes. Whether it saved one."""
    if not force and (c.save_every is False or not intervals.due(c.save_every, step, c.steps)):
        return False        # save_every false (TRL's save_strategy: no): none but a stop signal's
    sources = fingerprint_sources(fingerprint)     # what the data was made from: resume.py names changes
    engine.save_checkpoint(checkpoint_path(folder, step),
                           extra={"rows": position, "data": fingerprint, "rows_layout": resume.rows_layout(c),
                                  "settings": resume.settings(c), "finetuning": methods.saved(c),
                                  **({"data_sources": sources} if sources is not None else {}), **more},
                           keep_last=c.keep_last, keep=keep, side_files=side_files() if side_files else None)
    return True


def run(c: RunConfig, trace: str | None = None) -> dict:
    """Train as `c` says; returns the figures the final line prints. After the last step the run dir
    gets that step's Chrome trace (step.json, or `trace`) and memory.png (docs/plan-format.md).
    Every check (settings against the model and the data, a resume against its checkpoint) comes
    before any file of the run folder is written and before the engine exists; the run holds the
    folder alone throughout (run_lock.py), and a run that ends before it commits anything leaves
    no folder it made."""
    run_dir = _run_dir(c)
    made = _first_missing(run_dir)      # the run folder, or the folder above it the run makes first
    with run_lock.holding(run_dir) as lock:
        return _run_in(c, run_dir, made, lock, trace)


def _run_in(c: RunConfig, run_dir: str, made: str | None, lock: run_lock.Held, trace: str | None) -> dict:
    try:
        resume_from, saved, imported = starting_point(c, run_dir)
        stage, meta, model_config = _checked_stage(c, run_dir, resume_from, saved, imported)
    except BaseException as e:
        if made is not None:     # made for this run alone (folders above it too): nothing of it is left
            shutil.rmtree(made, ignore_errors=True)
        else:                    # a folder it found: left as it was
            lock.leave()
        if type(e) is ArgumentError and c.spelled:      # a key named as the run.yaml wrote it (cutoff_len)
            raise aliases.named(e, c.spelled) from e
        raise
    return _train_checked(c, run_dir, stage, resume_from, saved, imported, meta, model_config, trace)


def _checked_stage(c: RunConfig, run_dir: str, resume_from: str | None, saved, imported: str | None):
    """The model on the meta device and the stage's data, each checked against the settings and a
    resumed run's checkpoint (before the engine exists)."""
    meta = meta_model(c)
    for said in vocab.resolve(c, meta):
        print(said, flush=True)
    if c.grown is not None:
        meta = meta_model(c)      # built again with the grown vocabulary
    kind(c).check_model(c, meta)
    model_config = resume_model.saved(meta)      # kept with every checkpoint
    if saved is not None:
        resume_model.check(saved.path, saved.extra, meta)
    for said in (router_loss.note(c, meta), rope_scaling.note(c)):
        if said:
            print(said, flush=True)
    said: list[str] = []
    meta = methods.apply(c, meta, said)      # the names it gives checked against the model, before the data is read
    for note in said:
        print(f"  note           {note}", flush=True)
    methods.check_adapter(c, meta)
    if imported is not None:
        check_import(c, meta, imported)
    if saved is not None:
        resume.check_rows(c, saved)
        methods.check_resume(c, saved.extra)
        kind(c).check_resume(c, saved)
    methods.pissa.check_start(c, meta, run_dir, saved is not None, imported)
    stage = open_stage(c, run_dir, meta)
    try:
        if saved is not None:
            resume.check_data(saved, stage.fingerprint, stage.same_rows)
            tokenized.check(saved, stage.fingerprint, stage.tokenized)
        if c.steps is None:
            c.steps = stage.steps_for(c.epochs)
            items = stage.epoch_items()
            for line in [] if items is None else epochs_note(c, *items):
                print(line, flush=True)
        c.warmup = warmup_steps(c.warmup, c.steps)      # a fraction of the steps, now that they are known
        intervals.resolve(c, stage.steps_for)
        best_model.check_intervals(c, list(stage.columns))
        early_stopping.check_metric(c, list(stage.columns))
    except BaseException:
        stage.discard()
        stage.close()
        raise
    return stage, meta, model_config


def _model_checkpoint(c: RunConfig, saved, run_dir: str) -> str:
    """The checkpoint that is a complete run's bundled model: its best under load_best_model_at_end
    (best_model.py), else its last."""
    step = (saved.extra.get("best") or {}).get("step")
    if not c.load_best_model_at_end or step is None or step == saved.steps_done:
        return saved.path
    return checkpoint_path(os.path.join(run_dir, CHECKPOINTS), step)


def _train_checked(c: RunConfig, run_dir: str, stage: Stage, resume_from: str | None, saved, imported: str | None,
                   meta, model_config: dict, trace: str | None) -> dict:
    try:
        os.makedirs(run_dir, exist_ok=True)
        run_args.write(c, run_dir)
        stage.commit(run_dir)
        done = saved is not None and resume.complete(c, saved, run_dir)
        if done:
            print(f"  complete       {done}", flush=True)
            place = trained_model.folder(c, run_dir)
            if place is None or trained_model.holds_model(place):
                model = place or _model_checkpoint(c, saved, run_dir)
                print(trained_model.last_line(c, place, model), flush=True)
                return {"steps": saved.steps_done, "skipped_steps": None, "run_dir": run_dir, "first_loss": None,
                        "final_loss": None, "seconds": 0.0, "last_checkpoint": saved.steps_done, "complete": True,
                        "model": model}
        elif saved is not None:
            for note in resume.notes(c, saved):
                print(f"  resume note    {note}", flush=True)
            set_aside = _set_aside_later(run_dir, resume_from)
            if set_aside:
                print(f"  resume note    {set_aside}", flush=True)
        wrap = stage.objective
        setup = build(c, meta, stage.first_inputs, wrap=wrap, heaviest_inputs=stage.heaviest_inputs,
                      beside_of=stage.device_beside, host_beside_of=stage.host_beside,
                      forward_inputs=stage.forward_inputs)
        methods.pissa.keep(c, run_dir)
        try:
            if stage.needs_reference:     # the model as loaded, forward only, on the policy's device
                stage.reference = reference_engine(c, meta, setup, stage.first_inputs, wrap)
            result = _train(c, setup, stage, run_dir, resume_from, model_config,
                            saved_settings=saved is not None and isinstance(saved.extra.get("settings"), dict),
                            imported=imported)
            if result["first_loss"] is not None:      # a step ran here: its record is the one to show
                write_run_views(setup.engine, run_dir, trace)
            print(trained_model.last_line(c, trained_model.folder(c, run_dir), result["model"]), flush=True)
            return result
        finally:
            setup.engine.close()
    finally:
        stage.close()


def _resume(engine, resume_from: str, saved_settings: bool) -> dict:
    """The checkpoint loaded into the engine (its own checks: model, files, checksums); what it
    says is printed once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # strict=False: resume.py has refused what would make the resume inexact and noted the
        # rest; the engine keeps this run's settings and the model its config's own buffers
        # (a difference there is one more note).
        try:
            extra = engine.load_checkpoint(resume_from, strict=False) or {}
        except WeightsFileError as e:      # a file missing, cut short or changed: nothing was loaded
            raise WeightsFileError(f"{e}; {resume.broken_latest(resume_from)}") from e
    for message in dict.fromkeys(str(w.message) for w in caught):
        if not (saved_settings and "was saved with other settings" in message):   # resume.notes said it
            print(f"  resume note    {message}", flush=True)
    return extra


def _take_in(c: RunConfig, engine, imported: str, objective: bool) -> None:
    """A Trainer checkpoint's weights, AdamW moments and steps into the engine (its own checks
    before any state changes); this run's AdamW settings are kept, a difference said once."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_trainer_checkpoint(imported, strict=False, file_key=file_key(methods.adapters(c), objective))
    for message in dict.fromkeys(str(w.message) for w in caught):
        print(f"  resume note    {message}", flush=True)


def _train(c: RunConfig, setup, stage: Stage, run_dir: str, resume_from: str | None, model_config: dict,
           saved_settings: bool = False, imported: str | None = None) -> dict:
    engine = setup.engine
    plan = engine.prepare(**stage.first_inputs(setup.batch))
    position, extra = 0, None
    if resume_from is not None:     # its own checks (model, files, checksums) before the plan is written
        extra = _resume(engine, resume_from, saved_settings)
        position = int(extra["rows"])
    print(plan.summary(), flush=True)
    for line in stage.describe(setup):
        print(f"  {line}", flush=True)
    _dump(plan, run_dir)
    print(f"  plan dump      {os.path.join(run_dir, 'plan')}/plan.txt, plan.json", flush=True)
    if resume_from is not None:
        print(f"  resumed        from {resume_from} at step {engine.steps_done}", flush=True)
    stage.begin(engine, run_dir, extra, setup.batch)
    # A new run's own starting weights come after the stage began: a reference it makes from the
    # policy (DPO's and KTO's tables) is then the model folder's, as a Trainer's reference is the
    # model it was given (TRL's, for a PEFT policy, the base with the adapter disabled).
    if imported is not None:
        _take_in(c, engine, imported, stage.objective is not None)
        print(f"  resumed        from {trainer_checkpoint.named(imported)} {imported} at step {engine.steps_done} "
              "(its weights, AdamW moments and steps; the data from this run's first row: the trainer's order is its "
              "own)", flush=True)
    elif resume_from is None and c.adapter is not None:
        engine.load_adapter(c.adapter)
        print(f"  adapter        from {c.adapter} (its weights; AdamW starts afresh)", flush=True)
    start_step = engine.steps_done
    settings = {k: v for k, v in dataclasses.asdict(c).items() if k in KEYS}     # run.yaml's keys, not derived
    steps_per_epoch = results.epoch_steps(c, stage)
    log = RunLog(run_dir, c.log, start_step, settings=settings, columns=stage.columns, steps=c.steps,
                 every=c.log_every, steps_per_epoch=steps_per_epoch)
    if c.eval_on_start and start_step == 0:       # transformers' eval_on_start: the model as it starts
        first = stage.evaluate(engine, 0)
        log.write({"step": 0, **first})
        print("  eval on start  " + ", ".join(f"{k} {v:.4f}" for k, v in first.items() if isinstance(v, float)),
              flush=True)
    progress = Progress(c.steps, start_step, c.log_every)
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    saved_at, losses_seen, started = None, [], time.perf_counter()
    latest = (start_step, resume_from) if resume_from is not None else (0, None)    # (step, checkpoint)
    best = best_model.Best(c, extra)
    patience = early_stopping.Patience(c, extra)
    params = results.counted_parameters(engine.model)

    def at(step: int) -> str:
        return checkpoint_path(checkpoints, step)

    def save(step: int, force: bool = False, row: dict | None = None) -> bool:
        """A checkpoint at `step` where due (or forced); `row`: the step's logged figures, whose
        evaluation may make it the best (best_model.py)."""
        proposed = best.proposed(step, row or {})

        def trainer_state() -> dict[str, str]:      # the checkpoint's trainer_state.json, the run up to `step`
            return results.checkpoint_files(c, run_dir, step, steps_per_epoch, params, proposed,
                                            proposed and at(proposed["step"]), step >= c.steps or patience.stop)

        made = save_checkpoint(c, engine, checkpoints, step, position, stage.fingerprint, force=force,
                               keep=best.kept(at) if proposed == best.state() else (), side_files=trainer_state,
                               **stage.checkpoint_extra(), **({"best": proposed} if proposed else {}),
                               **({tokenized.KEY: stage.tokenized} if stage.tokenized else {}),
                               **patience.extra(proposed), **{resume_model.KEY: model_config})
        if made:
            best.keep(proposed)
        return made

    def save_now() -> str:
        save(engine.steps_done, force=True)
        return at(engine.steps_done)

    skips = SkipStreak(c.max_consecutive_skips)
    host_watch = watch_host(c, engine)
    try:
        with StopSignals(c.stop_signals) as stop_signals:
            while engine.steps_done < c.steps:
                preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
                t0, done = time.perf_counter(), engine.steps_done
                metrics, losses, tokens, position = stage.step(engine, position)
                record = engine.last_step
                seconds = time.perf_counter() - t0
                if None in losses:      # a layer-major step: its losses exist once its last micro-batch ran
                    losses = (list(engine.accumulated_losses) if record.updated
                              else [x for x in losses if x is not None])
                if done == start_step:      # the plan the step ran (another than the first inputs' where its
                    # images differ), now with the measured peak beside the prediction
                    _dump(engine.plan, run_dir)
                row = {"step": record.step, "loss": stage.step_loss(losses) if losses else math.nan,
                       "lr": record.lr, "grad_norm": record.grad_norm, "tokens": tokens, "seconds": seconds,
                       # a skipped step's record may count no tokens (the stage reports what it read)
                       "tokens_per_s": tokens / seconds if tokens is not None else math.nan,
                       "device_peak_bytes": record.device_peak_bytes,
                       "predicted_device_peak_bytes": record.predicted_device_peak_bytes,
                       "host_resident_bytes": record.host_resident_bytes, "skipped": record.skipped, **metrics}
                host_watch.check(record.host_resident_bytes, record.step)
                if record.skipped:      # nothing changed: no evaluation, progress or checkpoint
                    log.write(row)
                    skips.skipped(record)
                    continue
                skips.updated()
                losses_seen.append(row["loss"])
                row.update(stage.evaluate(engine, record.step))
                patience.evaluated(row)
                log.write(row, last=patience.stop)
                text, figures = stage.progress(row, plan.budget_bytes)
                progress.update(record.step, f"loss {row['loss']:.4f} | {text}", {"loss": f"{row['loss']:.4f}",
                                **figures}, eval_loss=row.get("eval_loss"))
                # the step the patience ran out at is the run's last: its checkpoint says so to a resume
                if save(record.step, force=patience.stop and c.save_every is not False, row=row):
                    saved_at, latest = record.step, (record.step, at(record.step))
                if patience.stop:
                    break
            preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
    # A step with an inf or NaN under on_nonfinite: raise changed nothing (engine/step.py): the
    # last whole step is saved first. `records`: where its rows came from, where the stage knows.
    # Steps that kept being skipped save nothing: every step failed from that state, and the last
    # checkpoint is of a step before them.
    except NonFiniteError as e:
        if c.on_nonfinite != "raise":
            raise NonFiniteError(f"{e}; {resume.stopped(c, run_dir, engine.steps_done, latest)}") from e
        latest, unsaved = _saved_on_stop(save_now, engine.steps_done, latest)
        raise NonFiniteError(resume.failed_step(c, run_dir, engine.last_step, getattr(e, "records", None), latest,
                                                unsaved)) from e
    # A save the disk refused; a step that failed after its first update (updates:
    # as_gradients_land), which left the engine to be reloaded.
    except (CheckpointError, PartialStepError) as e:
        raise type(e)(f"{e}; {resume.stopped(c, run_dir, engine.steps_done, latest)}") from e
    except KeyboardInterrupt:       # Ctrl-C, SIGINT not among stop_signals: the step in flight left whole undone
        print(f"\n  interrupted    {resume.stopped(c, run_dir, engine.steps_done, latest)} (with SIGINT among "
              "stop_signals, Ctrl-C finishes the step in flight and saves it first)", file=sys.stderr, flush=True)
        raise
    finally:
        progress.close()
        log.close()
    elapsed = time.perf_counter() - started
    steps_done = engine.steps_done
    if patience.stop:
        print(patience.line(steps_done), flush=True)
    place = trained_model.folder(c, run_dir)        # a post-training stage needs a Hugging Face model: never None
    said = best.load(engine, at, written=place is not None)
    if said:
        print(said, flush=True)
    # the bundled model is a checkpoint: the last, or the best one loaded
    model = place or (at(best.step) if said else latest[1])
    if place is not None:
        # overwrite: only a resumed run gets here with model files in the folder, its own (check_new_run)
        trained_model.write(c, engine, stage.tokenizer, place, overwrite=resume_from is not None,
                            policy=stage.objective is not None)
    # The last training plan used: micro-batches of other shapes or image grids than the first
    # inputs' run plans of their own, and the first inputs' may never have run.
    plan = engine.plan
    measured = plan.measured_peak_bytes
    result = {"steps": steps_done, "skipped_steps": engine.skipped_steps, "run_dir": run_dir,
              "first_loss": losses_seen[0] if losses_seen else None,
              "final_loss": losses_seen[-1] if losses_seen else None,
              "seconds": elapsed, "last_checkpoint": saved_at, "budget_bytes": plan.budget_bytes,
              "predicted_device_peak_bytes": plan.predicted_peak_bytes,
              "measured_device_peak_bytes": measured, "model": model, "steps_run": steps_done - start_step}
    if losses_seen:
        name = "" if c.stage in ("sft", "pt") else f"{c.stage} "
        print(f"done: {name}loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {elapsed:.1f} s, "
              f"measured device peak {fmt_bytes(measured or 0)} (predicted {fmt_bytes(plan.predicted_peak_bytes)}, "
              f"budget {fmt_bytes(plan.budget_bytes)}); log in {os.path.join(run_dir, 'log.csv')}", flush=True)
    print(results.finish(c, run_dir, result, stage, engine.model, best.state(),
                         None if best.step is None else at(best.step)), flush=True)
    return result
