"""`stage: rm`: a reward model (posttrain/reward.py) trained on preference pairs, read as stage dpo
reads them (TRL's records, LlamaFactory's ranking datasets; a record's `margin`, TRL's column,
subtracted in the loss). The model is the folder's decoder with a new one-number head, saved at
the end as transformers' *ForSequenceClassification (trained_model.py), which scores a sequence
at its last token that is not padding: the rows here are scored at the same token.

The logged rewards are those of the model the step starts from: each micro-batch's training forward
hands them out beside its loss (handed_out.py), the masters moving only after the step's last.

A vision-language model whose family transformers gives a sequence classifier (Gemma 3's, Qwen3.5's:
the whole model under a score) trains pairs with images as stage dpo reads them (LlamaFactory's
rlhf_v layout, TRL's vision records: data/image_answers.py), each row holding its prompt's images;
its export carries the processor's files. A family without such a classifier is refused before
anything is read: its reward model could be neither saved nor loaded.

With trim_padding (and retrace) a step's micro-batches, and an evaluation's, are cut after the
last scored token of their longest row (data/trim.py), pairs with images excepted: a decoder is
causal, so the rewards are those of rows of seq."""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from ...errors import ArgumentError, NonFiniteError
from ...posttrain import Pair, RewardModel, preference_metrics, reward_loss, to_pair
from .. import intervals, tokenized
from ..data import grid_images, images, tools, trim
from ..data.image_answers import heaviest, image_pair, with_media
from ..data.ranking import preference, preference_kwargs
from ..data.reading import records
from ..data.tokens import fingerprint
from ..log import STEP_COLUMNS
from ..model import check_positions
from . import failed_records
from .handed_out import step_micro_batches
from .keys import check_resume, saved_keys
from .order import stream_items
from .epochs import steps as epoch_steps
from .reference import hold_out
from .stage import Stage

METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy")


def scored_rows(pairs: list[Pair], margins: list[float], seq: int, pad_id: int) -> dict[str, torch.Tensor]:
    """(2B, seq) input_ids (prompt + chosen rows, then prompt + rejected rows, cut at seq tokens,
    padded), each row's `last` token that is not padding (transformers' sequence classifiers
    score there) and the pairs' margins."""
    rows = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    for r, row in enumerate(rows):
        row = row[:seq]
        ids[r, :len(row)] = torch.tensor(row)
    positions = torch.arange(seq).expand_as(ids)
    last = (positions * (ids != pad_id)).argmax(-1)
    return {"input_ids": ids, "last": last, "margin": torch.tensor(margins, dtype=torch.float32)}


def reward_model(c, model) -> RewardModel:
    """The module the run trains: the reward model of `model` (the run's causal LM, its method
    applied). finetuning_type lora: PEFT's wrapper around the causal LM, whose adapters sit in the
    LM's own modules; the reward model takes its decoder, adapters and all, and keeps the adapters'
    settings for the export (policy_export.py). `megacompile plan --run` plans this module too
    (run_plan.py)."""
    adapters = getattr(model, "peft_config", {}).get("default")
    causal_lm = model.get_base_model() if adapters is not None else model
    out = RewardModel.of(causal_lm, seed=c.seed, center_rewards_coefficient=c.center_rewards_coefficient)
    out.adapters = adapters
    out.hand_out = True         # the logged rewards, out of the training forward
    return out


