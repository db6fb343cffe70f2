"""Preference pairs for DPO: read from record files in TRL's layouts (preference_format.py),
tokenised as TRL's DPOTrainer tokenises them, packed chosen-then-rejected into one batch, the
reference's log-probabilities computed once before training (the policy at step 0 is the
reference: one forward-only pass of the same engine, no second copy of the weights), and the
held-out metrics: implicit-reward margins and preference accuracy."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ArgumentError
from .logprobs import IGNORE
from .preference_format import SAME, trl_record
from .record_files import read_records
from .rendered import check_calls, check_texts, check_tools, render


@dataclass(frozen=True)
class Pair:
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    # a vision-language model's pair: the prompt's images (paths) and videos, in order, which the
    # chosen and the rejected rows each hold (train/data/image_answers.py)
    media: tuple = ()
    # the record it was read from, as the run names a record (data/reading.py), for a failed step's
    # error to name (train/stages/failed_records.py); two records' equal tokens are equal pairs
    where: str = field(default="", compare=False)


def read_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """The pairs of a .jsonl, .json, .parquet or .csv file of TRL's preference records (standard,
    conversational or with an implicit prompt)."""
    return [to_pair(record, tokenizer, where) for where, record in read_records(path)]


def to_pair(record: dict, tokenizer, where: str = "a preference record", template_kwargs: dict | None = None,
            tools: list | None = None) -> Pair:
    """A TRL preference record's tokens, as TRL's DPOTrainer makes them: the completions are the
    tokens of prompt + completion after the prompt's own tokens. Text: the completions end with the
    tokenizer's eos (added unless the text ends with it), the prompt tokenised with the tokenizer's
    special tokens. Messages: rendered by the chat template, the prompt with the generation prompt,
    no eos added (the template ends the turn), `template_kwargs` and `tools` (transformers' tool
    descriptions) handed to the template, which must write each tool and each call of a completion.
    stage dpo reads LlamaFactory's ranking layouts into TRL's first (train/data/ranking.py)."""
    record = trl_record(record, where)
    prompt_ids, completions = tokenised(record["prompt"], {k: record[k] for k in ("chosen", "rejected")}, tokenizer,
                                        where, template_kwargs, tools)
    if completions[0] == completions[1]:
        raise ArgumentError(f"{where}: {SAME} (their tokens are equal)")
    return Pair(tuple(prompt_ids), tuple(completions[0]), tuple(completions[1]))


def tokenised(prompt, completions: dict, tokenizer, where: str, template_kwargs: dict | None = None,
              tools: list | None = None) -> tuple[list[int], list[list[int]]]:
    """The prompt's tokens and each completion's ({name: completion}, text or messages as the
    prompt is), as TRL tokenises them (to_pair's docstring); a completion without tokens is refused
    by its name."""
    if tools and not isinstance(prompt, list):
        raise ArgumentError(f"{where}: the record gives tools, which a chat template renders: give the prompt and "
                            "completions as messages")
    if isinstance(prompt, list):
        def written(messages, **kw):
            text = render(tokenizer, messages, where, "pair", tokenize=False, **(template_kwargs or {}),
                          **({"tools": tools} if tools else {}), **kw)
            check_texts(text, messages, where)
            return text
        prompt_text = written(prompt, add_generation_prompt=True)
        check_tools(prompt_text, tools, where)
        check_calls(prompt_text, prompt, where, "the prompt")
        prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        out = []
        for k, completion in completions.items():
            text = written(prompt + completion)
            check_calls(text[len(prompt_text):] if text.startswith(prompt_text) else text, completion, where, k)
            full = tokenizer(text, add_special_tokens=False)["input_ids"]
            if full[:len(prompt_ids)] != prompt_ids:
                raise ArgumentError(f"{where}: the chat template renders the prompt and {k} without the prompt's "
                                    "rendering (with its generation prompt) as their start, so no token separates "
                                    "prompt from completion; give the prompt and completions as text instead")
            out.append(full[len(prompt_ids):])
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
        eos = tokenizer.eos_token
        out = []
        for completion in completions.values():
            text = completion if eos is None or completion.endswith(eos) else completion + eos
            joint = tokenizer(prompt + text)["input_ids"]
            if joint[:len(prompt_ids)] == prompt_ids:
                out.append(joint[len(prompt_ids):])
            else:
                # The text joins across the boundary (no space between prompt and completion, say):
                # cut there, TRL's tokens would split a word; the completion is tokenised alone.
                out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if not prompt_ids:
        raise ArgumentError(f"{where}: the prompt has no tokens; give it text")
    for k, ids in zip(completions, out):
        if not ids:
            raise ArgumentError(f"{where}: {k} has no tokens after the prompt's; give the {k} completion's text")
    return prompt_ids, out


def pack(pairs: list[Pair], seq: int, pad_id: int = 0, keep: str = "keep_start") -> dict[str, torch.Tensor]:
    """(2B, seq) input_ids and labels: prompt + chosen rows, then prompt + rejected rows in the same
    order; labels count the completion tokens only (IGNORE on the prompt and the padding). A row
    longer than seq is cut as TRL's DPOTrainer and KTOTrainer cut prompt + completion at max_length
    (`keep`, its truncation_mode): keep_start keeps its first seq tokens, keep_end its last, so the
    completion tokens scored are those among them. Under keep_start a prompt that leaves no room
    for one (seq tokens or more) is refused: the stages drop such pairs as TRL does
    (train/stages/truncation.py)."""
    return pack_rows([(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs], seq, pad_id,
                     keep)


def pack_rows(rows: list[tuple[tuple, tuple]], seq: int, pad_id: int = 0,
              keep: str = "keep_start") -> dict[str, torch.Tensor]:
    """(N, seq) input_ids and labels of N (prompt, completion) token rows, as pack() lays them."""
    prompts = [len(prompt) for prompt, _ in rows]
    rows = [prompt + completion for prompt, completion in rows]
    ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq), IGNORE, dtype=torch.long)
    for r, (row, start) in enumerate(zip(rows, prompts)):
        if keep == "keep_end":
            # TRL's keep_end: the row's last seq tokens; its first is then only read, never a target
            cut = max(len(row) - seq, 0)
            row, start = row[cut:], max(start - cut, 1)
        elif start >= seq:
            raise ArgumentError(f"a prompt of {start} tokens leaves no room for its completion in rows of {seq} "
                                f"tokens: raise the sequence length (max_length) or shorten the prompt")
        else:
            # TRL's keep_start: prompt + completion cut at seq tokens; a row's last token is then
            # only a target (the model reads seq tokens and scores the seq - 1 after the first)
            row = row[:seq]
        ids[r, :len(row)] = torch.tensor(row)
        # labels[t] is the token after position t: the completion's tokens sit at t >= start - 1
        labels[r, start - 1:len(row) - 1] = torch.tensor(row[start:])
    return {"input_ids": ids, "labels": labels}


def reference_logps(engine, batches: list[dict]) -> list[torch.Tensor]:
    """Each batch's rows' log p(completion | prompt) under the weights the engine holds now (before
    the first step: the reference), by the objective's forward-only pass."""
    return [torch.as_tensor(engine(input_ids=b["input_ids"], labels=b["labels"])).float().clone() for b in batches]


def preference_metrics(policy: torch.Tensor, reference: torch.Tensor, beta: float,
                       tokens: torch.Tensor | None = None) -> dict[str, float]:
    """(2B,) sequence log-probabilities of a packed batch under the policy and the reference -> the
    mean implicit rewards, their margin and the share of pairs whose chosen reward is the larger.
    With `tokens` ((2B,) completion lengths), the rewards are beta x log-probability per token, as
    TRL's CPO and ORPO trainers and LlamaFactory reward the reference-free losses (the reference is
    then zeros)."""
    if tokens is not None:
        policy = policy / tokens.clamp(min=1)
    half = policy.shape[0] // 2
    chosen = beta * (policy[:half] - reference[:half])
    rejected = beta * (policy[half:] - reference[half:])
    return {"rewards_chosen": chosen.mean().item(), "rewards_rejected": rejected.mean().item(),
            "reward_margin": (chosen - rejected).mean().item(),
            "preference_accuracy": (chosen > rejected).float().mean().item()}
