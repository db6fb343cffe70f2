"""A resume checked against the run that saved the checkpoint, from its manifest alone: before the
engine exists and before any file of the run folder is written.

    refused   other tokens (data, tokenizer, train_on_prompt), seq, packing, seed, eval_fraction:
              the saved data position (rows consumed) would count other rows; a streamed run's
              refusal names the files and settings that changed; a model configured otherwise
              (resume_model.py)
    noted     steps, epochs, lr, warmup, schedule, min_lr: the learning rate from the next step is
              the new schedule's (the note names the jump); batch, grad_accum, global_batch: the
              data goes on from the saved row, with other rows per step; betas, eps,
              weight_decay, max_grad_norm, compute_dtype: the AdamW state is kept, the new values
              apply from the next step; under load_best_model_at_end or early_stopping_patience,
              what evaluates the checkpoints (eval files, eval_batches, eval_batch, the metric and
              its direction): the best is judged afresh among the resumed run's evaluations
              (best_model.py, early_stopping.py)
    complete  the checkpoint is at or past the last step: nothing to train

A run stopped by a fault (a checkpoint it could not write, steps that kept being skipped) or a
signal names the checkpoint it goes on from and the command that does it (stopped); one stopped
by a step with an inf or NaN under on_nonfinite: raise, also the records that step read and the
setting that passes over such a step (failed_step).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

from ..errors import ArgumentError
from .config import RunConfig
from .preemption import resume_overrides
from .schedule import learning_rate

SCHEDULE = ("steps", "lr", "warmup", "schedule", "min_lr")
LATEST = "latest"       # RUN/checkpoints/latest: the run's latest committed checkpoint
ROWS = ("batch", "grad_accum", "global_batch")
OPTIMIZER = ("betas", "eps", "weight_decay", "max_grad_norm", "compute_dtype")


@dataclass
class Saved:
    """What a checkpoint says about the run that wrote it."""
    path: str
    steps_done: int
    extra: dict


def checkpoint_of(path: str) -> str:
    """`path` itself when it is a checkpoint folder; for a run folder, its checkpoints folder or
    RUN/checkpoints/latest (a name no checkpoint has), the latest committed checkpoint (what
    `megacompile export RUN` exports and `resume: RUN` goes on from)."""
    from ..io.checkpoint import MARKER, committed_beside
    from .stages.stage import CHECKPOINTS
    path = os.path.normpath(path)       # RUN/checkpoints/step-000002/ is the checkpoint
    if os.path.isfile(os.path.join(path, MARKER)):
        return path
    if os.path.basename(path) == LATEST and not os.path.exists(path):
        path = os.path.dirname(path)
    folder = path if os.path.basename(path) == CHECKPOINTS else os.path.join(path, CHECKPOINTS)
    if not os.path.isdir(folder):
        return path
    found = committed_beside(os.path.join(folder, LATEST))
    if not found:
        raise ArgumentError(f"the run folder {os.path.dirname(os.path.abspath(folder))} holds no committed checkpoint "
                            f"in {folder}: give a checkpoint folder (RUN/checkpoints/step-NNNNNN)")
    return found[-1]


def read(path: str) -> Saved:
    """The checkpoint's manifest, checked by the one schema load_checkpoint uses (io/manifest.py)
    without hashing its files: one that is uncommitted or malformed is refused now, as load_checkpoint
    would refuse it, before anything of the run folder is written."""
    from ..io.checkpoint import FORMAT, MANIFEST, MARKER, verified_manifest
    from ..io.manifest import problems
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        manifest = None
    if (not os.path.isfile(os.path.join(path, MARKER)) or not isinstance(manifest, dict)
            or manifest.get("format") != FORMAT or problems(manifest)):
        verified_manifest(path)     # raises, naming what is wrong with the folder or its manifest
    extra = manifest.get("extra") or {}
    return Saved(path, manifest["steps_done"], extra if isinstance(extra, dict) else {})


def rows_layout(c: RunConfig) -> dict:
    """What decides which rows a data position counts (packing.py cuts rows from seed and row
    index; split.py holds out eval_fraction of the tokens)."""
    # packing unset lays plain text as packing: true did (what such a checkpoint saved) and records one
    # a row: records_packed tells them apart (a checkpoint without it predates records kept whole, and
    # its records' token file differs from today's: its sha256 refuses the resume if it held any)
    layout = {"seq": c.seq, "packing": True if c.packing is None else c.packing,
              "records_packed": c.packing not in (None, False), "seed": c.seed, "eval_fraction": c.eval_fraction,
              "shuffle": not c.disable_shuffling}
    weights = [e["weight"] for e in c.data]
    if weights[0] is not None or c.streaming:     # mixture.py: the order of documents
        layout.update(mixture=[c.mix_strategy, weights], streaming=c.streaming)
    return layout


def settings(c: RunConfig) -> dict:
    """The settings a resume compares, saved with every checkpoint (steps resolved from epochs)."""
    keys = SCHEDULE + OPTIMIZER + ("epochs",)
    return {**{k: getattr(c, k) for k in keys}, "batch": None if c.global_batch else c.batch,
            "grad_accum": None if c.global_batch else c.grad_accum, "global_batch": c.global_batch}


def check_rows(c: RunConfig, saved: Saved) -> None:
    """Refuse a resume whose rows would be other rows (before the data is read)."""
    layout = rows_layout(c)
    before = saved.extra.get("rows_layout", {})
    changed = [f"{k} {before[k]!r} -> {v!r}" for k, v in layout.items() if k in before and before[k] != v]
    for k in ("mixture", "streaming"):      # saved only by mixed or streamed runs: absent is a plain run
        if before and k not in before and k in layout and layout[k]:
            changed.append(f"{k} none -> {layout[k]!r}")
        elif k in before and k not in layout and before[k]:
            changed.append(f"{k} {before[k]!r} -> none")
    if before and "eval_fraction" not in before and c.eval_fraction:
        changed.append("eval_fraction of the documents -> of the tokens")    # saved before split.py
    if changed:     # the rows a position counts would be other rows: the resumed run would see other data
        raise ArgumentError(f"{saved.path} was saved by a run that cut its rows otherwise ({', '.join(changed)}); "
                            "resume it with the same seq, packing, seed, eval_fraction, mixture and disable_shuffling, or start a "
                            "new run_dir")


def check_data(saved: Saved, fingerprint: str, same_rows=None) -> None:
    """Refuse a resume on other data than the checkpoint's. A checkpoint keeps the sources its data
    (a token file, a streamed run's or a post-training stage's fingerprint) was made from: the
    refusal names what changed.
    `same_rows(extra)`: whether the changed data still gives the rows trained on before the
    checkpoint (a streamed run reads them again to see); then the run goes on, saying so."""
    if saved.extra.get("data") == fingerprint:
        return
    from .data.tokens import sources
    before, now = saved.extra.get("data_sources"), sources(fingerprint)
    changed = data_changes(before, now) if isinstance(before, dict) and now is not None else []
    if changed and same_rows is not None and same_rows(saved.extra):
        print(f"  resume note    the data changed ({'; '.join(changed)}); the rows before the checkpoint's position "
              f"(row {saved.extra['rows']:,}), read again, are the same: going on", flush=True)
        return
    if changed:
        raise ArgumentError(f"{saved.path} was saved by a run on other data: {'; '.join(changed)}; resume it with "
                            "the same data, tokenizer and settings, or start a new run_dir")
    raise ArgumentError(f"{saved.path} was saved by a run on other tokens (token file {saved.extra.get('data')}, "
                        f"now {fingerprint}: the data, the tokenizer, its chat_template or train_on_prompt changed, or "
                        "the checkpoint predates supervised records kept whole in a row, or chats that their template "
                        "closed with the EOS taking no other); resume it with the same "
                        "data, or start a new run_dir")


def data_changes(before: dict, now: dict) -> list[str]:
    """What differs between two tokens._sources() dicts, one phrase each: data files added, gone,
    moved (the same name and size in another folder), resized or touched (the same path and size,
    another time); tokenizer files; data entries' settings; train_on_prompt, cutoff, format."""
    out = _file_changes(_files(before), _files(now))
    entries_before, entries_now = before.get("files") or [], now.get("files") or []
    if len(entries_before) != len(entries_now):
        out.append(f"{len(entries_before)} data entries -> {len(entries_now)}")
    else:
        for i, (a, b) in enumerate(zip(entries_before, entries_now)):
            keys = [k for k in dict.fromkeys([*a, *b]) if k != "files" and a.get(k) != b.get(k)]
            out += [f"data entry {i + 1} {k} {a.get(k)!r} -> {b.get(k)!r}" for k in keys]
    tok_before, tok_now = before.get("tokenizer") or {}, now.get("tokenizer") or {}
    for name in sorted({*tok_before, *tok_now}):
        if name not in tok_now:
            out.append(f"tokenizer file {name} is gone")
        elif name not in tok_before:
            out.append(f"tokenizer file {name} is new")
        elif tok_before[name] != tok_now[name]:
            out.append(f"{name} changed")
    names = {"train_on_prompt": "train_on_prompt", "cutoff": "cutoff (the row length records are cut to)",
             "format": "token format"}
    for key in dict.fromkeys([*names, *before, *now]):
        if key not in ("files", "tokenizer") and before.get(key) != now.get(key):
            out.append(f"{names.get(key, key)} {_show(before.get(key))} -> {_show(now.get(key))}")
    return out


