"""What stages dpo and kto share: the data's held-out part, and the reference's log-probabilities,
computed once before the first step (the policy at step 0 is the reference) and kept in the run
folder, where a resumed run reads them, its weights no longer being the reference's. And what
stages dpo and grpo share of a reference that moves (sync_ref_model): its updates, kept in the run
folder, and the one a resume reads."""
from __future__ import annotations

import hashlib
import os
import re

import torch

from ...errors import ArgumentError
from ...io import durable
from ...posttrain import reference_sync
from .. import intervals
from ..data.tokens import fingerprint
from ..model import check_positions
from .keys import check_resume
from .stage import CHECKPOINTS, Stage

REFERENCE = "reference_logps.pt"


def digest(rows) -> str:
    """sha256 of the token ids of `rows` (each a tuple of token-id tuples), in order: what a
    reference row belongs to."""
    h = hashlib.sha256()
    for row in rows:
        for ids in row:
            h.update(len(ids).to_bytes(4, "little"))
            h.update(torch.tensor(ids, dtype=torch.int64).numpy().tobytes())
    return h.hexdigest()


def hold_out(items: list, fraction: float, seed: int, what: str) -> tuple[list, list]:
    """`fraction` of `items` held out (a seeded draw, each part in the data's order): (train, held)."""
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(seed)).tolist()
    cut = max(1, round(fraction * len(items)))
    if cut >= len(items):
        raise ArgumentError(f"eval_fraction {fraction:g} of {len(items)} {what} leaves none to train on; give a "
                            f"smaller fraction, or more {what}")
    return [items[i] for i in sorted(order[cut:])], [items[i] for i in sorted(order[:cut])]


def kept(run_dir: str, tokens: dict, what: str) -> dict:
    """A resumed run's reference file, refused when it belongs to other tokens than `tokens`
    ({"train": digest, "eval": digest, ...}) say this run's data makes now."""
    path = os.path.join(run_dir, REFERENCE)
    if not os.path.isfile(path):
        raise ArgumentError(f"resume: {path} is missing: the reference log-probabilities cannot be made again "
                            "from trained weights; start a new run_dir")
    saved = torch.load(path)
    # Row i of the reference is item i's: items tokenised otherwise (a tokenizer or chat template
    # changed, the records edited in place) would each take another item's reference.
    if saved.get("tokens", tokens) != tokens:
        changed = " and ".join(k for k in tokens if saved["tokens"].get(k) != tokens[k])
        raise ArgumentError(f"resume: {path} holds the reference log-probabilities of other tokens than this run's "
                            f"{changed} {what} make now (the data, the tokenizer or its chat template changed since the "
                            "run began); resume with what the run began with, or start a new run_dir")
    return saved


def keep(run_dir: str, train: torch.Tensor, held: torch.Tensor | None, tokens: dict) -> None:
    """Written whole and on the disk before the first step, as every checkpoint relies on it: a
    failed write leaves no file and names the disk's state (the run stops before training)."""
    path = os.path.join(run_dir, REFERENCE)
    try:
        torch.save({"train": train, "eval": held, "tokens": tokens}, path + ".tmp")
        durable.fsync_file(path + ".tmp")
        os.replace(path + ".tmp", path)
        durable.fsync_dir(run_dir)
    except (OSError, RuntimeError) as e:
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")
        raise durable.write_failed("reference log-probabilities", path, e,
                                   needed=(train.numel() + (held.numel() if held is not None else 0)) * 4) from e


def update(reference_engine, policy, c, run_dir: str) -> None:
    """After an optimizer step, every ref_model_sync_steps (TRL's SyncRefModelCallback at the step's
    end): the policy mixed into the reference, the result kept for a resume before the step's
    checkpoint is written, and the kept updates no checkpoint reads dropped."""
    every = c.ref_model_sync_steps
    if not c.sync_ref_model or policy.steps_done % every:
        return
    reference_sync.mix(reference_engine, policy, c.ref_model_mixup_alpha)
    reference_sync.keep(reference_engine, run_dir, policy.steps_done)
    folder = os.path.join(run_dir, CHECKPOINTS)
    saved = [int(m.group(1)) for m in (re.fullmatch(r"step-(\d+)", e)
                                       for e in (os.listdir(folder) if os.path.isdir(folder) else [])) if m]
    reference_sync.prune(run_dir, policy.steps_done, {s // every * every for s in saved})


def resume(reference_engine, c, run_dir: str, steps_done: int) -> None:
    """A resumed run's reference: the model as loaded until the first update, then the last update
    before `steps_done`, read from the run folder."""
    every = c.ref_model_sync_steps
    if c.sync_ref_model and steps_done >= every:
        reference_sync.load(reference_engine, run_dir, steps_done // every * every)


class ReferenceStage(Stage):
    """A stage trained against the reference (dpo, kto): what both check and keep of the run."""
    check_resume = staticmethod(check_resume)

    @staticmethod
    def check_model(c, meta) -> None:
        check_positions(c, meta)

    def __init__(self, c, tokenizer):
        self.c, self.tokenizer = c, tokenizer
        self.fingerprint = fingerprint(c.data + c.eval, c.tokenizer or c.model, False, model_dir=c.model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)

    def held_out(self, engine, step: int, logps, reference=None) -> tuple | None:
        """The held-out items an evaluation at `step` reads (eval_batches x batch of them at most),
        their reference log-probabilities and the policy's now, `logps(engine, items)` in eval mode
        (dropout off); None when no evaluation is due. With a `reference` engine (one that moves) its
        log-probabilities are taken from it, first: the policy's run is the device's last, which the
        run's trace shows."""
        c = self.c
        if not self.held or not c.eval_every or not intervals.evaluates(c, step):
            return None
        held, ref = self.held, self.held_reference
        if c.eval_batches is not None:
            held = held[:c.eval_batches * c.batch]
            ref = ref[:c.eval_batches * c.batch] if ref is not None else None
        if reference is not None:
            ref = self.eval_logps(reference, held, logps)
        return held, ref, self.eval_logps(engine, held, logps)

    @staticmethod
    def eval_logps(engine, held: list, logps):
        """`logps(engine, held)` in eval mode (dropout off)."""
        training = engine.model.training
        engine.model.eval()
        try:
            return logps(engine, held)
        finally:
            engine.model.train(training)
