"""`stage: pt`, LlamaFactory's pretraining: each record is read as one plain text, every token
trained, no chat template. The text is the one LlamaFactory's pretraining reads, the first turn
of the record's prompt:

    {"text": ...}                                   the text
    Alpaca (instruction, input; output optional)    the instruction and the input joined by a
                                                    newline; with history, its first question
    ShareGPT conversations, or messages             the first turn after the system prompt

LlamaFactory's own pretraining datasets are Alpaca records whose prompt column is the text
(`"columns": {"prompt": "text"}`), which the entry's columns rename to `instruction`. A record
in another layout (TRL's prompt/completion) or with images is refused by name: a pretraining run
that quietly read a different text than the user meant would train on it for days.
"""
from __future__ import annotations

from ...errors import ArgumentError
from . import sharegpt


def record(record: dict, where: str) -> dict:
    """The record as stage pt reads it: {"text": ...}."""
    if record.get("images") or record.get("videos"):
        raise ArgumentError(f"{where}: the record has {'videos' if record.get('videos') else 'images'}, and stage pt "
                            "trains text alone (as LlamaFactory's pretraining does); give text records, or train "
                            "the images under stage: sft")
    return {"text": _text(record, where)}


def _text(record: dict, where: str) -> str:
    if "messages" in record or "conversations" in record:
        turns = sharegpt.messages(record, where)
        first = next((m for m in turns if not (isinstance(m, dict) and m.get("role") == "system")), None) \
            if isinstance(turns, list) else None
        if not isinstance(first, dict) or not isinstance(first.get("content"), str):
            raise ArgumentError(f"{where}: stage pt reads a conversation's first turn after the system prompt as its "
                                "text, and this record has no such turn of text ({role, content} or ShareGPT's "
                                "{from, value})")
        return first["content"]
    if "instruction" in record:
        history = record.get("history") or []
        if history:
            if not isinstance(history, list) or not isinstance(history[0], (list, tuple)) or \
                    not history[0] or not isinstance(history[0][0], str):
                raise ArgumentError(f"{where}: an Alpaca record's history is a list of [question, answer] pairs of "
                                    "strings")
            return history[0][0]
        parts = [record.get("instruction"), record.get("input")]
        if not all(p is None or isinstance(p, str) for p in parts):
            raise ArgumentError(f"{where}: an Alpaca record's instruction and input are strings")
        return "\n".join(p for p in parts if p)
    if isinstance(record.get("text"), str):
        return record["text"]
    raise ArgumentError(f"{where}: stage pt reads text: a record's text, an Alpaca record's instruction (LlamaFactory's "
                        "pretraining datasets map their text column to it: \"columns\": {\"prompt\": \"text\"}) or a "
                        f"conversation's first turn; this record has {', '.join(sorted(record)) or 'no keys'}: "
                        "name its text column (dataset_text_field, or the entry's columns), or train it under "
                        "stage: sft")
