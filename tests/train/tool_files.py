"""A word-level tokenizer whose chat template renders tools, tool calls and tool answers (its own
small layout, written to be read token by token), and the same tool-use conversations in TRL's
and LlamaFactory's layouts."""
from __future__ import annotations

import json

from tests.train import files

WORDS = ["get_time", "get_weather", "city", "paris", "rome", "noon", "sunny", "tools:", "brief"]
SPECIAL = ["<|tool|>", "<call>", "</call>"]
TEMPLATE = ("{% if tools %}<|system|> tools: {% for t in tools %}{{ t.function.name }} {% endfor %}<|end|> {% endif %}"
            "{% if brief %}brief {% endif %}"
            "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|assistant|> "
            "{% for c in m.tool_calls %}<call> {{ c.function.name }} "
            "{% for k, v in c.function.arguments.items() %}{{ k }} {{ v }} {% endfor %}</call> {% endfor %}<|end|> "
            "{% else %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
TOOLS = [{"name": "get_time", "description": "the time in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
         {"name": "get_weather", "description": "the weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def tokenizer(template: str = TEMPLATE):
    return files.tokenizer(WORDS, SPECIAL, template)


def trl_record(i: int) -> dict:
    """A conversation that calls a tool (two at once when i is odd), reads the answer and replies,
    in TRL's layout: tool_calls on the assistant's turn, role tool for the answer (one turn, as
    LlamaFactory's turns alternate)."""
    city = ("paris", "rome")[i % 2]
    calls = [{"type": "function", "function": {"name": "get_time", "arguments": {"city": city}}}]
    answer = "noon"
    if i % 2:
        calls.append({"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}})
        answer = "noon sunny"
    messages = [{"role": "user", "content": files.SENTENCES[(i + 8) % len(files.SENTENCES)]},
                {"role": "assistant", "tool_calls": calls}, {"role": "tool", "content": answer}]
    messages.append({"role": "assistant", "content": files.SENTENCES[(i * 3 + 1) % len(files.SENTENCES)]})
    return {"messages": messages, "tools": [{"type": "function", "function": t} for t in TOOLS]}


def llamafactory_record(i: int) -> dict:
    """trl_record(i) as LlamaFactory's ShareGPT writes it (glaive's layout): a function_call turn
    holding the calls as JSON, observation turns, the tools as one JSON string."""
    out = []
    for m in trl_record(i)["messages"]:
        if m.get("tool_calls"):
            calls = [c["function"] for c in m["tool_calls"]]
            out.append({"from": "function_call", "value": json.dumps(calls[0] if len(calls) == 1 else calls)})
        else:
            out.append({"from": {"user": "human", "assistant": "gpt", "tool": "observation"}[m["role"]],
                        "value": m["content"]})
    return {"conversations": out, "tools": json.dumps(TOOLS)}
