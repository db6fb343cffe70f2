"""A post-training run (`stage: dpo | grpo`) from its settings to the trained policy: the SFT
loop's order (every check before the run folder is written; checkpoints and resume; the trained
policy in its folder, trained_model.py), with the stage (dpo_stage.py, grpo_stage.py) making each
optimizer step and its log row.

    settings -> checks (seq against the model; a resume against its checkpoint)
             -> data read and tokenised (in memory) -> checks (the resume's data)
             -> engine over the stage's objective -> resume? -> stage.begin -> steps
             -> per step: CSV row; checkpoint every save_every (the stage's state in it)
             -> final checkpoint, the trained policy in its folder

A stage is an object with `columns` (its log's), `objective(policy)`, `first_inputs(batch)` (a
training step's inputs, for their shapes), `begin(engine, run_dir, saved)`, `step(engine,
position) -> (row, position)` and `state()` (what its checkpoint carries beside the data position).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
import warnings

from ..errors import ArgumentError
from ..ir.printer import fmt_bytes
from . import finetune, resume, rollout_generator, trained_model
from .config import RunConfig
from .log import Progress, RunLog
from . import preemption
from .loop import CHECKPOINTS, checkpoint_path, save_checkpoint, starting_point
from .model import build, check_positions, meta_model
from .preemption import StopSignals
from .schedule import warmup_steps
from .skip_streak import SkipStreak
from .stages import ALL_KEYS, IMPLIED, KEYS
from .tokens import fingerprint, load_tokenizer

BASE_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "seconds", "tokens_per_s", "device_peak_bytes",
                "predicted_device_peak_bytes", "skipped")


def saved_keys(c: RunConfig) -> dict:
    """The post-training keys a resume keeps (a checkpoint of another stage or other keys is refused)."""
    return {"stage": c.stage, **{k: getattr(c, k) for k in ALL_KEYS if k not in rollout_generator.MAY_CHANGE}}


def check_resume(c: RunConfig, saved: resume.Saved) -> None:
    before, now = saved.extra.get("stage") or {"stage": "sft"}, saved_keys(c)
    if not isinstance(before, dict):
        before = {"stage": "sft"}
    if before.get("stage") == "grpo":
        before = {**rollout_generator.IMPLIED, **before}
    if before.get("stage") in ("dpo", "grpo"):
        before = {**{k: v for k, v in IMPLIED.items() if k in KEYS[before["stage"]]}, **before}
    changed = [f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in now if before.get(k) != now[k]]
    if changed:
        raise ArgumentError(f"resume: {saved.path} was saved by a run with other post-training keys "
                            f"({', '.join(changed)}); a resume keeps them: set them back, or start a new run_dir")


def _stage(c: RunConfig, tokenizer):
    if c.stage == "dpo":
        from .dpo_stage import DPOStage
        return DPOStage(c, tokenizer)
    from .grpo_stage import GRPOStage
    return GRPOStage(c, tokenizer)


def _check_row_length(c: RunConfig, model) -> None:
    """A row longer than the model's positions is refused naming the keys that set its length: seq
    for dpo, max_prompt_length + max_completion_length for grpo (which takes no seq)."""
    if c.stage != "grpo":
        check_positions(c, model)
        return
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(limit, int) and c.seq > limit:
        raise ArgumentError(f"max_prompt_length {c.max_prompt_length:,} + max_completion_length "
                            f"{c.max_completion_length:,} = {c.seq:,} tokens a row, longer than the model's "
                            f"max_position_embeddings, {limit:,}: lower max_prompt_length or max_completion_length "
                            f"so that they add up to at most {limit:,}")


def run(c: RunConfig, trace: str | None = None) -> dict:
    """Post-train as `c` says (c.stage dpo or grpo); returns the figures the final line prints."""
    run_dir, resume_from, saved = starting_point(c)
    meta = meta_model(c)
    _check_row_length(c, meta)
    meta = finetune.apply(c, meta)
    if saved is not None:
        resume.check_rows(c, saved)
        finetune.check_resume(c, saved.extra)
        check_resume(c, saved)
    tokenizer_dir = c.tokenizer or c.model
    tokenizer = load_tokenizer(tokenizer_dir)
    stage = _stage(c, tokenizer)        # reads and checks the data: a refusal leaves nothing written
    data = fingerprint(c.data + c.eval, tokenizer_dir, False)
    if saved is not None:
        resume.check_data(saved, data)
    if c.steps is None:
        c.steps = stage.steps_for(c.epochs)
    c.warmup = warmup_steps(c.warmup, c.steps)
    os.makedirs(run_dir, exist_ok=True)
    done = saved is not None and resume.complete(c, saved, run_dir)
    if done:
        print(f"  complete       {done}", flush=True)
        place = trained_model.folder(c, run_dir)
        if place is None or trained_model.holds_model(place):
            print(trained_model.last_line(c, place, saved.path), flush=True)
            return {"steps": saved.steps_done, "run_dir": run_dir, "first_loss": None, "final_loss": None,
                    "seconds": 0.0, "last_checkpoint": saved.steps_done, "complete": True, "model": place}
    elif saved is not None:
        for note in resume.notes(c, saved):
            print(f"  resume note    {note}", flush=True)
    setup = build(c, meta, stage.first_inputs, wrap=stage.objective)
    if getattr(stage, "needs_reference", False):     # the model as loaded, forward only
        try:
            stage.reference = build(c, meta, stage.first_inputs, wrap=stage.objective).engine
        except BaseException:
            setup.engine.close()
            raise
    try:
        result = _train(c, setup, stage, run_dir, resume_from, tokenizer, data)
        if result["first_loss"] is not None:
            from ..report.outputs import write_run_views
            write_run_views(setup.engine, run_dir, trace)
        print(trained_model.last_line(c, result["model"], None), flush=True)
        return result
    finally:
        setup.engine.close()
        stage.close()


def _train(c: RunConfig, setup, stage, run_dir: str, resume_from: str | None, tokenizer, data: str) -> dict:
    engine = setup.engine
    plan = engine.prepare(**stage.first_inputs(setup.batch))
    position, extra = 0, None
    if resume_from is not None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            extra = engine.load_checkpoint(resume_from, strict=False) or {}
        position = int(extra["rows"])
        for message in dict.fromkeys(str(w.message) for w in caught):
            if "was saved with other settings" not in message:
                print(f"  resume note    {message}", flush=True)
        print(f"  resumed        from {resume_from} at step {engine.steps_done}", flush=True)
    print(plan.summary(), flush=True)
    print(f"  stage          {c.stage}: {stage.describe()}; {c.steps} steps", flush=True)
    plan.dump(os.path.join(run_dir, "plan"))
    stage.begin(engine, run_dir, extra)
    start_step = engine.steps_done
    log = RunLog(run_dir, c.log, start_step, settings=dataclasses.asdict(c), columns=BASE_COLUMNS + stage.columns)
    progress = Progress(c.steps, start_step, c.log_every)
    checkpoints = os.path.join(run_dir, CHECKPOINTS)
    saved_at, losses_seen, started = None, [], time.perf_counter()
    latest = (start_step, resume_from) if resume_from is not None else (0, None)    # (step, checkpoint)

    def save_now() -> str:
        save_checkpoint(c, engine, checkpoints, engine.steps_done, position, data, force=True, stage=saved_keys(c),
                        **stage.state())
        return checkpoint_path(checkpoints, engine.steps_done)

    skips = SkipStreak(c.max_consecutive_skips)
    try:
        with StopSignals(c.stop_signals) as stop_signals:
            while engine.steps_done < c.steps:
                preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
                t0 = time.perf_counter()
                metrics, losses, tokens, position = stage.step(engine, position)
                record = engine.last_step
                seconds = time.perf_counter() - t0
                if None in losses:      # layer-major accumulation: the losses exist once the last micro-batch ran
                    losses = (list(engine.accumulated_losses) if record.updated
                              else [x for x in losses if x is not None])
                row = {"step": record.step, "loss": sum(losses) / len(losses) if losses else math.nan,
                       "lr": record.lr, "grad_norm": record.grad_norm, "tokens": tokens, "seconds": seconds,
                       # a skipped step's record may count no tokens (the stage reports what it read)
                       "tokens_per_s": tokens / seconds if tokens is not None else math.nan,
                       "device_peak_bytes": record.device_peak_bytes,
                       "predicted_device_peak_bytes": record.predicted_device_peak_bytes, "skipped": record.skipped,
                       **metrics}
                if not record.skipped:
                    losses_seen.append(row["loss"])
                    row.update(stage.evaluate(engine, record.step))
                log.write(row)
                if record.skipped:
                    skips.skipped(record)
                else:
                    skips.updated()
                progress.update(record.step, f"loss {row['loss']:.4f} | " + stage.progress(row),
                                {"loss": f"{row['loss']:.4f}"})
                if save_checkpoint(c, engine, checkpoints, record.step, position, data, stage=saved_keys(c),
                                   **stage.state()):
                    saved_at, latest = record.step, (record.step, checkpoint_path(checkpoints, record.step))
            preemption.stop(stop_signals, c, engine.steps_done, latest, save_now, run_dir)
    finally:
        progress.close()
        log.close()
    elapsed = time.perf_counter() - started
    place = trained_model.folder(c, run_dir)        # a stage needs a Hugging Face model: never None
    trained_model.write(c, engine, tokenizer, place, overwrite=resume_from is not None, policy=True)
    result = {"steps": engine.steps_done, "run_dir": run_dir, "first_loss": losses_seen[0] if losses_seen else None,
              "final_loss": losses_seen[-1] if losses_seen else None, "seconds": elapsed, "last_checkpoint": saved_at,
              "budget_bytes": plan.budget_bytes, "model": place}
    if losses_seen:
        print(f"done: {c.stage} loss {result['first_loss']:.3f} -> {result['final_loss']:.3f} in {elapsed:.1f} s, "
              f"device budget {fmt_bytes(plan.budget_bytes)}; log in {os.path.join(run_dir, 'log.csv')}", flush=True)
    return result
