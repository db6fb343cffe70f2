"""`stage: kto`: completions each marked desirable or undesirable (data/feedback.py: TRL's
unpaired or paired records, LlamaFactory's kto_tag datasets), trained by KTO (posttrain/kto.py).
Each example is fitted to rows of seq as TRL's KTOTrainer fits it (example_cuts.py: a row keeps its
first seq tokens; max_prompt_length and truncation_mode take KTOConfig's meaning, not DPOConfig's),
before the KL rows are paired, as TRL drops examples before pairing them; each KL row is fitted by
the same rule.

The reference is the policy before the first step, as in stage dpo: its log-probabilities of every
example and of every example's KL row are computed once, by the objective's forward-only pass,
and kept in the run folder (reference_logps.pt) for a resume. An example's KL row is its prompt
with another example's completion, fixed when the data is read: in chunks of examples in the
data's order, each takes the completion of the one before it (the first the last's). The chunks
are TRL's, `batch` examples of the training and the held-out data each (_get_kl_dataset), or,
where every training entry is a LlamaFactory kto_tag dataset (dataset_info.json), LlamaFactory's:
1,000 examples (its preprocessing batch), paired before eval_fraction holds examples out, so a
micro-batch of one has a KL row of another completion too. Each micro-batch's step is preceded by
a forward-only pass of its KL rows (the KL estimate, a step input held constant, as TRL computes
it without gradient), all before the step's first micro-batch: the policy the step starts from.
Its rows' log-probabilities, for the logged rewards, come out of its training forward beside the
loss (handed_out.py), of the same policy.

On a vision-language model (a folder with its processor) an example may show images
(data/image_answers.py): its row and its KL row hold its prompt's images, read by the processor
when the micro-batch is packed; the export gets the processor's files beside it.

With trim_padding (and retrace) a step's rows, its KL rows, and the rows of each forward-only
pass (the reference's, an evaluation's) are cut after the last completion token of their longest
row (data/trim.py), examples with images excepted: the log-probabilities are those of rows of seq."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

import torch

from ...errors import ArgumentError, NonFiniteError
from ...posttrain import IGNORE, KTOLoss, KTOObjective, kl_estimate, pack_rows, tokenised
from ..data import feedback, grid_images, images, tools, trim
from ..data.image_answers import answered, heaviest, media_digest, with_media
from ..data.ranking import preference_kwargs
from ..data.reading import records
from ..log import STEP_COLUMNS
from .. import tokenized
from .handed_out import step_micro_batches
from .keys import saved_keys
from .order import stream_items
from .epochs import steps as epoch_steps
from . import example_cuts, failed_records, reference

METRICS = ("rewards_chosen", "rewards_rejected", "kl")


LLAMAFACTORY_CHUNK = 1000      # LlamaFactory's preprocessing_batch_size, in which its KL rows are paired


@dataclass(frozen=True)
class Example:
    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    desirable: bool
    kl: tuple[int, ...] | None = None       # its KL row's completion, where paired as LlamaFactory pairs
    media: tuple = ()       # a vision-language model's example: its prompt's images (paths), in order
    # the records it and its KL row's completion were read from, as the run names a record
    # (data/reading.py), for a failed step's error to name (failed_records.py)
    where: str = field(default="", compare=False)
    kl_where: str | None = field(default=None, compare=False)


def with_kl(examples: list[Example], chunk: int) -> list[Example]:
    """`examples`, each with its KL row's completion: the one before it in its chunk (LlamaFactory's
    feedback processor, over its preprocessing batch)."""
    return [replace(e, kl=examples[p].completion, kl_where=examples[p].where)
            for e, p in zip(examples, kl_partners(len(examples), chunk))]


def kl_partners(n: int, batch: int) -> list[int]:
    """For each of n examples, the example whose completion its KL row takes (TRL's _get_kl_dataset:
    chunks of `batch` in order, each rotated by one)."""
    out = []
    for lo in range(0, n, batch):
        chunk = list(range(lo, min(lo + batch, n)))
        out += chunk[-1:] + chunk[:-1]
    return out


def examples_digest(examples: list[Example]) -> str:
    """sha256 of the examples' token ids and labels, in order: what a reference row belongs to."""
    return reference.digest((e.prompt, e.completion, (int(e.desirable),)) + ((e.kl,) if e.kl is not None else ())
                            + ((media_digest(e.media),) if e.media else ()) for e in examples)