def _files(sources: dict) -> dict[str, dict]:
    """path -> {bytes, mtime_ns} over every data entry's files."""
    return {f["path"]: f for entry in sources.get("files") or [] if isinstance(entry, dict)
            for f in entry.get("files") or [] if isinstance(f, dict) and "path" in f}


def _file_changes(before: dict[str, dict], now: dict[str, dict]) -> list[str]:
    out = []
    gone = [p for p in before if p not in now]
    new = [p for p in now if p not in before]
    moved: dict[tuple, list[str]] = {}      # (from, to) -> names: the same name and size in another folder
    for p in list(gone):
        match = next((q for q in new if os.path.basename(q) == os.path.basename(p)
                      and now[q].get("bytes") == before[p].get("bytes")), None)
        if match is not None:
            gone.remove(p)
            new.remove(match)
            moved.setdefault((os.path.dirname(p), os.path.dirname(match)), []).append(p)
    for (a, b), paths in moved.items():
        if len(paths) == 1:
            out.append(f"{os.path.basename(paths[0])} moved from {a} to {b} (same size, "
                       f"{before[paths[0]].get('bytes')} bytes: if its content is the same, move it back to {a})")
        else:
            out.append(f"{_some([os.path.basename(p) for p in paths])} moved from {a} to {b} (same sizes: if their "
                       f"content is the same, move them back to {a})")
    if gone:
        out.append(f"{_some(gone)} {'is' if len(gone) == 1 else 'are'} gone")
    if new:
        out.append(f"{_some(new)} {'is' if len(new) == 1 else 'are'} new")
    kept = [p for p in before if p in now]
    out += [f"{p} changed size ({before[p].get('bytes')} -> {now[p].get('bytes')} bytes)"
            for p in kept if before[p].get("bytes") != now[p].get("bytes")]
    touched = [p for p in kept if before[p].get("bytes") == now[p].get("bytes")
               and before[p].get("mtime_ns") != now[p].get("mtime_ns")]
    if len(touched) == 1:
        p, ns = touched[0], before[touched[0]].get("mtime_ns")
        again = f" (touch -d @{ns // 10**9}.{ns % 10**9:09d} {p})" if isinstance(ns, int) else ""
        out.append(f"{p} was touched (same path and size, another modification time: if its content is the same, "
                   f"give it back its time{again})")
    elif touched:
        out.append(f"{_some(touched)} were touched (same paths and sizes, other modification times: if their content "
                   "is the same, give them back their times)")
    return out


