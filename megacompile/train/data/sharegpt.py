"""Conversations in ShareGPT's layout, read as chat messages (as LlamaFactory reads them).

    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}],
     "system": "..."}       # optional

ShareGPT names the speakers `human` and `gpt` and keys a turn `from` / `value`; a chat template
and the loss mask (masking.py, which counts `assistant` turns) take `role` / `content` and
`user` / `assistant`. Turns in either layout, under `conversations` or `messages`, are mapped;
LlamaFactory's `function_call` turn becomes an assistant turn with tool_calls and its
`observation` a `tool` turn (tools.py); other roles pass through to the template as they are.
"""
from __future__ import annotations

from . import tools

ROLES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool"}


def messages(record: dict, where: str = "a record") -> list:
    """The record's conversation as [{role, content}, ...]; a malformed one is returned as it is,
    for masking.chat to refuse with the line."""
    turns = record["messages"] if "messages" in record else record["conversations"]
    if not isinstance(turns, list):
        return turns
    out = []
    system = record.get("system")
    if "messages" not in record and isinstance(system, str) and system:
        out.append({"role": "system", "content": system})
    for k, turn in enumerate(turns):
        if isinstance(turn, dict) and "from" in turn and "role" not in turn:
            turn = {"role": turn["from"], "content": turn.get("value")}
        if isinstance(turn, dict) and turn.get("role") == "function_call":
            turn = tools.call_turn(turn.get("content"), where, k)
        if isinstance(turn, dict) and turn.get("role") in ROLES:
            turn = {**turn, "role": ROLES[turn["role"]]}
        out.append(turn)
    return out


def roles(record: dict) -> list[str]:
    """The roles of a chat record's turns as the file writes them (before the mapping); [] for
    other records."""
    turns = record.get("messages", record.get("conversations"))
    if not isinstance(turns, list):
        return []
    found = [t.get("role", t.get("from")) for t in turns if isinstance(t, dict)]
    return [r for r in found if isinstance(r, str)]
