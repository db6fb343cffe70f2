"""Instruction records in Alpaca's layout, read as chat messages (as LlamaFactory reads them).

    {"instruction": "...", "input": "...", "output": "...",      # input may be empty or absent
     "system": "...", "history": [["earlier question", "earlier answer"], ...]}   # both optional

The question is the instruction and the input joined by a newline (the instruction alone when
the input is empty); `history` turns come first, as user/assistant pairs. The messages then go
through the chat template and its loss mask (masking.py): the assistant turns count, the
history's answers among them (LlamaFactory's default, mask_history false), the rest only with
train_on_prompt.
"""
from __future__ import annotations

from ...errors import ArgumentError


def is_alpaca(record: dict) -> bool:
    return "instruction" in record and "output" in record


def messages(record: dict, where: str) -> list[dict]:
    if not isinstance(record["output"], str):
        raise ArgumentError(f"{where}: an Alpaca record's instruction, input, output and system are strings")
    return prompt(record, where) + [{"role": "assistant", "content": record["output"]}]


def prompt(record: dict, where: str) -> list[dict]:
    """The messages before the answer: the system turn, the history, the question (a preference
    record in LlamaFactory's alpaca ranking layout answers it twice: data/ranking.py)."""
    instruction, query = record["instruction"], record.get("input", "")
    system, history = record.get("system"), record.get("history") or []
    if not all(isinstance(x, str) for x in (instruction, query)) or \
            (system is not None and not isinstance(system, str)):
        raise ArgumentError(f"{where}: an Alpaca record's instruction, input, output and system are strings")
    if not isinstance(history, list) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in history):
        raise ArgumentError(f"{where}: an Alpaca record's history is a list of [question, answer] pairs of strings")
    out = [{"role": "system", "content": system}] if system else []
    for question, answer in history:
        out += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    question = instruction + "\n" + query if query else instruction
    return out + [{"role": "user", "content": question}]
