"""`stage: dpo`: preference pairs from records {prompt, chosen, rejected} (text or messages,
posttrain/preference.py) or in LlamaFactory's ranking layouts (data/ranking.py), read from any
data file or dataset_info.json entry as supervised records are (data/reading.py), trained by DPO or another of TRL's preference losses (loss_type, several
summed with loss_weights; rpo_alpha adds the sft term). Each pair is fitted to rows of seq as TRL
fits it (truncation.py: max_prompt_length, max_completion_length, truncation_mode; under keep_start
a pair whose prompt fills the row is dropped), and the run's start says how many were cut or dropped.

The reference is the policy before the first step. Its log-probabilities of every pair (and of
every held-out pair) are computed once, by the objective's forward-only pass on the same engine,
before the first step, and kept in the run folder (reference_logps.pt): a resumed run reads them
there, as its weights are no longer the reference's. Each micro-batch's training forward hands out
the policy's log-probabilities of its rows beside the loss, which give the logged implicit rewards
(those of the policy the step starts from, as TRL logs them: handed_out.py).

With sync_ref_model (TR-DPO) the reference moves: it is a second engine over the model as loaded
(a second copy of the weights on the host), whose forward-only pass gives each micro-batch's and
each evaluation's reference log-probabilities, and into which the policy is mixed every
ref_model_sync_steps steps (reference.update).

A vision-language model (a folder with its processor) trains pairs with images too (LlamaFactory's
rlhf_v layout, TRL's vision preference records: data/image_answers.py): each micro-batch's chosen
and rejected rows hold their prompt's images, read by the processor when the micro-batch is
packed, so every pass (reference, policy, evaluation) sees the pixels the prompt shows. Its export
gets the processor's files beside it.

With trim_padding (and retrace) a step's micro-batches, and the rows of each forward-only pass
(the reference's, an evaluation's), are cut after the last completion token of their longest row
(data/trim.py), pairs with images excepted: the log-probabilities are those of rows of seq."""
from __future__ import annotations


import os
from dataclasses import replace

import torch

from ...errors import ArgumentError, NonFiniteError
from ...posttrain import DPOLoss, DPOObjective
from ...posttrain import IGNORE
from ...posttrain import Pair, orpo_metrics, pack, preference_metrics, to_pair
from ..data import grid_images, images, tools, trim
from ..data.image_answers import heaviest, image_pair, media_digest, with_media
from ..data.ranking import preference, preference_kwargs
from ..data.reading import records
from ..log import STEP_COLUMNS
from .. import tokenized
from .order import stream_items
from .epochs import steps as epoch_steps
from .handed_out import step_micro_batches
from .keys import dpo_loss_terms, saved_keys
from . import failed_records, reference, truncation

METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy", "logps_chosen",
           "logps_rejected")
# ORPO's two terms, as TRL's ORPO trainer and LlamaFactory's DPO trainer log them (dpo_losses.orpo_metrics)
ORPO_METRICS = {"orpo": ("nll_loss", "log_odds_ratio", "log_odds_chosen"), "orpo_per_pair": ("sft_loss", "odds_ratio_loss")}


def pairs_digest(pairs: list[Pair]) -> str:
    """sha256 of the pairs' token ids, in order, and of their images (paths, sizes, times): what a
    reference row belongs to."""
    return reference.digest((p.prompt, p.chosen, p.rejected) + ((media_digest(p.media),) if p.media else ())
                            for p in pairs)


