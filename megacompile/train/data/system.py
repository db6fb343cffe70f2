"""LlamaFactory's `default_system`: the system message of every conversation that has none of its
own, in place of whatever its template would write by default (LlamaFactory's templates take it
as their default system; a Hugging Face chat template writes its own default only where the
conversation has no system turn, so giving one replaces it the same way).

A record's own system wins: a `system` column (ShareGPT's and Alpaca's layouts), or a first turn
of role system (`messages`, ShareGPT's `from: system`, TRL's conversational prompt). Text and
text prompt/completion records have no conversation and are left as they are.
"""
from __future__ import annotations


def with_default(record: dict, system: str | None) -> dict:
    """The record with `system` as its system message where it has none."""
    if not system or not isinstance(record, dict) or record.get("system"):
        return record
    for key in ("messages", "conversations"):
        if key in record:
            turns = record[key]
            if not isinstance(turns, list) or _opens_with_system(turns):
                return record
            if key == "conversations" and "messages" not in record:
                return {**record, "system": system}      # ShareGPT's system column (sharegpt.py)
            return {**record, key: [{"role": "system", "content": system}, *turns]}
    if "instruction" in record:
        return {**record, "system": system}              # Alpaca's system column (alpaca.py)
    prompt = record.get("prompt")
    if isinstance(prompt, list) and not _opens_with_system(prompt):
        return {**record, "prompt": [{"role": "system", "content": system}, *prompt]}
    return record


def _opens_with_system(turns: list) -> bool:
    first = turns[0] if turns else None
    return isinstance(first, dict) and (first.get("role") == "system" or first.get("from") == "system")