def _some(names: list[str], most: int = 3) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def notes(c: RunConfig, saved: Saved) -> list[str]:
    """One line per group of changed settings, saying what the change does from the next step."""
    from . import best_model, early_stopping
    judged = best_model.resume_note(c, saved) + early_stopping.resume_note(c, saved)
    before = saved.extra.get("settings")
    if not isinstance(before, dict):
        return judged       # a checkpoint of a run that saved no settings: nothing more to compare
    now, step = settings(c), saved.steps_done + 1
    out = []

    def changed(keys: tuple) -> list[str]:
        return [f"{k} {_show(before.get(k))} -> {_show(now[k])}" for k in keys if before.get(k) != now[k]]

    schedule = changed(SCHEDULE + ("epochs",))
    if schedule:
        old = learning_rate(before["lr"], before["schedule"], before["warmup"], before["min_lr"], before["steps"])
        new = learning_rate(c.lr, c.schedule, c.warmup, c.min_lr, c.steps)
        a, b = old(step), new(step)
        what = (f"the learning rate of step {step} jumps from {a:.3g} to {b:.3g}" if f"{a:.3g}" != f"{b:.3g}"
                else f"the learning rate of step {step} stays {b:.3g}")
        out.append(f"{', '.join(schedule)}: {what}, and follows the new schedule to step {c.steps}")
    rows = changed(ROWS)
    if rows:
        was = before.get("global_batch") or before["batch"] * before["grad_accum"]
        per = c.global_batch or c.batch * c.grad_accum
        what = (f"the same {per} rows per optimizer step, in other micro-batches (the gradients agree to float "
                "reassociation)" if was == per else
                f"rows per optimizer step {was} -> {per}: each step from step {step} averages {per} rows")
        out.append(f"{', '.join(rows)}: {what}; the data goes on from the saved row")
    optimizer = changed(OPTIMIZER)
    if optimizer:
        out.append(f"{', '.join(optimizer)}: the AdamW state is kept, and the new values apply from step {step}")
    return out + judged


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def complete(c: RunConfig, saved: Saved, run_dir: str) -> str | None:
    """The line that says the run is already complete, or None when steps are left to train (a run
    that stopped early, early_stopping.py, is complete)."""
    from .early_stopping import stopped
    early = saved.steps_done < c.steps and stopped(saved.extra)
    if saved.steps_done < c.steps and not early:
        return None
    at = (f"step {saved.steps_done} of {c.steps}" if saved.steps_done == c.steps
          else f"stopped early at step {saved.steps_done} of {c.steps}" if early
          else f"step {saved.steps_done}, past steps={c.steps}")
    line = f"the run in {run_dir} is already complete ({at}, checkpoint {saved.path})"
    from .trained_model import folder, missing
    place = folder(c, run_dir)
    if place is None:
        return f"{line}; nothing to do"
    what = "export" if c.export is not None else "model"
    gone = missing(place)
    if gone is None:
        return f"{line}; its {what} is in {place}; nothing to do"
    return f"{line}; its {what} {gone}: writing it from the checkpoint"


