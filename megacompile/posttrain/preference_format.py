"""TRL's preference records (its "Dataset formats"), brought to one shape: {prompt, chosen,
rejected}, all text or all messages, each checked.

    standard          {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
    conversational    {"prompt": [{"role": "user", ...}], "chosen": [{"role": "assistant", ...}], "rejected": [...]}
    implicit prompt   {"chosen": ..., "rejected": ...}, both text or both conversations: the prompt is
                      what they begin with, as TRL's extract_prompt finds it (the turns they share;
                      for text the characters they share, a space before the first difference left
                      to the completions)

A text prompt beside whole conversations in chosen and rejected (ultrafeedback_binarized's layout)
is the conversations' implicit prompt, as TRL's maybe_extract_prompt reads it.
"""
from __future__ import annotations

from ..errors import ArgumentError

SAME = ("chosen and rejected are the same completion, which prefers nothing (its DPO loss is log 2 whatever the "
        "policy): leave the record out, or give it two different answers")


def trl_record(record: dict, where: str) -> dict:
    """The record as {prompt, chosen, rejected}; `where` (the file and the record) starts each error."""
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise ArgumentError(f"{where}: a preference record needs prompt, chosen and rejected; missing "
                            f"{', '.join(missing)}: give each record both completions (the prompt may be left out "
                            "where chosen and rejected begin with it)")
    record = {k: _calls_with_text(v) for k, v in record.items()}
    chosen, rejected = record["chosen"], record["rejected"]
    for k in ("chosen", "rejected"):
        _check(record[k], where, k)
    if chosen == rejected:
        raise ArgumentError(f"{where}: {SAME}")
    if _is_messages(chosen) != _is_messages(rejected):
        raise ArgumentError(f"{where}: chosen and rejected are one text and one list of messages; give both as text "
                            "or both as messages")
    if "prompt" in record:
        prompt = record["prompt"]
        _check(prompt, where, "prompt")
        if _is_messages(chosen) and not _is_messages(prompt):
            prompt, chosen, rejected = _extract(chosen, rejected, where, beside=True)
        elif _is_messages(prompt) and not _is_messages(chosen):
            raise ArgumentError(f"{where}: the prompt is messages and chosen and rejected are text; give them as "
                                'messages too ([{"role": "assistant", "content": ...}])')
    else:
        prompt, chosen, rejected = _extract(chosen, rejected, where, beside=False)
    if not _is_messages(prompt) and not prompt.strip():
        raise ArgumentError(f"{where}: the prompt is empty; DPO scores each completion given its prompt: give one")
    for k, completion in (("chosen", chosen), ("rejected", rejected)):
        text = completion if isinstance(completion, str) else "".join(m["content"] for m in completion)
        calls = isinstance(completion, list) and any(m.get("tool_calls") for m in completion)
        if not text.strip() and not calls:
            raise ArgumentError(f"{where}: {k} is empty; give the {k} completion's text")
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _calls_with_text(value):
    """Turns that call tools with their text as "" where they leave it out (TRL's tool_calls turns)."""
    if not isinstance(value, list):
        return value
    return [{**m, "content": m.get("content") or ""} if isinstance(m, dict) and m.get("tool_calls") else m
            for m in value]


def _is_messages(value) -> bool:
    return isinstance(value, list)


def _check(value, where: str, key: str) -> None:
    if isinstance(value, str):
        return
    if not isinstance(value, list) or not all(_is_message(m) for m in value):
        raise ArgumentError(f"{where}: {key} is text or a list of messages {{role, content}} with string values; got "
                            f"{_shown(value)}")
    if not value:
        raise ArgumentError(f"{where}: {key} is an empty list of messages; give its turns")


def _is_message(m) -> bool:
    return isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)


def _extract(chosen, rejected, where: str, beside: bool):
    """TRL's extract_prompt: the longest start the two share is the prompt."""
    shared = 0
    for a, b in zip(chosen, rejected):
        if a != b:
            break
        shared += 1
    if isinstance(chosen, str) and 0 < shared < min(len(chosen), len(rejected)) and chosen[shared - 1] == " ":
        shared -= 1                 # the space before the first difference begins the completions
    what = "the turns" if isinstance(chosen, list) else "the text"
    if shared == 0:
        fix = ("give the prompt as messages" if beside else "give a prompt column") + \
              ", or begin both with the same conversation"
        raise ArgumentError(f"{where}: chosen and rejected share no start to read as the prompt ({what} they begin "
                            f"with, as TRL extracts it); {fix}")
    if shared >= min(len(chosen), len(rejected)):
        raise ArgumentError(f"{where}: one of chosen and rejected is the start of the other, which leaves it no "
                            f"completion after the shared prompt; give each its own answer")
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
