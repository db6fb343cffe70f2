"""cutoff_len (seq): a supervised record longer than a row is truncated to the row's length as
LlamaFactory truncates it (data/processor/supervised.py and processor_utils.infer_seqlen), so it
trains in one row with its instruction in view, never split across rows (placement.py).

A record's tokens are pairs, one per answer (an assistant turn, or a completion): the prompt (the
tokens since the previous answer: system, user turn, the template's assistant header) and the
answer (its end-of-turn tokens, and the EOS closing the document, included). The pairs are taken
in order while the budget (the row length) lasts, each given what infer_seqlen grants it of the
budget left:

    answer * 2 < budget    the answer whole, the prompt cut to the rest
    prompt * 2 < budget    the prompt whole, the answer cut to the rest
    otherwise              both cut, the answer to int(budget * answer / (prompt + answer))

Each part keeps its head. A conversation stops at the turn where the budget is spent: the later
turns are dropped. Tokens after the last answer (a closing user turn) are a last prompt with an
empty answer. A record that fits is kept whole (infer_seqlen keeps every pair whole then).
Plain text (pre-training documents) is not truncated: it may continue across rows.
"""
from __future__ import annotations


def infer_seqlen(prompt: int, answer: int, budget: int) -> tuple[int, int]:
    """(prompt, answer) tokens kept of a pair of these lengths within `budget` tokens."""
    if answer * 2 < budget:
        most_answer = budget
    elif prompt * 2 < budget:
        most_answer = budget - prompt
    else:       # as LlamaFactory computes it, in floating point, rounded down
        most_answer = int(budget * (answer / (prompt + answer)))
    answer_kept = min(most_answer, answer)
    return min(max(budget - answer_kept, 0), prompt), answer_kept


def pairs(length: int, answers: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(prompt start, answer start, answer end) of each pair of a document of `length` tokens whose
    answers lie at `answers` ([start, end), in order)."""
    out, at = [], 0
    for start, end in answers:
        out.append((at, start, end))
        at = end
    if at < length:
        out.append((at, length, length))
    return out


def truncate(ids: list[int], targets: list[bool], answers: list[tuple[int, int]],
             budget: int, last_first: bool = False) -> tuple[list[int], list[bool]]:
    """The record's tokens and targets cut to at most `budget` tokens (unchanged when it fits).
    `last_first` (mask_history): the pairs are granted the budget from the last one back, and the
    earliest are dropped, as LlamaFactory truncates then; the kept pairs stay in their order."""
    if len(ids) <= budget:
        return ids, targets
    ordered = pairs(len(ids), answers)
    kept: list[list[int]] = []
    used = 0
    for prompt_at, answer_at, answer_end in reversed(ordered) if last_first else ordered:
        if used >= budget:
            break
        p, a = infer_seqlen(answer_at - prompt_at, answer_end - answer_at, budget - used)
        kept.append([*range(prompt_at, prompt_at + p), *range(answer_at, answer_at + a)])
        used += p + a
    order = [i for pair in (reversed(kept) if last_first else kept) for i in pair]
    return [ids[i] for i in order], [targets[i] for i in order]