def planned_rows(rows: dict, train: bool) -> dict:
    """The reward model's inputs in place of a causal LM's `rows` (input_ids, labels and a vision-language
    model's image inputs, as the planner lays them out on the meta device): as scored_rows and with_media
    give them, each row's `last` token in place of the labels, the pairs' margins for a training
    step (a forward-only pass, an evaluation's rewards, takes none)."""
    ids = rows["input_ids"]
    out = {"input_ids": ids, "last": torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)}
    if train:
        out["margin"] = torch.empty(ids.shape[0] // 2, dtype=torch.float32, device=ids.device)
    return out | {k: v for k, v in rows.items() if k not in ("input_ids", "labels")}


class RMStage(Stage):
    @staticmethod
    def check_model(c, meta) -> None:
        check_positions(c, meta)
        config = meta.config
        if getattr(config, "vision_config", None) is not None:
            from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES
            if config.model_type not in MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES:
                raise ArgumentError(f"stage rm saves the reward model as transformers' sequence classifier of its "
                                    f"family (AutoModelForSequenceClassification), and transformers has none for "
                                    f"{config.model_type} ({type(meta).__name__}): train the reward model from a "
                                    "family that has one (Gemma 3, Qwen3.5), or from the text model alone")

    check_resume = staticmethod(check_resume)

    def __init__(self, c, tokenizer, run_dir: str | None = None):
        self.c, self.text = c, tokenizer
        # a vision-language model's processor: pairs with images are written through it, and it is
        # what the trained reward model's folder saves beside it
        self.media = grid_images.for_run(c, tokenizer, c.tokenizer or c.model)
        self.tokenizer = tokenizer if self.media is None else self.media
        if self.media is not None and run_dir is not None:
            self.media.keep_embedded_in(os.path.join(run_dir, "images"))
        self.fingerprint = fingerprint(c.data + c.eval, c.tokenizer or c.model, False, model_dir=c.model)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        self.pairs = self._read(c.data)
        # rows cut after their longest (data/trim.py): not under retrace: false, whose one program has one shape
        self.trim = c.trim_padding and c.retrace
        self.held: list[tuple[Pair, float]] = []
        if c.eval:
            self.held = self._read(c.eval)
        elif c.eval_fraction:
            self.pairs, self.held = hold_out(self.pairs, c.eval_fraction, c.seed, "pairs")
        self.tokenized = tokenized.made({split: (((p.prompt, p.chosen, p.rejected), p.where) for p, _ in pairs)
                                         for split, pairs in (("train", self.pairs), ("eval", self.held))}, "pair")
        self.columns = STEP_COLUMNS + METRICS + (("eval_loss",) + tuple(f"eval_{m}" for m in METRICS)
                                                 if self.held else ())

    def _read(self, entries: list) -> list[tuple[Pair, float]]:
        out = []
        for entry in entries:
            if self.media is not None:
                self.media.at(entry["path"], entry.get("media_dir"))
            for where, record in records(entry):
                margin = record.get("margin", 0.0)
                if isinstance(margin, bool) or not isinstance(margin, (int, float)):
                    raise ArgumentError(f"{where}: margin (TRL's column: how much the chosen completion should "
                                        f"outscore the rejected one) is a number; got {margin!r}")
                ranked = {k: v for k, v in record.items() if k != "margin"}
                if self.media is not None and images.held(record):
                    pair = image_pair(ranked, where, self.text, self.media)
                    if len(pair.prompt) > self.c.seq:
                        # a row is cut at seq; cut inside the prompt, it would lose image tokens the
                        # step's pixels still fill (text pairs are cut, as TRL cuts them)
                        raise ArgumentError(f"{where}: the prompt is {len(pair.prompt)} tokens with its images, "
                                            f"past rows of seq {self.c.seq}: cutting it would cut its images' "
                                            "tokens; raise seq (max_length), or scale the images down "
                                            "(image_max_pixels)")
                else:
                    images.text_only(record, where, "rm")
                    pair = to_pair(preference(ranked, where), self.text, where, preference_kwargs(record, where),
                                   tools.tools(record, where))
                out.append((replace(pair, where=where), float(margin)))
        if not out:
            raise ArgumentError(f"data: {', '.join(e['path'] for e in entries)} hold no preference pairs")
        return out

    def describe(self, setup) -> list[str]:
        held = f", {len(self.held)} held out" if self.held else ""
        center = self.c.center_rewards_coefficient
        return [f"stage          rm: {len(self.pairs)} preference pairs{held}; {self.c.batch} pairs x "
                f"{self.c.grad_accum} accumulated per step, rows of {self.c.seq} tokens scored at their last token; "
                f"Bradley-Terry loss" + (f" + {center:g} x (r+ + r-)^2" if center else "") + f"; {self.c.steps} steps"]

    def steps_for(self, epochs: float) -> int:
        return epoch_steps(self.c, len(self.pairs), epochs)

    def epoch_items(self) -> tuple[int, str] | None:
        return len(self.pairs), "pairs"

    def objective(self, model):
        return reward_model(self.c, model)

    def _rows(self, items: list[tuple[Pair, float]]) -> dict:
        """The micro-batch of these pairs (scored_rows), with the image inputs of their rows: the
        chosen rows' images, then the rejected rows', each a pair's prompt's."""
        rows = scored_rows([p for p, _ in items], [m for _, m in items], self.c.seq, self.pad)
        return with_media(rows, self.media, [p.media for p, _ in items] * 2)

    def first_inputs(self, batch: int) -> dict:
        return self._rows([self.pairs[i % len(self.pairs)] for i in range(batch)])

    def heaviest_inputs(self, batch: int) -> dict | None:
        """The `batch` pairs whose images fill the most tokens (None without images): the default
        budget fits their micro-batch too, not only the first one."""
        items = heaviest([p.media for p, _ in self.pairs], self.media, batch)
        return None if items is None else self._rows([self.pairs[i] for i in items])

    def forward_inputs(self, batch: int) -> dict | None:
        """With images, the forward-only pass's (an evaluation's rewards), whose smallest plan of a
        vision-language model is larger than its training step's."""
        heaviest_rows = self.heaviest_inputs(batch)
        return None if heaviest_rows is None else {k: v for k, v in heaviest_rows.items() if k != "margin"}

    def _rewards(self, engine, rows: dict) -> torch.Tensor:
        with trim.own_lengths(self.trim):
            return torch.as_tensor(engine(**{k: v for k, v in rows.items() if k != "margin"})).float()

    def step(self, engine, position: int) -> tuple[dict, list, int, int]:
        micro, drawn, first = [], [], position
        for _ in range(self.c.grad_accum):
            items = stream_items(len(self.pairs), self.c.seed, position, self.c.batch, not self.c.disable_shuffling)
            position += self.c.batch
            drawn.append(items)
            micro.append(self._rows([self.pairs[i] for i in items]))
        with trim.own_lengths(self.trim):      # every micro-batch of the step at one length: one program
            try:
                losses, tokens, outputs = step_micro_batches(engine, trim.together(micro, self.trim))
            except NonFiniteError as e:     # on_nonfinite: raise; the run's error names the records
                e.records = failed_records.named(engine, [[self.pairs[i][0].where for i in items] for items in drawn],
                                                 first, self.c.batch, "pairs")
                raise
        return _metrics([o["rewards"].float() for o in outputs]), losses, tokens, position

    def evaluate(self, engine, step: int) -> dict:
        c = self.c
        if not self.held or not c.eval_every or not intervals.evaluates(c, step):
            return {}
        held = self.held if c.eval_batches is None else self.held[:c.eval_batches * c.batch]
        training = engine.model.training
        engine.model.eval()
        try:
            parts, losses = [], []
            for lo in range(0, len(held), c.batch):      # the last micro-batch filled up with the first pairs
                group = [held[(lo + k) % len(held)] for k in range(c.batch)]
                rows = trim.together([self._rows(group)], self.trim)[0]
                rewards = self._rewards(engine, rows)
                n = min(c.batch, len(held) - lo)
                chosen, rejected = rewards[:c.batch][:n], rewards[c.batch:][:n]
                losses.append(reward_loss(chosen, rejected, rows["margin"][:n], c.center_rewards_coefficient))
                parts.append(torch.cat([chosen, rejected]))
        finally:
            engine.model.train(training)
        metrics = _metrics(parts)
        return {"eval_loss": torch.cat(losses).mean().item(), **{f"eval_{k}": v for k, v in metrics.items()}}

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        return f"margin {row['reward_margin']:.4f} | accuracy {row['preference_accuracy']:.2f}", {}

    def checkpoint_extra(self) -> dict:
        return {"stage": saved_keys(self.c)}


def _metrics(parts: list[torch.Tensor]) -> dict:
    """The micro-batches' rewards (each B chosen, then B rejected) -> the mean rewards, their margin
    and the share of pairs whose chosen sequence scores higher."""
    chosen = torch.cat([p[:len(p) // 2] for p in parts])
    rejected = torch.cat([p[len(p) // 2:] for p in parts])
    return preference_metrics(torch.cat([chosen, rejected]), torch.zeros(2 * len(chosen)), 1.0)
