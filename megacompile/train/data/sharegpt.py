"""Conversations in ShareGPT's layout, read as chat messages (as LlamaFactory reads them).

    {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}],
     "system": "..."}       # optional

ShareGPT names the speakers `human` and `gpt` and keys a turn `from` / `value`; a chat template
and the loss mask (masking.py, which counts `assistant` turns) take `role` / `content` and
`user` / `assistant`. Turns in either layout, under `conversations` or `messages`, are mapped;
LlamaFactory's `function_call` turn becomes an assistant turn with tool_calls and its
`observation` a `tool` turn (tools.py); other roles pass through to the template as they are.

A dataset LlamaFactory's dataset_info.json marks `formatting: sharegpt` is read, under stages sft
and kto (config_data.py), as its converter reads it, which skips (with a warning) a conversation
whose turns, after a first system turn, do not alternate between the user's side (human,
observation) and the assistant's (gpt, function_call), starting with the user's, or that does not
end on the assistant's: broken() says why, and reading.py skips it.
"""
from __future__ import annotations

from . import tools

ROLES = {"human": "user", "gpt": "assistant", "system": "system", "observation": "tool"}
# the two sides a conversation alternates between, in LlamaFactory's names and OpenAI's
SIDES = (("human", "observation", "user", "tool"), ("gpt", "function_call", "assistant"))
UNPAIRED = "whose turns do not alternate user, assistant, user, ... (two of one side in a row, or the assistant first)"
UNANSWERED = "whose last turn is the user's (no answer after it)"
EMPTY = "with no turns"
UNKNOWN = ("with a turn neither the user's nor the assistant's (a role the dataset's tags do not map, or a system "
           "turn after the first)")


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


def broken(record: dict) -> str | None:
    """Why LlamaFactory's ShareGPT reading skips this conversation (UNKNOWN, UNPAIRED, UNANSWERED,
    EMPTY), or None: one it trains, or one malformed otherwise (turns that are not {from, value} or
    {role, content}), which is refused where it is read, naming its line. A ranking record (chosen
    and rejected) is read by ranking.py."""
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list) or "chosen" in record or "rejected" in record:
        return None
    found = [t.get("from", t.get("role")) if isinstance(t, dict) else None for t in turns]
    if not all(isinstance(r, str) for r in found):
        return None
    if found and found[0] == "system":
        found = found[1:]
    if not found:
        return EMPTY
    if any(role not in SIDES[0] + SIDES[1] for role in found):
        return UNKNOWN
    if any(role not in SIDES[k % 2] for k, role in enumerate(found)):
        return UNPAIRED
    return UNANSWERED if len(found) % 2 else None
