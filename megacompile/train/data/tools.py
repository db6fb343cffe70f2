"""Tool use in chat records: the tools a conversation may call, the turns that call them and the
turns that answer, as TRL and LlamaFactory write them, made into the messages and `tools` that a
chat template renders (transformers' tool-use layout).

    TRL           {"messages": [..., {"role": "assistant", "tool_calls": [{"type": "function",
                   "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "content": "noon"}, ...],
                   "tools": [{"type": "function", "function": {"name": ..., "parameters": ...}}],
                   "chat_template_kwargs": {...}}      # optional, handed to the template
    LlamaFactory  {"conversations": [..., {"from": "function_call",
                   "value": "{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}"},
                   {"from": "observation", "value": "noon"}, ...],
                   "tools": "[{\"name\": \"get_time\", \"description\": ..., \"parameters\": ...}]"}

`tools` may be a JSON string (a table column holds one type); a tool given as a bare function
description ({name, description, parameters}, LlamaFactory's) is wrapped as {"type": "function",
"function": ...}, as LlamaFactory writes it for its templates. A function_call turn (one call, or
a list for parallel calls) is the assistant's, trained as any assistant turn; an observation is
the tool's answer (role tool), not trained, as LlamaFactory and TRL mask it. A call's arguments
are kept as the record gives them (an object, or a string the template writes as it is).
"""
from __future__ import annotations

import json
from typing import Any

from ...errors import ArgumentError

# The keys apply_chat_template sets itself: a record's chat_template_kwargs may not set them.
RENDER_KEYS = ("conversation", "messages", "tools", "documents", "add_generation_prompt", "tokenize",
               "continue_final_message", "return_dict", "return_assistant_tokens_mask", "chat_template")


def tools(record: dict, where: str) -> list[dict] | None:
    """The record's tools as transformers takes them; None when it has none."""
    value = record.get("tools")
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        value = _json(value, where, "tools")
        if value is None or value == []:
            return None
    listed = [value] if isinstance(value, dict) else value
    if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
        raise ArgumentError(f"{where}: tools is a list of function descriptions (JSON objects, or one JSON string "
                            f"of them); got {_short(record.get('tools'))}")
    out = []
    for tool in listed:
        if isinstance(tool.get("function"), dict):
            described = tool["function"]
        elif "name" in tool:
            described, tool = tool, {"type": "function", "function": tool}
        else:
            raise ArgumentError(f"{where}: a tool is {{type: function, function: {{name, description, parameters}}}} "
                                f"or a bare {{name, description, parameters}}; got {_short(tool)}")
        if not isinstance(described.get("name"), str) or not described["name"]:
            raise ArgumentError(f"{where}: a tool has no name: {_short(tool)}")
        out.append(tool)
    return out


def template_kwargs(record: dict, where: str) -> dict:
    """TRL's per-record chat_template_kwargs (enable_thinking, say), checked; a run's own
    (run.yaml's chat_template_kwargs) are laid under them as the data is read (reading.py)."""
    return checked_kwargs(record.get("chat_template_kwargs"), f"{where}: chat_template_kwargs")


def checked_kwargs(value: Any, what: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ArgumentError(f"{what} is a mapping of the chat template's own settings (enable_thinking: false, "
                            f"say); got {_short(value)}")
    taken = sorted(set(value) & set(RENDER_KEYS))
    if taken:
        raise ArgumentError(f"{what} sets {', '.join(taken)}, which the rendering of the loss mask sets itself; "
                            "give tools as the records' tools, and leave the others out")
    return dict(value)


def call_turn(value: Any, where: str, turn: int) -> dict:
    """LlamaFactory's function_call turn as an assistant message with tool_calls."""
    calls = _json(value, where, f"the function_call of turn {turn}") if isinstance(value, str) else value
    listed = [calls] if isinstance(calls, dict) else calls
    if not isinstance(listed, list) or not listed:
        raise ArgumentError(f"{where}: turn {turn} (function_call) holds a call {{name, arguments}} as JSON, or a "
                            f"list of them; got {_short(value)}")
    made = []
    for call in listed:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
            raise ArgumentError(f"{where}: turn {turn} (function_call): each call is {{name, arguments}}; got "
                                f"{_short(call)}")
        made.append({"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}})
    return {"role": "assistant", "content": "", "tool_calls": made}


def calls(message: dict, where: str, turn: int) -> list[str]:
    """The function names an assistant message calls (TRL's / OpenAI's tool_calls), checked; []
    for a message without calls."""
    listed = message.get("tool_calls")
    if listed is None or listed == []:
        return []
    if message.get("role") != "assistant":
        raise ArgumentError(f"{where}: turn {turn} has tool_calls and role {message.get('role')!r}; only the "
                            "assistant calls tools")
    found = []
    for call in listed if isinstance(listed, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or "arguments" not in function:
            raise ArgumentError(f"{where}: turn {turn}: each of tool_calls is {{type: function, function: {{name, "
                                f"arguments}}}}; got {_short(call if isinstance(listed, list) else listed)}")
        found.append(function["name"])
    return found


def _json(text: str, where: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise ArgumentError(f"{where}: {what} is not valid JSON ({e}): {_short(text)}") from e


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
