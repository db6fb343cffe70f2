"""Checkpoints as folders: everything training needs to continue exactly, written durably.

    ckpt/step-1000/
        owner-0003.safetensors   master/<name>, exp_avg/<name>, exp_avg_sq/<name> (and grad/<name>
                                 when saved between the micro-batches of a step) for the
                                 parameters stage 3 owns, written from the host buffers as they
                                 are (no copy of the state)
        buffers.safetensors      buffers and frozen parameters
        manifest.json            counters (among them, per parameter, the optimizer steps that
                                 gave it no gradient: `missed_steps`), optimizer settings, LR
                                 schedule, random states, the user's `extra`, and the size and
                                 sha256 of every file
        COMMITTED                written last: the folder is complete and durable

Tensors are stored under the model's parameter names, so a checkpoint outlives a change of plan,
budget or input shape. The folder is written as `.<name>.<pid>.partial`, every file fsynced,
COMMITTED written and fsynced in it, and then renamed into place (commit): a checkpoint already
at that path is moved aside, the new one renamed in, the old one deleted, so at every instant a
committed checkpoint is at the path or, between the two renames, beside it, where the next load
finds it (durable.settle). A save returns once all of it is durable; it does not overlap the next
step (it waits for running updates first).

The manifest names the run that wrote it (`run`: engine.run_id, made with the engine and taken
over by load_checkpoint, so a resumed run keeps it). keep_last=N removes older checkpoints of
this run only, never the one just written nor another run's, nor one a reader pins (rotate,
checkpoint_pin.py).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

import safetensors.torch

from ..errors import CheckpointError, MegacompileError, WeightsFileError
from . import checkpoint_path, checkpoint_pin, durable, manifest as schema, model_params, own_buffers, run_state
from . import unbuilt
from .header import read_header
from .foreign_checkpoint import describe as describe_foreign

from .source import CONST, MASTER, TABLES, Item, PendingLoad

if TYPE_CHECKING:
    from ..state import TrainingState

FORMAT = "megacompile-checkpoint/2"
MANIFEST, BUFFERS = schema.NAME, "buffers.safetensors"
MARKER = durable.MARKER


class LocalCheckpoints:
    """The checkpoint writer of one process; distributed/checkpoint.py's ShardedCheckpoints is the
    same interface for a data-parallel run (each rank writes its share into one folder)."""

    def save(self, state: "TrainingState", path: str, *, extra: Any = None, keep_last: int | None = None,
             keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
        save(state, path, extra=extra, keep_last=keep_last, keep=keep, side_files=side_files)

    def load(self, state: "TrainingState", path: str, *, strict: bool = True) -> Any:
        return load(state, path, strict=strict)


def check_keep_last(keep_last: int | None) -> None:
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1):
        raise CheckpointError(f"keep_last is how many checkpoints to keep in the folder, an int >= 1; "
                              f"got {keep_last!r}")


def save(state: "TrainingState", path: str, extra: Any = None, keep_last: int | None = None,
         keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
    check_keep_last(keep_last)
    extra = run_state.extra_json(extra)
    unbuilt.refuse_missing_weights(state)
    host = state.host       # None before the first step: the tensors come from where they wait
    parent = durable.prepare_parent(path, "checkpoint")
    path = os.fspath(path)
    if os.path.isdir(path) and os.listdir(path) and not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"cannot write the checkpoint {path}: it is a folder of other files, not a checkpoint "
                              "(which would be replaced); give a new path")
    if state.waiting_micro_batches:
        raise CheckpointError(f"cannot save {path} now: {len(state.waiting_micro_batches)} micro-batches of a "
                              "layer-major step wait for the rest of the step and would not be in it; save after "
                              "the step's last micro-batch")
    durable.clean_leftovers(parent)
    model_params.synchronize(state)
    manifest = {"format": FORMAT, **run_state.counters(state),
                "optimizer": run_state.optimizer_settings(state),
                "schedule": run_state.schedule_state(state), "rng": run_state.rng_state(), "extra": extra}
    mid_step = state.micro_batches % state.grad_accum != 0
    if mid_step:     # the parameters whose gradient sums the step's saved micro-batches made
        reached = host.reached() if host is not None else getattr(state.pending_load, "reached", None)
        manifest["step_reached"] = sorted(state.layout()[0] if reached is None else reached)
    tables = ("master", "exp_avg", "exp_avg_sq") + (("grad",) if mid_step else ())
    tmp = durable.partial_path(path)
    try:
        os.makedirs(tmp)
        manifest["files"] = {}
        for file, tensors in (_owner_files(host, tables) if host is not None else _unbuilt_files(state, tables)):
            target = os.path.join(tmp, file)
            safetensors.torch.save_file(tensors, target)     # from the tensors' own memory: no copy
            durable.fsync_file(target)
            manifest["files"][file] = {"bytes": os.path.getsize(target), "sha256": durable.sha256_of(target)}
        commit(tmp, path, manifest, side_files)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and not isinstance(e, MegacompileError):
            raise durable.write_failed("checkpoint", path, e, needed=size(state, tables)) from e
        raise
    rotate(path, manifest["run"], keep_last, keep)


def size(state: "TrainingState", tables: tuple) -> int:
    """The bytes of the tensors a save of `tables` writes, the files' small headers aside: float32
    elements of each table (a grad saved in bfloat16 takes less), buffers and frozen weights in their
    own dtype."""
    trainable, _ = state.layout()
    elements = sum(math.prod(shape) for shape in trainable.values())
    if state.host is not None:
        consts = sum(t.nbytes for t in state.host.consts.values())
    else:
        consts = sum(lazy.numel() * lazy.dtype.itemsize for lazy in unbuilt.tables(state)[1].values())
    return 4 * elements * len(tables) + consts


def commit(tmp: str, path: str, manifest: dict, side_files: dict[str, str] | None = None) -> None:
    """The end of every save (this module's and distributed/checkpoint.py's): the side files (text
    beside the tensors that no load reads, such as a run's trainer_state.json), the manifest, then
    COMMITTED (the manifest's sha256), written and fsynced in the finished folder `tmp`, which then
    takes the place of `path` (durable.rename_into_place). The checkpoint it replaces stays committed
    at `path`, or moved aside beside it, until the new one, already committed, is there."""
    for name, text in (side_files or {}).items():
        if os.path.basename(name) != name or name.startswith(".") or name in (MANIFEST, MARKER, *manifest["files"]):
            raise CheckpointError(f"cannot write the checkpoint {path}: side file {name!r} is no plain file name of "
                                  "its own (the checkpoint's own files and paths are refused)")
        durable.write_text(os.path.join(tmp, name), text)
    durable.write_text(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
    durable.write_text(os.path.join(tmp, MARKER), durable.sha256_of(os.path.join(tmp, MANIFEST)) + "\n")
    durable.fsync_dir(tmp)
    durable.rename_into_place(tmp, path)


def rotate(path: str, run: str, keep_last: int | None, keep: tuple[str, ...] = ()) -> None:
    """keep_last: remove the older committed checkpoints of run `run` beside `path` (just written),
    so that `path` and the keep_last - 1 latest others of the run remain. `keep`: checkpoints that
    stay whatever their age (a run's best, as transformers' Trainer keeps its best beside its
    save_total_limit), counted among the keep_last where they are older. Checkpoints of other runs
    (another run id, or none: written before checkpoints named their run) are never touched."""
    if keep_last is None:
        return
    kept = {os.path.abspath(p) for p in keep} - {os.path.abspath(path)}
    mine = [p for p in committed_beside(path, run=run) if os.path.abspath(p) != os.path.abspath(path)]
    others = [p for p in mine if os.path.abspath(p) not in kept]
    # fewer than the others to keep: none goes (a negative cut would slice from the end)
    # one pinned by a reader (an export of it: checkpoint_pin.py) stays, until a rotation after its release
    for old in others[:max(0, len(others) - max(0, keep_last - 1 - (len(mine) - len(others))))]:
        checkpoint_pin.remove_unless_pinned(old, remove)


def _owner_files(host, tables: tuple) -> Iterator[tuple[str, dict]]:
    """One file per owner, of views of its flat buffers, and one of buffers and frozen weights."""
    by_owner: dict[int, list[str]] = {}
    for name, slot in host.slots.items():
        by_owner.setdefault(slot.owner, []).append(name)
    for owner, names in by_owner.items():
        yield f"owner-{owner:04d}.safetensors", {f"{t}/{n}": host.view(t, n) for t in tables for n in names}
    yield BUFFERS, {f"{CONST}/{n}": t for n, t in host.consts.items()}


def _unbuilt_files(state: "TrainingState", tables: tuple) -> Iterator[tuple[str, dict]]:
    """Before host state exists: one file per parameter (its tensors made one table at a time)."""
    trainable, consts = unbuilt.tables(state)
    for i, name in enumerate(trainable[MASTER]):
        yield f"param-{i:05d}.safetensors", {f"{t}/{name}": trainable[t][name]() for t in tables}
    yield BUFFERS, {f"{CONST}/{n}": lazy() for n, lazy in consts.items()}


def committed_beside(path: str, run: str | None = None) -> list[str]:
    """The committed checkpoints in `path`'s folder (it included, if committed), oldest first by
    (step, micro-batch, time written); with `run`, those of that run only. A replacement cut short
    by a kill is undone first (durable.clean_leftovers), so its committed checkpoint is listed."""
    parent = os.path.dirname(os.path.abspath(path))
    durable.clean_leftovers(parent)
    found = []
    for entry in os.listdir(parent):
        full = os.path.join(parent, entry)
        if entry.startswith(".") or not os.path.isfile(os.path.join(full, MARKER)):
            continue
        try:
            with open(os.path.join(full, MANIFEST)) as f:
                m = json.load(f)
        except (OSError, ValueError):
            continue
        steps, micro = m.get("steps_done"), m.get("micro_batches")
        # a manifest without its counts is no checkpoint to rank (load_checkpoint refuses it by name)
        if (m.get("format") == FORMAT and type(steps) is int and type(micro) is int
                and (run is None or m.get("run") == run)):
            found.append(((steps, micro, os.path.getmtime(os.path.join(full, MARKER))), full))
    return [p for _, p in sorted(found)]


def remove(path: str) -> None:
    """Renamed out of the way first (atomic), then deleted: a removal cut short leaves a
    `.<name>.<pid>.removed` folder that the next save or load deletes, never a broken checkpoint."""
    parent, name = os.path.split(os.path.abspath(path))
    trash = os.path.join(parent, f".{name}.{os.getpid()}.removed")
    os.rename(path, trash)
    durable.fsync_dir(parent)
    shutil.rmtree(trash, ignore_errors=True)


def _refuse(path: str, why: str) -> WeightsFileError:
    good = [p for p in committed_beside(path) if os.path.abspath(p) != os.path.abspath(path)] \
        if os.path.isdir(os.path.dirname(os.path.abspath(path))) else []
    hint = (f"the last committed checkpoint beside it is {good[-1]}" if good
            else "no committed checkpoint lies beside it")
    return WeightsFileError(f"cannot load the checkpoint {path}: {why}; nothing was loaded; {hint}")


def verified_manifest(path: str) -> dict:
    """The manifest of a committed checkpoint whose every file has the size and sha256 it lists."""
    if not os.path.isdir(path):
        raise _refuse(path, "there is no checkpoint folder there")
    marker = os.path.join(path, MARKER)
    if not os.path.isfile(marker):
        foreign = describe_foreign(path)
        raise _refuse(path, f"it is {foreign}" if foreign else f"it is not committed (no {MARKER}: its save did not finish)")
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            text = f.read()
        manifest = json.loads(text)
        with open(marker) as f:
            sealed = f.read().strip()
    except (OSError, ValueError) as e:
        raise _refuse(path, f"its manifest is unreadable ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _refuse(path, f"it is not a {FORMAT} checkpoint")
    if durable.sha256_of(os.path.join(path, MANIFEST)) != sealed:
        raise _refuse(path, "its manifest does not match its commit marker (changed after the save)")
    wrong = schema.problems(manifest)
    if wrong:
        raise _refuse(path, f"its {MANIFEST} does not hold what a save writes: {'; '.join(wrong[:4])}")
    for file, info in manifest["files"].items():
        full = os.path.join(path, file)
        if not os.path.isfile(full):
            raise _refuse(path, f"{file} is missing")
        size = os.path.getsize(full)
        if size != info["bytes"]:
            raise _refuse(path, f"{file} has {size} bytes, the manifest says {info['bytes']} (truncated?)")
        if durable.sha256_of(full) != info["sha256"]:
            raise _refuse(path, f"{file} does not match its sha256 checksum (corrupted)")
    return manifest



@dataclass
class Reading:
    """A checked checkpoint, read but not yet applied: what restore() gives the state."""
    weights: Any            # PendingLoad of its tensors (apply(host, model))
    counters: dict          # for Counters.load_state_dict
    param_group: dict       # the LR handle's saved learning rate, where it is restored
    schedule: dict          # the saved LR schedule: the handle's param group, attached schedulers
    rng: dict
    notes: list[str]        # warnings to give once it is applied
    extra: Any


def load(state: "TrainingState", path: str, strict: bool = True) -> Any:
    """load_checkpoint in one process: a checkpoint folder (or a one-file checkpoint of the
    format before) checked, then applied; returns its `extra`."""
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        _check_arguments(path, strict)
        from .legacy_checkpoint import load as load_single_file   # the one-file format written before folders
        load_single_file(state, os.fspath(path))
        return None
    reading = read(state, path, strict)
    restore(state, reading)
    return reading.extra


def restore(state: "TrainingState", reading: Reading) -> None:
    """Apply a checkpoint read: weights, counters and learning rate (TrainingState.restore), LR
    schedulers, random state; then the warnings."""
    state.restore(reading.weights, reading.counters, param_group=reading.param_group)
    notes = reading.notes + run_state.restore_schedulers(state, reading.schedule)
    run_state.restore_rng(reading.rng)
    for message in notes:
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _check_arguments(path: Any, strict: Any) -> None:
    if not isinstance(path, (str, os.PathLike)):
        raise MegacompileError(f"load_checkpoint takes a checkpoint folder path, got {path!r}")
    if not isinstance(strict, bool):
        raise MegacompileError(f"load_checkpoint(strict=...) is True (refuse a checkpoint whose settings or "
                               f"model-built buffers differ from this engine's) or False (keep this engine's); "
                               f"got {strict!r}")
    wrong_path = checkpoint_path.refusal(os.fspath(path))
    if wrong_path is not None:
        raise wrong_path


def read(state: "TrainingState", path: str, strict: bool = True, layout: tuple | None = None) -> Reading:
    """Check a checkpoint folder against the state, changing nothing. layout: what its tensors
    must fit, state.layout() by default."""
    _check_arguments(path, strict)
    path = os.fspath(path)
    if os.path.isdir(os.path.dirname(os.path.abspath(path))):
        durable.settle(path)      # a replacement cut short or under way: its committed checkpoint back at `path`
    manifest = verified_manifest(path)
    trainable, const = state.layout() if layout is None else layout
    items, problems = [], []
    mid_step = manifest["micro_batches"] % manifest["optimizer"]["grad_accum"] != 0
    tables = (MASTER,) + TABLES[:2] + (("grad",) if mid_step else ())
    seen = set()
    for file in manifest["files"]:
        full = os.path.join(path, file)
        for key, entry in read_header(full).items():
            table, _, name = key.partition("/")
            own = trainable.get(name) if table in tables else const.get(name) if table == CONST else None
            if own is None:
                problems.append(f"{file} holds {key}, which this model has no place for")
            elif entry.shape != own:
                problems.append(f"{key} has shape {entry.shape}, the model has {own}")
            else:
                items.append(Item(full, key, table, name))
                seen.add(key)
    problems += [f"{t}/{n} is missing" for t in tables for n in trainable if f"{t}/{n}" not in seen]
    missed = manifest.get("missed_steps", {})
    problems += [f"missed_steps names {n}, which is no trainable parameter of this model" for n in missed
                 if n not in trainable]
    problems += [f"missed_steps gives {n} {k} steps without a gradient, more than the {manifest['steps_done']} "
                 "steps done" for n, k in missed.items() if k > manifest["steps_done"]]
    reached = manifest.get("step_reached")
    problems += [f"step_reached names {n}, which is no trainable parameter of this model" for n in reached or ()
                 if n not in trainable]
    if mid_step and manifest["optimizer"]["grad_accum"] != state.grad_accum:
        k = manifest["optimizer"]["grad_accum"]
        problems.append(f"it was saved mid-step with grad_accum={k}, this engine has grad_accum={state.grad_accum}: "
                        f"compile with grad_accum={k} to resume it")
    if problems:
        raise MegacompileError(f"the checkpoint {path} does not match this model: {'; '.join(problems[:4])}; "
                               "nothing was loaded")
    differences = run_state.setting_differences(manifest["optimizer"], state)
    exempt = run_state.no_decay_difference(manifest["optimizer"], state)
    buffers = own_buffers.differing(state, items)
    if (differences or exempt or buffers) and strict:
        raise MegacompileError(
            f"the checkpoint {path} differs from this engine and model: "
            f"{'; '.join(differences + [exempt] * bool(exempt) + [f'buffer {n}: {d}' for n, d in buffers.items()])}; "
            "nothing was loaded "
            f"(strict=False loads it and keeps this engine's settings and the model's own buffers"
            + (": a buffer the model computes from its config, such as rotary inv_freq from rope_theta, says "
               "the config differs from the saving run's" if buffers else "") + ")")
    # The model's own buffers win (strict=False): they are loaded first and nothing overwrites them.
    items = [it for it in items if not (it.table == CONST and it.name in buffers)]
    pending = PendingLoad(items, own_buffers=bool(buffers), needs=tables, describe=f"the checkpoint {path}",
                          reached=(frozenset(trainable if reached is None else reached) if mid_step else None))
    notes = [f"the checkpoint {path} was saved with other settings, this engine's are kept: "
             f"{'; '.join(differences)}"] * bool(differences) + [
             f"the checkpoint {path} was saved with other parameters exempt from weight decay, this engine's AdamW "
             f"no_decay is kept: {exempt}"] * bool(exempt) + [
             f"the checkpoint {path} holds other values of buffers the model built itself; the model's own "
             f"are kept: {'; '.join(f'{n}: {d}' for n, d in buffers.items())}"] * bool(buffers)
    # The counters take the saved run's id too: keep_last rotates the resumed run's checkpoints.
    return Reading(pending, run_state.saved_counters(manifest),
                   run_state.saved_param_group(manifest, state), manifest["schedule"],
                   manifest["rng"], notes, manifest.get("extra"))
