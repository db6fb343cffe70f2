"""What a chat template wrote, checked against the conversation it was given: a template leaves
out, without a word, the roles it does not know and contents of a kind it does not read (LLaVA's
reads list contents only, and writes nothing of a string), and training on what is left would be
training on another conversation. Every chat rendering the loss is made from is checked here:
stage sft's (train/data/masking.py), stage dpo's pairs (preference.py) and stage grpo's prompts, each rendered by `render`.
"""
from __future__ import annotations

from ..errors import ArgumentError


def render(tokenizer, messages: list, where: str, what: str = "conversation", **options):
    """`tokenizer.apply_chat_template(messages, **options)`, with a template's own error (jinja's, or
    `raise_exception` in it) said as the project's, naming the record (`where`) and `what` it renders."""
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except Exception as e:  # noqa: BLE001 - whatever the template raises is its own
        raise ArgumentError(f"{where}: the chat template fails on this {what}: {type(e).__name__}: "
                            f"{str(e)[:300]}") from e


def texts(content) -> list[str]:
    """The texts of a turn's content: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                and isinstance(p.get("text"), str)]
    return [content] if isinstance(content, str) else []


def check_texts(text: str, messages: list, where: str) -> None:
    """Each turn's text somewhere in `text`, the rendering of `messages` (a whole conversation, or
    its start). The reasoning before a `</think>` is not looked for (Qwen3's and DeepSeek-R1's
    templates drop it from earlier turns)."""
    for k, message in enumerate(messages):
        looks = [t.strip() for t in texts(message.get("content"))]
        looks = [t.rsplit("</think>", 1)[1].strip() if "</think>" in t else t for t in looks]
        if all(not t or t in text for t in looks):
            continue
        role = message.get("role")
        if role == "tool":
            hint = "give a tokenizer whose chat template renders tool answers (role tool)"
        elif role in ("system", "user", "assistant"):
            hint = ("the template must write each turn's text as it is, and this one changes it or leaves it out "
                    "(one that reads only list contents, [{type: text, text: ...}], writes nothing of a string)")
        else:
            hint = ("its roles are system, user, assistant and tool (ShareGPT's human, gpt, function_call, "
                    "observation); map the file's own with tags")
        raise ArgumentError(f"{where}: the chat template does not write turn {k} (role {role!r}): {hint}")


def check_tools(text: str, tools: list | None, where: str) -> None:
    """Each tool's name (transformers' {type: function, function: {name, ...}}) in `text`."""
    missing = [t["function"]["name"] for t in tools or [] if t["function"]["name"] not in text]
    if missing:
        raise ArgumentError(f"{where}: the chat template does not write the record's tools ({', '.join(missing)}) "
                            "into the conversation: give a tokenizer whose chat template renders tools (its "
                            "apply_chat_template(tools=...)), or leave tools out")


def check_calls(written: str, messages: list, where: str, what: str) -> None:
    """The function name of each tool call of `messages` in `written`, what the template wrote of them."""
    called = [c["function"]["name"] for m in messages for c in m.get("tool_calls") or []
              if isinstance(c, dict) and isinstance(c.get("function"), dict) and isinstance(c["function"].get("name"), str)]
    lost = [n for n in called if n not in written]
    if lost:
        raise ArgumentError(f"{where}: the chat template does not write {what}'s tool call{'s' * (len(lost) > 1)} "
                            f"({', '.join(lost)}): give a tokenizer whose chat template renders tool_calls, or leave "
                            "the calls out")