def stopped(c: RunConfig, run_dir: str, step: int, latest: tuple[int, str | None]) -> str:
    """What a run stopped after step `step` by a fault goes on from: `latest`, the (step, path) of the
    newest checkpoint it wrote or resumed from."""
    at, checkpoint = latest
    if checkpoint is None:
        return f"the run stopped after step {step} and has no checkpoint yet: the same command starts it again"
    again = resume_overrides(c, run_dir)
    command = "the same command" + (f" with {' '.join(again)}" if again else "")
    redo = ("" if step == at else f", training step {step} again" if step == at + 1
            else f", training steps {at + 1} to {step} again")
    return f"the run stopped after step {step}; {command} goes on from its last checkpoint, {checkpoint} (step {at}){redo}"


NAMED = 32     # records a failed step's message names, at most


def failed_step(c: RunConfig, run_dir: str, record, records: tuple[str, list[str]] | None,
                latest: tuple[int, str | None], unsaved: str | None = None) -> str:
    """A step whose loss or a gradient is inf or NaN under on_nonfinite: raise (`record`: its
    engine.last_step): what failed; `records`: which rows ran it, in words, and where their
    records came from (stages sft, pt, dpo, kto, rm and grpo); `latest`: the (step, path) of the newest
    checkpoint, saved as the run stopped (`unsaved`: why it could not be); and what goes on past
    the step: the same command alone would feed it the same data again."""
    at, checkpoint = latest
    done = record.step - 1
    message = (f"step {record.step} failed: {record.reason}, and on_nonfinite: raise stops the run at such a step "
               f"(nothing of step {record.step} was applied)")
    if records is not None:
        rows, where = records
        message += f"; {rows} held the record{'s' if len(where) > 1 else ''} {_by_file(where)}"
    if unsaved:
        message += f"; {unsaved}"
    skip = " ".join(["on_nonfinite=skip", *resume_overrides(c, run_dir)])
    if checkpoint is None:
        message += (f"; the run has no checkpoint yet: the same command with {skip} starts it again and passes over "
                    "such steps with a warning (on_nonfinite: skip in run.yaml)")
    else:
        redo = ("" if at == done else f", training step {done} again" if at + 1 == done
                else f", training steps {at + 1} to {done} again")
        message += (f"; its last checkpoint is {checkpoint} (step {at}{redo}): the same command with {skip} goes on "
                    "from it and passes over such steps with a warning (on_nonfinite: skip in run.yaml); as it "
                    f"is, it would feed step {record.step} the same data again")
    if records is not None:
        message += "; or look at the records named, mend or drop the bad one, and start a new run_dir (a resume " \
                   "refuses changed data)"
    return message


def _by_file(where: list[str]) -> str:
    """Records' places (`file:line`, `file line N`, `file row N`: data/reading.py), a file's
    together in order, `file (lines 3, 17, 40)`; NAMED of them at most."""
    files: dict[tuple[str, str], list[int]] = {}
    others = []
    for w in where[:NAMED]:
        found = re.fullmatch(r"(.*):(\d+)", w) or re.fullmatch(r"(.*) (line|row) (\d+)", w)
        if found is None:
            others.append(w)
        else:
            kind = "line" if found.lastindex == 2 else found[2]
            files.setdefault((found[1], kind), []).append(int(found[found.lastindex]))
    said = [f"{path}:{ns[0]}" if kind == "line" and len(ns) == 1 else f"{path} {kind} {ns[0]}" if len(ns) == 1
            else f"{path} ({kind}s {', '.join(map(str, sorted(ns)))})" for (path, kind), ns in files.items()]
    more = len(where) - NAMED
    return ", ".join(said + others) + (f" and {more} more" if more > 0 else "")


def broken_latest(path: str) -> str:
    """For a checkpoint that cannot be loaded: how the run goes on from the one before it instead."""
    from ..io.checkpoint import committed_beside
    earlier = [p for p in committed_beside(path) if os.path.abspath(p) != os.path.abspath(path)]
    if not earlier:
        return f"move {path} away to start the run afresh"
    return f"give resume={earlier[-1]} to go on from it (or move {path} away: resume: auto then takes it)"
