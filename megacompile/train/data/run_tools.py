"""Tools for the whole run (run.yaml's `tools:`, TRL's `DPOConfig.tools`): the functions every
conversation may call, handed to the chat template with each conversational record that names
none of its own (a record's `tools` column wins, as its chat_template_kwargs do).

    tools:
      - my_tools:get_time                       # a Python function: its JSON schema, from its
                                                # signature and docstring (transformers' get_json_schema)
      - {type: function, function: {name: search, description: ..., parameters: {...}}}
      - {name: search, description: ..., parameters: {...}}    # LlamaFactory's bare description

or the path of a JSON file holding that list. A function is found as reward functions are: on the
Python path, in the working directory, then beside the run.yaml. Records that are not conversations
(text, prompt and completion strings) have no template to write tools and are left as they are, and
so are Alpaca records, whose rendering (alpaca.py) takes no tools.
"""
from __future__ import annotations

import json
import os

from ...errors import ArgumentError
from ...posttrain import rewards
from . import tools as record_tools


def resolve(value, folder: str | None) -> list[dict] | None:
    """run.yaml's `tools` as transformers takes them (None: none given); `folder`: the run.yaml's."""
    if value is None or value == []:
        return None
    if isinstance(value, str):
        path = value if os.path.isabs(value) or folder is None else os.path.join(folder, value)
        if not os.path.isfile(path):
            raise ArgumentError(f"tools: {value!r} is not a file; give a list of tools (module:function names or "
                                "function descriptions) or the path of a JSON file holding one")
        try:
            with open(path, encoding="utf-8") as f:
                value = json.load(f)
        except (OSError, ValueError) as e:
            raise ArgumentError(f"tools: {path} is not a JSON list of function descriptions: {e}") from e
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        raise ArgumentError(f"tools is a list of tools, each a module:function name or a function description "
                            f"({{name, description, parameters}}); got {type(value).__name__}")
    described = [_schema(t, folder) if isinstance(t, str) else t for t in value]
    listed = record_tools.tools({"tools": described}, "tools")
    names = [t["function"]["name"] for t in listed]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ArgumentError(f"tools: {', '.join(twice)} given twice; a template writes each tool once by its name")
    return listed


def _schema(name: str, folder: str | None) -> dict:
    """The JSON schema of the function `name` names, as transformers writes it for a template."""
    from transformers.utils import get_json_schema

    function = rewards.named(name, folder, "tool")
    if not callable(function):
        raise ArgumentError(f"tool {name!r} is not a function; name a Python function or give its description")
    try:
        return get_json_schema(function)
    except Exception as e:  # noqa: BLE001 - transformers says what its docstring or hints lack
        raise ArgumentError(f"tool {name!r}: its JSON schema cannot be made from its signature and docstring "
                            f"({type(e).__name__}: {e}); give each argument a type hint and an Args: line, or "
                            "give the function's description instead") from e


def conversational(record: dict) -> bool:
    """Whether a chat template renders the record: messages, ShareGPT's conversations, or TRL's
    prompt and completions as lists of messages."""
    return ("messages" in record or "conversations" in record
            or any(isinstance(record.get(k), list) for k in ("prompt", "completion", "chosen", "rejected")))


def with_run_tools(record: dict, run: list[dict] | None) -> dict:
    """The run's tools given to a conversational record that gives none of its own."""
    if not run or not conversational(record) or record.get("tools") not in (None, "", []):
        return record       # a record's own tools, even malformed ones (refused where they are read)
    return {**record, "tools": run}