class DPOStage(reference.ReferenceStage):
    def __init__(self, c, tokenizer, run_dir: str | None = None):
        super().__init__(c, tokenizer)
        # a vision-language model's processor: pairs with images are tokenised and packed through it,
        # and it is what the trained model's folder saves beside it
        self.media = grid_images.for_run(c, tokenizer, c.tokenizer or c.model)
        if self.media is not None:
            self.tokenizer = self.media
            if run_dir is not None:     # images held inside records are written there (data/embedded.py)
                self.media.keep_embedded_in(os.path.join(run_dir, "images"))
        self.cuts = truncation.Cuts(c, "pair")      # what fitting rows of seq cut or dropped, counted
        self.pairs = self._read(c.data, tokenizer)
        self.held: list[Pair] = []
        if c.eval:
            self.held = self._read(c.eval, tokenizer)
        elif c.eval_fraction:
            self.pairs, self.held = reference.hold_out(self.pairs, c.eval_fraction, c.seed, "pairs")
        self.tokenized = tokenized.made({split: (((p.prompt, p.chosen, p.rejected), p.where) for p in pairs)
                                         for split, pairs in (("train", self.pairs), ("eval", self.held))}, "pair")
        kinds, weights = dpo_loss_terms(c)
        self.loss = DPOLoss(c.beta, c.label_smoothing, kinds, weights, c.discopop_tau, c.simpo_gamma, c.pref_ftx or 0.0,
                            c.f_divergence_type, c.f_alpha_divergence_coef, c.use_weighting, c.ld_alpha)
        self.orpo = [k for k in ORPO_METRICS if k in self.loss.kinds]
        self.columns = (STEP_COLUMNS + METRICS + tuple(m for k in self.orpo for m in ORPO_METRICS[k])
                        + (("eval_loss",) + tuple(f"eval_{m}" for m in METRICS) if self.held else ()))
        self.table = self.held_reference = None      # the reference's log-probabilities, computed once
        self.needs_reference = bool(c.sync_ref_model)   # a reference engine that moves (TR-DPO)
        self.reference = None
        # rows cut after their longest (data/trim.py): not under retrace: false, whose one program has one shape
        self.trim = c.trim_padding and c.retrace

    def _read(self, entries: list, tokenizer) -> list[Pair]:
        pairs = []
        for entry in entries:
            if self.media is not None:
                self.media.at(entry["path"], entry.get("media_dir"))
            for where, record in records(entry):
                if self.media is not None and images.held(record):
                    pair = image_pair(record, where, tokenizer, self.media)
                else:
                    images.text_only(record, where, "dpo")
                    pair = to_pair(preference(record, where), tokenizer, where,
                                   preference_kwargs(record, where), tools.tools(record, where))
                fitted = self.cuts.fit(pair.prompt, (pair.chosen, pair.rejected), where, bool(pair.media))
                if fitted is not None:      # None: dropped, as TRL drops a prompt that fills the row
                    (prompt, (chosen, rejected)) = fitted
                    pairs.append(replace(pair, prompt=prompt, chosen=chosen, rejected=rejected, where=where))
        if not pairs:
            raise ArgumentError(f"data: {', '.join(e['path'] for e in entries)} hold no preference pairs"
                                + self.cuts.none_left())
        return pairs

    def describe(self, setup) -> list[str]:
        held = f", {len(self.held)} held out" if self.held else ""
        held += images.counted([p.media for p in self.pairs])
        return [f"stage          dpo: {len(self.pairs)} preference pairs{held}; {self.c.batch} pairs x "
                f"{self.c.grad_accum} accumulated per step, rows of {self.c.seq} tokens; {_terms(self.loss)} loss, "
                f"beta {self.c.beta:g}"
                + (f", simpo_gamma {self.c.simpo_gamma:g}" if "simpo" in self.loss.kinds else "")
                + ("; no reference (the loss reads the policy alone)" if not self.loss.needs_reference else "")
                + f"; {self.c.steps} steps"] + self.cuts.lines()

    def steps_for(self, epochs: float) -> int:
        return epoch_steps(self.c, len(self.pairs), epochs)

    def epoch_items(self) -> tuple[int, str] | None:
        return len(self.pairs), "pairs"

    def objective(self, policy):
        return DPOObjective(policy, self.loss, hand_out=True)

    def first_inputs(self, batch: int) -> dict:
        return {**self._pack([self.pairs[i % len(self.pairs)] for i in range(batch)]),
                "ref_logps": torch.zeros(2 * batch)}

    def heaviest_inputs(self, batch: int) -> dict | None:
        """The `batch` pairs whose images fill the most tokens (None without images): the default
        budget fits their micro-batch too, not only the first one."""
        items = heaviest([p.media for p in self.pairs], self.media, batch)
        if items is None:
            return None
        return {**self._pack([self.pairs[i] for i in items]), "ref_logps": torch.zeros(2 * batch)}

    def forward_inputs(self, batch: int) -> dict | None:
        """With images, the forward-only pass's (the reference's and an evaluation's), whose
        smallest plan of a vision-language model is larger than its training step's."""
        heaviest = self.heaviest_inputs(batch)
        return None if heaviest is None else {k: v for k, v in heaviest.items() if k != "ref_logps"}

    def _pack(self, group: list[Pair]) -> dict:
        """The micro-batch of these pairs (pack()), with the image inputs of their rows: the chosen
        rows' images, then the rejected rows', each a pair's prompt's."""
        return with_media(pack(group, self.c.seq, self.pad, self.c.truncation_mode), self.media,
                          [p.media for p in group] * 2)

    def _logps(self, engine, pairs: list[Pair]) -> torch.Tensor:
        """(len(pairs), 2) log-probabilities (chosen, rejected) under the engine's weights now, by
        micro-batches of `batch` pairs (the last one filled up with the first pairs, left out)."""
        b, out = self.c.batch, []
        for i in range(0, len(pairs), b):
            group = [pairs[(i + k) % len(pairs)] for k in range(b)]
            with trim.own_lengths(self.trim):
                both = torch.as_tensor(engine(**trim.together([self._pack(group)], self.trim)[0])).float()
            out.append(torch.stack([both[:b], both[b:]], dim=1))
        return torch.cat(out)[:len(pairs)]

    def _token_counts(self, pairs: list[Pair]) -> torch.Tensor:
        """(len(pairs), 2) completion tokens (chosen, rejected) in rows of seq (a longer one is cut)."""
        counted = (pack(pairs, self.c.seq, self.pad, self.c.truncation_mode)["labels"] != IGNORE).sum(-1).float()
        return torch.stack([counted[:len(pairs)], counted[len(pairs):]], dim=1)

    def begin(self, engine, run_dir: str, saved: dict | None, batch: int) -> None:
        self.run_dir = run_dir
        if self.needs_reference:        # read from the reference engine at each step
            reference.resume(self.reference, self.c, run_dir, engine.steps_done)
            return
        if not self.loss.needs_reference:       # simpo, orpo: the policy alone; the rewards are beta log pi per token
            self.table = torch.zeros(len(self.pairs), 2)
            self.held_reference = torch.zeros(len(self.held), 2) if self.held else None
            return
        tokens = {"train": pairs_digest(self.pairs), "eval": pairs_digest(self.held)}
        if saved is not None:
            kept = reference.kept(run_dir, tokens, "pairs")
            self.table, self.held_reference = kept["train"], kept["eval"]
            return
        # In eval mode, as TRL runs its reference (prepared with evaluation_mode): dropout off.
        self.table = self.eval_logps(engine, self.pairs, self._logps)
        self.held_reference = self.eval_logps(engine, self.held, self._logps) if self.held else None
        reference.keep(run_dir, self.table, self.held_reference, tokens)

    def step(self, engine, position: int) -> tuple[dict, list, int, int]:
        """One optimizer step: grad_accum micro-batches, whose training forwards hand out the policy's
        log-probabilities for the logged rewards (the policy the step starts from: handed_out.py)."""
        drawn, first = [], position
        for _ in range(self.c.grad_accum):
            drawn.append(stream_items(len(self.pairs), self.c.seed, position, self.c.batch,
                                      not self.c.disable_shuffling))
            position += self.c.batch
        # every micro-batch of the step at one length (data/trim.py): one program for all of them
        packed = trim.together([self._pack([self.pairs[i] for i in chosen]) for chosen in drawn], self.trim)
        with trim.own_lengths(self.trim):
            micro = [(rows, torch.as_tensor(self.reference(**rows)).float().clone() if self.needs_reference
                      else torch.cat([self.table[chosen, 0], self.table[chosen, 1]]))
                     for rows, chosen in zip(packed, drawn)]
            try:
                losses, tokens, outputs = step_micro_batches(engine, [{**batch, "ref_logps": ref}
                                                                      for batch, ref in micro])
            except NonFiniteError as e:     # on_nonfinite: raise; the run's error names the records
                e.records = failed_records.named(engine, [[self.pairs[i].where for i in chosen] for chosen in drawn],
                                                 first, self.c.batch, "pairs")
                raise
        micro = micro[:len(outputs)]        # those whose forward ran: a skip ends the step
        policy = [o["logps"].float() for o in outputs]
        b = self.c.batch
        rows = lambda ts: torch.cat([torch.cat([t[:b] for t in ts]), torch.cat([t[b:] for t in ts])])  # noqa: E731
        lengths = rows([(batch["labels"] != IGNORE).sum(-1).float() for batch, _ in micro])
        metrics = preference_metrics(rows(policy), rows([r for _, r in micro]), self.c.beta, self._per_token(lengths))
        metrics.update(_logps(rows(policy), self._per_token(lengths)))
        for kind in self.orpo:
            both, half = rows(policy), len(lengths) // 2
            metrics.update(orpo_metrics(kind, both[:half], both[half:], lengths[:half], lengths[half:]))
        if self.needs_reference:
            reference.update(self.reference, engine, self.c, self.run_dir)
        return metrics, losses, tokens, position

    def _per_token(self, lengths: torch.Tensor) -> torch.Tensor | None:
        """The completions' lengths where the rewards are per token: a loss of the policy alone
        (simpo, orpo) reads its log-probabilities so, and TRL and LlamaFactory log them so."""
        return None if self.loss.needs_reference else lengths

    def evaluate(self, engine, step: int) -> dict:
        # with sync_ref_model the reference as the last update left it
        c, due = self.c, self.held_out(engine, step, self._logps, self.reference if self.needs_reference else None)
        if due is None:
            return {}
        held, ref, policy = due
        counts = self._token_counts(held)
        lengths = torch.cat([counts[:, 0], counts[:, 1]])
        losses = self.loss.pairs(torch.cat([policy[:, 0], policy[:, 1]]), torch.cat([ref[:, 0], ref[:, 1]]), lengths)
        both = preference_metrics(torch.cat([policy[:, 0], policy[:, 1]]), torch.cat([ref[:, 0], ref[:, 1]]), c.beta,
                                  self._per_token(lengths))
        both.update(_logps(torch.cat([policy[:, 0], policy[:, 1]]), self._per_token(lengths)))
        return {"eval_loss": losses.mean().item(), **{f"eval_{k}": v for k, v in both.items()}}

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        return f"margin {row['reward_margin']:.4f} | accuracy {row['preference_accuracy']:.2f}", {}

    def checkpoint_extra(self) -> dict:
        return {"stage": saved_keys(self.c)}


def _logps(policy: torch.Tensor, tokens: torch.Tensor | None) -> dict[str, float]:
    """The policy's mean log-probability of the chosen and of the rejected completions (the first
    and second half of `policy`), as TRL logs logps/chosen and logps/rejected: summed over each
    completion's tokens, or per token where the rewards are (`tokens`: the completions' lengths)."""
    if tokens is not None:
        policy = policy / tokens.clamp(min=1)
    half = policy.shape[0] // 2
    return {"logps_chosen": policy[:half].mean().item(), "logps_rejected": policy[half:].mean().item()}


def _terms(loss: DPOLoss) -> str:
    terms = (" + ".join(loss.kinds) if loss.loss_weights is None
             else " + ".join(f"{w:g} {k}" for k, w in zip(loss.kinds, loss.loss_weights)))
    return terms + (f" + {loss.ftx:g} pref_ftx (each pair's chosen NLL per token)" if loss.ftx else "")