class KTOStage(reference.ReferenceStage):
    def __init__(self, c, tokenizer, run_dir: str | None = None):
        super().__init__(c, tokenizer)
        # a vision-language model's processor, as stage dpo keeps it (stages/dpo.py)
        self.media = grid_images.for_run(c, tokenizer, c.tokenizer or c.model)
        if self.media is not None:
            self.tokenizer = self.media
            if run_dir is not None:
                self.media.keep_embedded_in(os.path.join(run_dir, "images"))
        self.text_tokenizer = tokenizer
        self.llamafactory = feedback.llamafactory_pairing(c.data)
        self.cuts = example_cuts.ExampleCuts(c)     # what fitting rows of seq cut or dropped, counted
        self.examples = self._read(c.data)
        self.held: list[Example] = []
        if self.llamafactory:
            self.examples = with_kl(self.examples, LLAMAFACTORY_CHUNK)
        if c.eval:
            self.held = self._read(c.eval)
            if self.llamafactory:
                self.held = with_kl(self.held, LLAMAFACTORY_CHUNK)
        elif c.eval_fraction:
            self.examples, self.held = reference.hold_out(self.examples, c.eval_fraction, c.seed, "examples")
        self.tokenized = tokenized.made({split: (((e.prompt, e.completion, (int(e.desirable),)), e.where)
                                                 for e in examples)
                                         for split, examples in (("train", self.examples), ("eval", self.held))},
                                        "example")
        self.loss = KTOLoss(c.beta, c.desirable_weight, c.undesirable_weight, c.loss_type, c.pref_ftx or 0.0)
        self.partners = kl_partners(len(self.examples), c.batch)
        self.held_partners = kl_partners(len(self.held), c.batch)
        self.columns = STEP_COLUMNS + METRICS + (("eval_loss",) + tuple(f"eval_{m}" for m in METRICS)
                                                 if self.held else ())
        self.reference = self.held_reference = None
        # rows cut after their longest (data/trim.py): not under retrace: false, whose one program has one shape
        self.trim = c.trim_padding and c.retrace

    def _read(self, entries: list) -> list[Example]:
        out: list[Example] = []
        for entry in entries:
            paired: list[tuple[str, dict, list[dict]]] = []       # TRL unpairs them a map batch at a time

            def flush():
                fitted = (self._example(where, record, pair[k]) for k in (0, 1) for where, record, pair in paired)
                out.extend(e for e in fitted if e is not None)
                paired.clear()
            if self.media is not None:
                self.media.at(entry["path"], entry.get("media_dir"))
            for where, record in records(entry):
                if self.media is None or not images.held(record):
                    images.text_only(record, where, "kto")
                if feedback.is_paired(record):
                    shown = self.media is not None and images.held(record)
                    paired.append((where, record, feedback.unpaired(record, where, shown)))
                    if len(paired) == feedback.UNPAIR_BATCH:
                        flush()
                else:
                    flush()
                    fitted = self._example(where, record, feedback.example(record, where))
                    if fitted is not None:
                        out.append(fitted)
            flush()
        if not out:
            raise ArgumentError(f"data: {', '.join(e['path'] for e in entries)} hold no KTO examples"
                                + self.cuts.none_left())
        return out

    def _example(self, where: str, record: dict, example: dict) -> Example | None:
        """The example's tokens fitted to rows of seq (example_cuts.py), None where it is dropped."""
        shown = ()
        if self.media is not None and images.held(record):
            prompt, (completion,) = answered(record, example["prompt"], {"completion": example["completion"]}, where,
                                             self.text_tokenizer, self.media)
            shown = tuple(self.media.paths(record, where))
        else:
            prompt, (completion,) = tokenised(example["prompt"], {"completion": example["completion"]},
                                              self.text_tokenizer, where, preference_kwargs(record, where),
                                              tools.tools(record, where))
        fitted = self.cuts.fit(tuple(prompt), (tuple(completion),), where, bool(shown))
        if fitted is None:      # dropped, as TRL drops an example whose prompt fills the row
            return None
        (prompt, (completion,)) = fitted
        return Example(prompt, completion, example["label"], media=shown, where=where)

    def describe(self, setup) -> list[str]:
        c, wanted = self.c, sum(e.desirable for e in self.examples)
        held = f", {len(self.held)} held out" if self.held else ""
        held += images.counted([e.media for e in self.examples])
        lines = [f"stage          kto: {len(self.examples)} completions ({wanted} desirable, "
                 f"{len(self.examples) - wanted} undesirable){held}; {c.batch} x {c.grad_accum} accumulated per step, "
                 f"rows of {c.seq} tokens; loss {c.loss_type}, beta {c.beta:g}, desirable_weight "
                 f"{c.desirable_weight:g}, undesirable_weight {c.undesirable_weight:g}"
                 + (f", pref_ftx {c.pref_ftx:g} (the desirable completions' NLL per token, as LlamaFactory's kto)"
                    if c.pref_ftx else "") + f"; {c.steps} steps"]
        if self.loss.needs_kl:
            lines.append("kl rows        each prompt with the completion before it, in chunks of "
                         + (f"{LLAMAFACTORY_CHUNK:,} examples before the held-out split (LlamaFactory's kto_tag "
                            "datasets)" if self.llamafactory else f"{c.batch} examples (TRL's)"))
        unwanted = len(self.examples) - wanted
        ratio = c.desirable_weight * wanted / (c.undesirable_weight * unwanted) if unwanted else math.inf
        if not 1 <= ratio <= 4 / 3:
            # the range the KTO paper recommends, which TRL warns about too
            lines.append(f"note           desirable_weight x desirable / (undesirable_weight x undesirable) is "
                         f"{ratio:.3g}; KTO recommends 1 to 4/3: set the weights to bring it there")
        return lines + self.cuts.lines()

    def steps_for(self, epochs: float) -> int:
        return epoch_steps(self.c, len(self.examples), epochs)

    def epoch_items(self) -> tuple[int, str] | None:
        return len(self.examples), "examples"

    def objective(self, policy):
        return KTOObjective(policy, self.loss, hand_out=True)

    def _rows(self, examples: list[Example], items: list[int], partners: list[int]) -> tuple[dict, dict, torch.Tensor]:
        """The micro-batch of `items`: its rows, its KL rows (each with its own prompt's images) and
        which completions are desirable."""
        shown = [examples[i].media for i in items]
        # fitted examples: a row longer than seq keeps its first seq tokens (example_cuts.py)
        rows = pack_rows([(examples[i].prompt, examples[i].completion) for i in items], self.c.seq, self.pad,
                         "keep_start")
        kl = pack_rows([self.cuts.kl_row(examples[i].prompt, examples[i].kl if examples[i].kl is not None
                                         else examples[partners[i]].completion, bool(examples[i].media))
                        for i in items], self.c.seq, self.pad, "keep_start")
        return (with_media(rows, self.media, shown), with_media(kl, self.media, shown),
                torch.tensor([float(examples[i].desirable) for i in items]))

    def first_inputs(self, batch: int) -> dict:
        return self._inputs([i % len(self.examples) for i in range(batch)])

    def _inputs(self, items: list[int]) -> dict:
        rows, _, desirable = self._rows(self.examples, items, self.partners)
        return {**rows, "ref_logps": torch.zeros(len(items)), "desirable": desirable, "kl": torch.zeros(())}

    def heaviest_inputs(self, batch: int) -> dict | None:
        """The `batch` examples whose images fill the most tokens (None without images)."""
        items = heaviest([e.media for e in self.examples], self.media, batch)
        return None if items is None else self._inputs(items)

    def forward_inputs(self, batch: int) -> dict | None:
        """With images, the forward-only pass's (the reference's, an evaluation's and the KL rows'),
        whose smallest plan of a vision-language model is larger than its training step's."""
        items = heaviest([e.media for e in self.examples], self.media, batch)
        return None if items is None else self._rows(self.examples, items, self.partners)[0]

    def _logps(self, engine, examples: list[Example], partners: list[int]) -> torch.Tensor:
        """(len(examples), 2) log-probabilities (the example's row, its KL row: 0 where the loss
        has no KL term) under the engine's weights now, by micro-batches of `batch` (the last one
        filled up with the first, left out)."""
        b, out = self.c.batch, []
        for lo in range(0, len(examples), b):
            rows, kl, _ = self._rows(examples, [(lo + k) % len(examples) for k in range(b)], partners)
            with trim.own_lengths(self.trim):
                own = torch.as_tensor(engine(**trim.together([rows], self.trim)[0])).float()
                other = (torch.as_tensor(engine(**trim.together([kl], self.trim)[0])).float() if self.loss.needs_kl
                         else torch.zeros_like(own))
            out.append(torch.stack([own, other], dim=1))
        return torch.cat(out)[:len(examples)]

    def begin(self, engine, run_dir: str, saved: dict | None, batch: int) -> None:
        # batch pairs the KL rows: another batch makes other rows
        tokens = {"train": examples_digest(self.examples), "eval": examples_digest(self.held),
                  "batch": self.c.batch}
        if saved is not None:
            kept = reference.kept(run_dir, tokens, "examples (or batch, which pairs the KL rows)")
            self.reference, self.held_reference = kept["train"], kept["eval"]
            return
        # In eval mode, as TRL runs its reference (prepared with evaluation_mode): dropout off.
        self.reference = self.eval_logps(engine, self.examples, lambda e, x: self._logps(e, x, self.partners))
        self.held_reference = (self.eval_logps(engine, self.held, lambda e, x: self._logps(e, x, self.held_partners))
                               if self.held else None)
        reference.keep(run_dir, self.reference, self.held_reference, tokens)

    def _kl(self, engine, kl_rows: dict, ref: torch.Tensor) -> torch.Tensor:
        if not self.loss.needs_kl:
            return torch.zeros(())
        return kl_estimate(torch.as_tensor(engine(**kl_rows)).float(), ref)

    def step(self, engine, position: int) -> tuple[dict, list, int, int]:
        """One optimizer step: grad_accum micro-batches, each after the forward-only pass of its KL
        rows (all of them before the step's first micro-batch: the KL estimate is an input of the
        loss); the training forwards hand out the rows' log-probabilities for the logged rewards
        (the policy the step starts from: handed_out.py)."""
        micro, drawn, first = [], [], position
        for _ in range(self.c.grad_accum):
            items = stream_items(len(self.examples), self.c.seed, position, self.c.batch, not self.c.disable_shuffling)
            position += self.c.batch
            drawn.append(items)
            rows, kl_rows, desirable = self._rows(self.examples, items, self.partners)
            micro.append((rows, kl_rows, desirable, self.reference[items]))
        # the step's rows at one length, its KL rows at one length (data/trim.py): one program for each
        cut = zip(trim.together([m[0] for m in micro], self.trim), trim.together([m[1] for m in micro], self.trim))
        micro = [(rows, kl_rows, desirable, ref) for (rows, kl_rows), (_, _, desirable, ref) in zip(cut, micro)]
        with trim.own_lengths(self.trim):
            kls = [self._kl(engine, kl_rows, ref[:, 1]) for _, kl_rows, _, ref in micro]
            try:
                losses, tokens, outputs = step_micro_batches(
                    engine, [{**rows, "ref_logps": ref[:, 0], "desirable": desirable, "kl": kl}
                             for (rows, _, desirable, ref), kl in zip(micro, kls)])
            except NonFiniteError as e:     # on_nonfinite: raise; the run's error names the records
                e.records = failed_records.named(engine, [self._wheres(items) for items in drawn], first,
                                                 self.c.batch, "examples")
                raise
        ran = micro[:len(outputs)]          # those whose forward ran: a skip ends the step
        metrics = self._metrics(torch.cat([o["logps"].float() for o in outputs]),
                                torch.cat([r[:, 0] for *_, r in ran]), torch.cat([d for _, _, d, _ in ran]),
                                torch.stack(kls))
        return metrics, losses, tokens, position

    def _wheres(self, items: list[int]) -> list[str]:
        """The records of the examples `items`, then those their KL rows' completions came from (the
        KL estimate is an input of their loss)."""
        own = [self.examples[i].where for i in items]
        if not self.loss.needs_kl:
            return own
        return own + [self.examples[i].kl_where if self.examples[i].kl is not None
                      else self.examples[self.partners[i]].where for i in items]

    def _metrics(self, policy: torch.Tensor, ref: torch.Tensor, desirable: torch.Tensor, kls: torch.Tensor) -> dict:
        """The mean implicit reward beta (log pi - log pi_ref) of the desirable and of the undesirable
        completions (nan where there were none), and the KL estimate."""
        rewards, wanted = self.c.beta * (policy - ref), desirable.bool()
        mean = lambda x: x.mean().item() if x.numel() else math.nan      # noqa: E731
        return {"rewards_chosen": mean(rewards[wanted]), "rewards_rejected": mean(rewards[~wanted]),
                "kl": kls.mean().item()}

    def evaluate(self, engine, step: int) -> dict:
        c, due = self.c, self.held_out(engine, step, lambda e, items: self._logps(e, items, self.held_partners))
        if due is None:
            return {}
        held, ref, policy = due
        desirable = torch.tensor([float(e.desirable) for e in held])
        lengths = self._lengths(held)
        losses, kls = [], []
        step = c.eval_batch or c.batch
        for lo in range(0, len(held), step):         # the KL estimate of each eval batch, as TRL's
            part = slice(lo, lo + step)
            kl = kl_estimate(policy[part, 1], ref[part, 1]) if self.loss.needs_kl else torch.zeros(())
            rows = len(held[part])                   # each eval batch's loss, weighted by its rows
            losses.append(rows * self.loss.batch(policy[part, 0], ref[part, 0], desirable[part], kl, lengths[part]))
            kls.append(kl)
        metrics = self._metrics(policy[:, 0], ref[:, 0], desirable, torch.stack(kls))
        return {"eval_loss": (sum(losses) / len(held)).item(), **{f"eval_{k}": v for k, v in metrics.items()}}

    def _lengths(self, examples: list[Example]) -> torch.Tensor:
        """(len(examples),) completion tokens in rows of seq (a longer one is cut)."""
        rows = pack_rows([(e.prompt, e.completion) for e in examples], self.c.seq, self.pad, "keep_start")
        return (rows["labels"] != IGNORE).sum(-1).float()

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        # a step whose examples are all desirable (or all undesirable) has no reward of the other kind
        shown = [("-" if v is None or math.isnan(v) else f"{v:.4f}") for v in (row["rewards_chosen"],
                                                                               row["rewards_rejected"], row["kl"])]
        return f"rewards {shown[0]} / {shown[1]} | kl {shown[2]}", {}

    def checkpoint_extra(self) -> dict:
        return {"stage": saved_keys(self.c)}
