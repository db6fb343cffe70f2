"""Preference pairs for DPO: read from jsonl, packed chosen-then-rejected into one batch, the
reference's log-probabilities computed once before training (the policy at step 0 is the
reference: one forward-only pass of the same engine, no second copy of the weights), and the
held-out metrics: implicit-reward margins and preference accuracy."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ArgumentError
from .logprobs import IGNORE


@dataclass(frozen=True)
class Pair:
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def read_pairs(path: str | Path, tokenizer) -> list[Pair]:
    """jsonl records {"prompt", "chosen", "rejected"}, each text (the completions end with the
    tokenizer's eos) or, for conversations, lists of messages that the tokenizer's chat template
    renders (the prompt with the generation prompt added)."""
    pairs = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in record]
        if missing:
            raise ArgumentError(f"{path}:{n}: a preference record needs prompt, chosen and rejected; "
                                f"missing {', '.join(missing)}")
        pairs.append(to_pair(record, tokenizer, f"{path}:{n}"))
    return pairs


def to_pair(record: dict, tokenizer, where: str = "a preference record") -> Pair:
    """A {prompt, chosen, rejected} record's tokens (text, or messages rendered by the chat
    template). stage dpo reads LlamaFactory's ranking layouts into this one first
    (train/data/ranking.py)."""
    prompt = record["prompt"]
    if isinstance(prompt, list):
        # Rendered as text, then split where the prompt ends: the completion is what the template
        # adds after the generation prompt (its end-of-turn marks included).
        head = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        completions = []
        for k in ("chosen", "rejected"):
            full = tokenizer.apply_chat_template(prompt + record[k], tokenize=False)
            if not full.startswith(head):
                raise ArgumentError(f"{where}: the chat template renders the {k} conversation without the prompt's "
                                    f"rendering as its start; give the prompt and completions as text instead")
            completions.append(tokenizer(full[len(head):], add_special_tokens=False)["input_ids"])
    else:
        prompt_ids = tokenizer(prompt)["input_ids"]
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        completions = [tokenizer(record[k], add_special_tokens=False)["input_ids"] + eos for k in ("chosen", "rejected")]
    return Pair(tuple(prompt_ids), tuple(completions[0]), tuple(completions[1]))


def pack(pairs: list[Pair], seq: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """(2B, seq) input_ids and labels: prompt + chosen rows, then prompt + rejected rows in the same
    order; labels count the completion tokens only (IGNORE on the prompt and the padding). A
    completion longer than the row is cut; a prompt that leaves no room for one is refused."""
    rows = [p.prompt + p.chosen for p in pairs] + [p.prompt + p.rejected for p in pairs]
    prompts = [len(p.prompt) for p in pairs] * 2
    ids = torch.full((len(rows), seq + 1), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), seq), IGNORE, dtype=torch.long)
    for r, (row, start) in enumerate(zip(rows, prompts)):
        if start >= seq + 1:
            raise ArgumentError(f"a prompt of {start} tokens leaves no room for its completion in rows of {seq} "
                                f"tokens: raise the sequence length (max_length) or shorten the prompt")
        row = row[:seq + 1]
        ids[r, :len(row)] = torch.tensor(row)
        # labels[t] is the token after position t: the completion's tokens sit at t >= start - 1
        labels[r, start - 1:len(row) - 1] = torch.tensor(row[start:])
    return {"input_ids": ids[:, :-1].contiguous(), "labels": labels}


def reference_logps(engine, batches: list[dict]) -> list[torch.Tensor]:
    """Each batch's rows' log p(completion | prompt) under the weights the engine holds now (before
    the first step: the reference), by the objective's forward-only pass."""
    return [torch.as_tensor(engine(input_ids=b["input_ids"], labels=b["labels"])).float().clone() for b in batches]


def preference_metrics(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> dict[str, float]:
    """(2B,) sequence log-probabilities of a packed batch under the policy and the reference -> the
    mean implicit rewards, their margin and the share of pairs whose chosen reward is the larger."""
    half = policy.shape[0] // 2
    chosen = beta * (policy[:half] - reference[:half])
    rejected = beta * (policy[half:] - reference[half:])
    return {"rewards_chosen": chosen.mean().item(), "rewards_rejected": rejected.mean().item(),
            "reward_margin": (chosen - rejected).mean().item(),
            "preference_accuracy": (chosen > rejected).float().mean().item()}
