"""stage: sft, the run's step as one stage among others: token files made once from the records
(supervised records truncated to the row), rows (packed, isolated or one document each), an
optimizer step of micro-batches, and the held-out loss and perplexity every eval_every steps.
Stage pt is the same step over records read as text (data/pretrain.py)."""
from __future__ import annotations

import math
import os
from contextlib import nullcontext

import numpy as np
import torch

from ...errors import ArgumentError, NonFiniteError
from ...ir import fmt_bytes
from .. import intervals
from .. import methods, router_loss, tokenized, vocab
from ..config import RunConfig
from ..data import grid_images, image_plans, images, mixture, origins, packing, split, streaming, tokens, trim
from ..data.tokens import TokenFile, load_tokenizer, token_file
from ..log import COLUMNS
from ..model import check_isolation, check_positions
from ...posttrain import DFTObjective, EAFTObjective
from . import held_out
from .keys import check_resume, saved_keys
from .stage import Stage
from .epochs import steps as epoch_steps


class SFTStage(Stage):
    columns = COLUMNS
    check_resume = staticmethod(check_resume)       # a run goes on with the loss_type it began with

    @staticmethod
    def check_model(c: RunConfig, meta) -> None:
        if c.packing == "isolated":
            check_isolation(meta)     # before the data is read: the model decides whether it can be done
        check_positions(c, meta)

    def __init__(self, c: RunConfig, run_dir: str, router: bool = False):
        """Reads the data into token files in the run folder's staging place (committed by
        commit(), dropped by discard()) and checks it against the settings. `router`: the model's
        own loss holds its routers' term (router_loss.on), so the micro-batches carry an
        attention_mask (the term counts more than the targets: data/packing.py; not under isolated
        packing, where transformers keeps packed documents apart by their position ids only when
        no attention_mask is given) and each adds its whole term to the step (WholeTerm)."""
        self.c, self.shifted = c, c.bundled
        if c.compute_accuracy:
            self.columns = COLUMNS + ("eval_accuracy",)
        self.names = eval_names(c) if c.eval_on_each_dataset else []
        self.columns = self.columns + tuple(f"eval_{name}_{figure}" for name in self.names
                                            for figure in ("loss", "perplexity")
                                            + (("accuracy",) if c.compute_accuracy else ()))
        router = router and not c.bundled
        self.padding_mask = router and c.packing != "isolated"
        # The routers' term of a token-weighted step, each micro-batch's whole (router_loss.py); the
        # DFT loss is the logits' alone, without the model's own loss or the term (as TRL's).
        self.whole_router = router and c.loss_type not in ("dft", "eaft")
        # A step's rows cut after their longest document (data/trim.py): not where the routers' term
        # may count padding, nor NEFTune's noise (scaled by the row's length), nor over streamed rows
        # (read once, in order)
        self.trim = c.trim_padding and c.retrace and not router and not c.neftune_noise_alpha and not c.streaming
        if c.loss_type == "dft":        # the model under the DFT loss; the cross-entropy is its own
            self.objective = lambda model: DFTObjective(model, shifted=self.shifted)
        elif c.loss_type == "eaft":
            self.objective = lambda model: EAFTObjective(model, c.eaft_alpha, shifted=self.shifted)
        elif self.whole_router:
            self.objective = router_loss.WholeTerm
        self.tokenizer, self.made, self.rows, self.eval_rows, self.fingerprint = _data(c, run_dir, c.seq + self.shifted)
        self.media = self.tokenizer if isinstance(self.tokenizer, images.Media) else None
        self.plans = image_plans.ImagePlans() if self.media is not None else None
        try:
            if c.streaming:     # a token file's fingerprint is its tokens' sha256; a stream's is its sources'
                self.tokenized = tokenized.made({"train": self.rows.first(tokenized.FIRST)}, "record")
            self.each_rows = _each(self.eval_rows, self.names) if self.names else []
            available = self.rows.epoch_tokens
            # records one a row are padded to seq whatever its length (trim_padding cuts the padding)
            if available is not None and c.seq > available and not getattr(self.rows, "one_a_row", False):
                raise ArgumentError(f"seq {c.seq:,} is longer than the training data, {available:,} tokens"
                                    f"{' (after eval_fraction)' if c.eval_fraction else ''}: every row would be "
                                    f"mostly padding; give seq <= {available:,}, or more data")
            _check_images(c, self.rows)
        except BaseException:
            self.discard()
            raise

    def steps_for(self, epochs: float) -> int:
        return epoch_steps(self.c, self.rows.rows_per_epoch, epochs)

    def epoch_items(self) -> tuple[int, str] | None:
        return None if self.c.streaming else (self.rows.rows_per_epoch, "rows")

    def commit(self, run_dir: str) -> None:
        for made in self.made:
            if made is not None:
                tokens.commit(made, os.path.join(run_dir, "tokens"))

    def discard(self) -> None:
        for made in self.made:
            if made is not None:
                tokens.discard(made)

    def first_inputs(self, batch: int) -> dict:
        return self._scaled(packing.batch(self.rows, 0, batch, shifted=self.shifted, padding_mask=self.padding_mask))

    def _scaled(self, inputs: dict, scale: float = 1.0) -> dict:
        """`inputs` with the routers' term scaled (WholeTerm's input) where the objective takes one."""
        if self.whole_router:
            inputs[router_loss.SCALE] = torch.tensor(scale, dtype=torch.float32)
        return inputs

    def heaviest_inputs(self, batch: int) -> dict | None:
        """A micro-batch of the `batch` rows of an epoch with the most image tokens (None without
        images): the default budget fits it too, not only the first micro-batch, whose images may
        be fewer or smaller than a later one's."""
        rows = self.rows
        if not getattr(getattr(rows, "tokens", None), "images", None) or not rows.rows_per_epoch:
            return None
        # An image's tokens where they depend on its size (Qwen's grids), else the image count.
        width = getattr(self.tokenizer, "width", lambda path, where: 1)
        load = [sum(width(p, p) for p in rows.images(i)) for i in range(rows.rows_per_epoch)]
        if not any(load):
            return None
        heaviest = sorted(sorted(range(len(load)), key=lambda i: -load[i])[:batch])
        return self._scaled(packing.batch_of(rows, heaviest, shifted=self.shifted, padding_mask=self.padding_mask))

    def begin(self, engine, run_dir: str, saved: dict | None, batch: int) -> None:
        self.batch = batch      # the micro-batch: given, or the planner's choice for global_batch

    def describe(self, setup) -> list[str]:
        c, plan = self.c, setup.engine.plan
        epoch = f", {self.rows.rows_per_epoch} rows an epoch" if self.rows.rows_per_epoch else ""
        return [f"weights        {fmt_bytes(setup.weight_bytes)} in {c.compute_dtype}; budget is "
                f"{100 * plan.budget_bytes / setup.weight_bytes:.0f}% of them",
                f"batch          {setup.batch} x {setup.grad_accum} accumulated x {c.seq} tokens per optimizer "
                f"step; {c.steps} steps{epoch}"] + \
            (["loss           dft: each token's cross-entropy weighted by its probability (eval: the cross-entropy)"]
             if c.loss_type == "dft" else []) + \
            ([f"loss           eaft: each token's cross-entropy weighted by (its top-20 entropy / 3) ** "
              f"{c.eaft_alpha:g} (eval: the cross-entropy)"] if c.loss_type == "eaft" else []) + \
            (["loss           pt: the cross-entropy of every token of each record's text, no chat template"]
             if c.stage == "pt" else [])

    def step(self, engine, position: int) -> tuple[dict, list, int, int]:
        """The micro-batches of one optimizer step from row `position` on (rows all prompt or
        padding are passed over: their loss would be 0/0), each weighted by its share of the
        step's target tokens, as transformers' Trainer weighs them (num_items_in_batch): the step
        trains the mean over all its target tokens, not the mean of its micro-batches' means."""
        drawn = []          # (inputs, target tokens, the position after them)
        needed = 0
        while len(drawn) < engine.grad_accum:
            inputs = packing.batch(self.rows, position, self.batch, shifted=self.shifted,
                                   padding_mask=self.padding_mask)
            counted = packing.target_count(inputs, shifted=self.shifted)
            if counted:
                drawn.append((inputs, counted, position + self.batch))
                if self.trim:
                    needed = max(needed, trim.filled(self.rows, position, self.batch, self.shifted))
            position += self.batch
        # every micro-batch of the step at one length, one program for all; rows with images whole
        if needed and all(set(inputs) <= trim.TEXT for inputs, _, _ in drawn):
            columns = trim.length(needed, drawn[0][0]["input_ids"].shape[1])
            drawn = [(trim.trimmed(inputs, columns), counted, after) for inputs, counted, after in drawn]
        total = sum(counted for _, counted, _ in drawn)
        self.weights = [counted / total for _, counted, _ in drawn]
        losses, count = [], 0
        for (inputs, _, after), weight in zip(drawn, self.weights):
            # the run's own few lengths (trim.PARTS) and its images' sizes, said in its own words
            with trim.own_lengths(bool(needed)), (self.plans.over(inputs) if self.plans else nullcontext()):
                try:
                    losses.append(engine.weighted_step(weight, **self._scaled(inputs, 1.0 / weight)))
                except NonFiniteError as e:     # on_nonfinite: raise; the run's error names the records
                    # A loss is its micro-batch's, when each ran alone; a gradient (or a loss of a
                    # layer-major step, which ran them all at once) is the step's.
                    alone = engine.last_step.skipped == "loss" and None not in losses
                    e.records = self._records([after - self.batch] if alone else [a - self.batch for _, _, a in drawn])
                    raise
            position = after
            record = engine.last_step
            count += record.tokens or 0      # a skipped step counts none
            if record.skipped:
                break
        return {}, losses, count, position

    def _records(self, firsts: list[int]) -> tuple[str, list[str]] | None:
        """The micro-batches starting at rows `firsts`, in words, and where each of their records
        came from (data/origins.py); None for streamed rows, or data that cannot be read again."""
        made, c = self.made[0], self.c
        if made is None:
            return None
        rows = [i for first in firsts for i in range(first, first + self.batch)]
        span = f"row {rows[0]}" if len(rows) == 1 else f"rows {rows[0]} to {rows[-1]}"
        what = "the micro-batch that failed" if len(firsts) == 1 else "the step's micro-batches"
        found = origins.Origins(made, c.data, None if self.media is not None else self.tokenizer, c.train_on_prompt,
                                c.seq + self.shifted)
        try:
            return f"{what} ({span} of the run)", found.of_rows(self.rows, rows)
        except (OSError, ValueError):       # the data changed or is gone since it was tokenised
            return None

    def step_loss(self, losses: list[float]) -> float:
        """The step's loss as the Trainer logs it: its micro-batches' losses weighted by their
        target tokens (the mean over the step's tokens)."""
        weights = self.weights[:len(losses)]
        return sum(w * x for w, x in zip(weights, losses)) / sum(weights)

    def evaluate(self, engine, step: int) -> dict:
        c = self.c
        if self.eval_rows is None or not c.eval_every or not intervals.evaluates(c, step):
            return {}
        out = {}
        # All the held-out data, then with eval_on_each_dataset each file on its own (its names' columns).
        for prefix, rows in [("eval", self.eval_rows)] + [(f"eval_{n}", r) for n, r in zip(self.names, self.each_rows)]:
            accuracy = [] if c.compute_accuracy else None
            watched = image_plans.Watched(engine, self.plans) if self.plans else engine
            loss, perplexity = held_out.evaluate(watched, rows, self.batch, c.eval_batch or self.batch, c.eval_batches,
                                                 self.shifted, self.padding_mask, accuracy, self._scaled)
            out |= {f"{prefix}_loss": loss, f"{prefix}_perplexity": perplexity,
                    **({f"{prefix}_accuracy": sum(accuracy) / len(accuracy) if accuracy else math.nan}
                       if accuracy is not None else {})}
        return out

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        text = (f"{row['tokens_per_s']:,.0f} tok/s | device peak {fmt_bytes(row['device_peak_bytes'])} / "
                f"{fmt_bytes(budget_bytes)}" + (f" | eval loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""))
        return text, {"tok/s": f"{row['tokens_per_s']:,.0f}", "peak": fmt_bytes(row["device_peak_bytes"])}

    def checkpoint_extra(self) -> dict:
        digest = self.rows.digest() if self.c.streaming else None
        return {"stage": saved_keys(self.c), **({"stream_rows": digest} if digest is not None else {})}

    def same_rows(self, saved: dict) -> bool:
        return self.c.streaming and isinstance(saved.get("stream_rows"), dict) and \
            self.rows.same_rows(saved["stream_rows"])

    def close(self) -> None:
        if self.c.streaming:
            self.rows.close()        # its tokenising thread


def _data(c: RunConfig, run_dir: str, row_len: int):
    """The tokenizer (for a vision-language model its images.Media, which saves the processor),
    the token files (train, eval or None; made now if new, and not yet in place: tokens.commit),
    the training and eval rows (None without held-out data) and what the
    training data's position refers to (its token file's sha256; the sources' when streamed)."""
    tokenizer_dir = None if c.bundled else (c.tokenizer or c.model)
    model_dir = None if c.bundled else c.model
    grid_images.check_template(c, tokenizer_dir)
    tokenizer = load_tokenizer(tokenizer_dir, c.chat_template, c.template, model_dir)
    vocab.add(tokenizer, c)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    folder = os.path.join(run_dir, "tokens")
    media = grid_images.for_run(c, tokenizer, tokenizer_dir)
    if c.streaming:
        return _stream(c, folder, tokenizer, tokenizer_dir, row_len, pad)
    batch_pixels = media.inputs if media is not None else None
    train = token_file(folder, "train", c.data, tokenizer, tokenizer_dir, c.train_on_prompt, media, row_len,
                       c.tokenize_workers, model_dir)
    held, eval_rows = None, None
    try:
        source, docs = train, np.arange(train.n_docs)
        if media is not None:
            media.check_packing(c.packing, train)
        if c.eval:
            held = token_file(folder, "eval", c.eval, tokenizer, tokenizer_dir, c.train_on_prompt, media, row_len,
                              c.tokenize_workers, model_dir)
            if media is not None:
                media.check_packing(c.packing, held)
            eval_rows = packing.Rows(held, row_len, c.packing, c.seed, shuffle=False, pad_id=pad, pixels=batch_pixels)
            print(f"  data           {_count(train, docs)} to train; {_count(held, np.arange(held.n_docs))} in "
                  f"{', '.join(e['path'] for e in c.eval)} to evaluate", flush=True)
        elif c.eval_fraction:
            cut = split.hold_out(train, c.eval_fraction, c.seed)
            source, docs = cut.tokens, cut.train
            eval_rows = packing.Rows(cut.tokens, row_len, c.packing, c.seed, docs=cut.held, shuffle=False, pad_id=pad,
                                     pixels=batch_pixels)
            print(f"  data           {_count(cut.tokens, cut.train)} to train; {_count(cut.tokens, cut.held)} held "
                  f"out to evaluate (eval_fraction {c.eval_fraction:g} of the tokens"
                  + ("; one document cut between them)" if cut.cut else ")"), flush=True)
        else:
            print(f"  data           {_count(train, docs)} to train", flush=True)
        rows = packing.Rows(source, row_len, c.packing, c.seed, docs=docs, shuffle=not c.disable_shuffling, pad_id=pad,
                            mix=_mix(c, source, docs), pixels=batch_pixels)
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
        held = token_file(folder, "eval", c.eval, tokenizer, tokenizer_dir, c.train_on_prompt, cutoff=row_len,
                           workers=c.tokenize_workers, model_dir=c.model)
        eval_rows = packing.Rows(held, row_len, c.packing, c.seed, shuffle=False, pad_id=pad)
    print(f"  data           streamed from {', '.join(e['path'] for e in c.data)} ({c.mix_strategy}), tokenised "
          "as training reads it" + (f"; {_count(held, np.arange(held.n_docs))} to evaluate" if held else ""),
          flush=True)
    rows = streaming.StreamRows(c.data, weights if weights[0] is not None else None, c.mix_strategy, tokenizer,
                                c.train_on_prompt, row_len, c.packing, pad)
    return tokenizer, (None, held), rows, eval_rows, tokens.fingerprint(c.data, tokenizer_dir, c.train_on_prompt,
                                                                        row_len, c.model)


def eval_names(c: RunConfig) -> list[str]:
    """eval_on_each_dataset's name of each held-out entry, as LlamaFactory keys its evaluations:
    eval_dataset's names, else each eval file's name less its extension (a repeated one numbered)."""
    if c.eval_dataset is not None:
        names = [n.strip() for n in c.eval_dataset.split(",") if n.strip()] if isinstance(c.eval_dataset, str) \
            else [str(n) for n in c.eval_dataset]
    else:
        names = [os.path.splitext(os.path.basename(os.path.normpath(e["path"])))[0] for e in c.eval]
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def _each(rows: packing.Rows, names: list[str]) -> list[packing.Rows]:
    """The held-out rows of each eval entry on its own (eval_on_each_dataset), packed as the whole
    held-out set is, from its own documents alone."""
    source = mixture.source_of(rows.tokens, rows.docs)
    out = []
    for i, name in enumerate(names):
        docs = rows.docs[source == i]
        if not len(docs):
            raise ArgumentError(f"eval_on_each_dataset: the held-out entry {name} holds no record to evaluate")
        out.append(packing.Rows(rows.tokens, rows.row_len, rows.packing, rows.seed, docs=docs, shuffle=False,
                                pad_id=rows.pad_id, pixels=rows.pixels))
    return out


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
    return lambda epoch: mixture.epoch_order(by_source, weights, c.mix_strategy, c.seed, epoch,
                                             shuffle=not c.disable_shuffling)


def _count(tokens: TokenFile, docs: np.ndarray) -> str:
    n = int((tokens.docs[docs + 1] - tokens.docs[docs]).sum())
    return f"{n:,} tokens ({len(docs):,} document{'s' if len(docs) != 1 else ''})"


def _check_images(c: RunConfig, rows) -> None:
    """With records that have images and a vision tower or projector that trains, the micro-batch
    is given (batch, grad_accum), not left to the planner. A micro-batch may hold no image: the
    tower and projector then get no gradient, and the engine skips them for the step as
    torch.optim.AdamW does (engine/gradless.py)."""
    if not getattr(getattr(rows, "tokens", None), "images", None):
        return
    if methods.adapters(c) or (c.freeze_vision_tower and c.freeze_multi_modal_projector):
        return
    if c.global_batch is not None:
        raise ArgumentError("global_batch: the data has records with images and the vision tower or projector "
                            "trains, and the planner does not pick the micro-batch of such a run; give batch and "
                            "grad_accum (or freeze_vision_tower and freeze_multi_modal_projector)")
