"""Which tokens of a document the loss counts (its targets), for each kind of record.

A target mask has one bool per token: True where the model is trained to produce that token.
`messages` are rendered with the tokenizer's own chat template; the tokens of each assistant turn
are found as the difference between the conversation rendered up to the turn's start (with the
template's generation prompt, i.e. the assistant header) and rendered through its end. A
template that does not render the earlier turns as a prefix of the later ones cannot be split
this way and is refused, naming the line, unless it marks the assistant's text itself
(`{% generation %}`, marks.py): then the marks say where each turn lies. A turn that calls tools
is an assistant turn (trained); a tool's answer is not (tools.py).

The conversation is tokenised once: the two renderings are found as starts of its text, and the
turn's tokens are those of the whole from the one's end to the other's (a fast tokenizer says
where each token's text lies). Where a token of the whole straddles such an end, or the
tokenizer cannot say, the renderings are tokenised apart and must be token prefixes of the whole.
"""
from __future__ import annotations

from bisect import bisect_left

from ...errors import ArgumentError
from ...posttrain import check_calls, check_texts, check_tools, render
from . import marks, parts
from .tools import calls as call_names


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _text(tokenizer, messages: list, generation_prompt: bool, options: dict, where: str) -> str:
    return render(tokenizer, messages, where, tokenize=False, add_generation_prompt=generation_prompt, **options)


def _is_turn(m) -> bool:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return False
    if m.get("tool_calls"):     # a call may come without text (content null or left out)
        return m.get("content") is None or isinstance(m.get("content"), str)
    return isinstance(m.get("content"), str) or parts.is_parts(m.get("content"))   # parts: a vision model's


def chat(tokenizer, messages: list, train_on_prompt: bool, where: str, tools: list | None = None,
         template_kwargs: dict | None = None, first: int = 0, last_only: bool = False, prompt_turns: bool = False,
         whole_completion: bool = False) -> tuple[list[int], list[bool], list]:
    """Tokens of a conversation, its target mask (assistant turns only, unless train_on_prompt)
    and where each assistant turn lies ([start, end) token spans, in order: cutoff.py). `tools`
    and `template_kwargs` go to the chat template (tools.py); a template that leaves out a tool,
    a call or a turn's text is refused rather than trained on a conversation it dropped. `first`:
    the turns before it are a prompt (TRL's conversational prompt/completion), its assistant
    turns not answers (nor targets, unless `prompt_turns`: TRL's completion_only_loss false with
    assistant_only_loss). `whole_completion` (TRL's completion_only_loss without assistant_only_loss):
    every token from the completion's first answer to the end is a target, what the template writes
    between and after its turns and its other turns (a tool's answer) too. `last_only` (LlamaFactory's
    mask_history): the last answer alone is a target, the earlier ones not even with
    train_on_prompt; all are answers (cutoff.py); the template is told so (`mask_history`: LlamaFactory's
    reasoning layouts then drop the earlier answers' thoughts, named_template.py)."""
    if not isinstance(messages, list) or not messages or not all(_is_turn(m) for m in messages):
        raise ArgumentError(f"{where}: messages must be a non-empty list of {{role, content}} objects with string "
                            "values (ShareGPT's conversations: {from, value}; an assistant turn with tool_calls may "
                            "leave content out)")
    if not getattr(tokenizer, "chat_template", None):
        raise ArgumentError(f"{where}: records with messages need the tokenizer's chat template, and this tokenizer "
                            "has none (chat_template in tokenizer_config.json); use prompt/completion records")
    messages = [{**m, "content": m.get("content") or ""} if m.get("tool_calls") else m for m in messages]
    options = {**(masked_history(template_kwargs) if last_only else template_kwargs or {}),
               **({"tools": tools} if tools else {})}
    called = [call_names(m, where, k) for k, m in enumerate(messages)]
    text = _text(tokenizer, messages, False, options, where)
    check_tools(text, tools, where)
    check_texts(text, messages, where)
    offsets = None
    if marks.marked(tokenizer, tools):
        ids, spans = marks.blocks(tokenizer, messages, text, options, where)
        marked = dict(zip([k for k, m in enumerate(messages) if m["role"] == "assistant"], spans))
    else:
        (ids, offsets), marked = _whole(tokenizer, text), None
    targets = [train_on_prompt] * len(ids)
    answers = []
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for k, message in enumerate(messages):
        if called[k]:
            _check_calls(tokenizer, messages, k, options, where)
        if message["role"] != "assistant" or (k < first and not prompt_turns):
            continue
        start, end = (marked[k] if marked is not None
                      else _turn(tokenizer, messages, k, text, ids, offsets, options, where))
        for i in range(start, end):
            targets[i] = k == last or not last_only
        if end > start and k >= first:
            answers.append((start, end))
    if whole_completion and answers:
        targets[answers[0][0]:] = [True] * (len(ids) - answers[0][0])
    return ids, targets, answers


def masked_history(template_kwargs: dict | None) -> dict:
    """The chat template's settings with LlamaFactory's mask_history: the template is told that the
    last answer alone is trained, and LlamaFactory's reasoning layouts (named_template.py) then write
    the earlier answers without their thoughts, unless preserve_thinking is set. Other templates
    ignore it."""
    return {**(template_kwargs or {}), "mask_history": True}


def _whole(tokenizer, text: str) -> tuple[list[int], list | None]:
    """The conversation's tokens, and where each token's text lies in `text` (None where the
    tokenizer cannot say, or says it out of order)."""
    if getattr(tokenizer, "is_fast", False):
        out = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = [tuple(o) for o in out["offset_mapping"]]
        if all(a[0] <= b[0] for a, b in zip(offsets, offsets[1:])):
            return list(out["input_ids"]), offsets
    return _encode(tokenizer, text, special=False), None


def _at(offsets: list, char: int) -> int | None:
    """The first token whose text starts at or after `char`; None where a token straddles it."""
    i = bisect_left(offsets, (char, -1))
    return None if i and offsets[i - 1][1] > char else i


def _turn(tokenizer, messages: list, k: int, text: str, ids: list[int], offsets: list | None, options: dict,
          where: str) -> tuple[int, int]:
    """Assistant turn k's [start, end) tokens in `ids` (the whole conversation's, `text`): those
    between the conversation rendered up to the turn with the generation prompt and rendered
    through it."""
    head = _text(tokenizer, messages[:k], True, options, where) if k else ""
    upto = _text(tokenizer, messages[:k + 1], False, options, where)
    if offsets is not None and text.startswith(upto) and upto.startswith(head):
        start, end = _at(offsets, len(head)), _at(offsets, len(upto))
        if start is not None and end is not None:
            return start, end
    before = _encode(tokenizer, head, special=False) if k else []
    through = _encode(tokenizer, upto, special=False)
    if ids[:len(through)] != through or through[:len(before)] != before:
        raise ArgumentError(f"{where}: the chat template does not render the conversation up to turn {k} as a "
                            "prefix of the whole, so the assistant's tokens cannot be told apart; give a chat "
                            "template that marks the assistant's text with {% generation %} ... "
                            "{% endgeneration %} (chat_template:), or for Qwen3 and DeepSeek-R1 template: qwen3 or "
                            "deepseekr1 (LlamaFactory's layouts); or use prompt/completion records, or "
                            "train_on_prompt: true")
    return len(before), len(through)


def _check_calls(tokenizer, messages: list, k: int, options: dict, where: str) -> None:
    """Each call of turn k (its function's name) in what the template writes for that turn."""
    before = _text(tokenizer, messages[:k], True, options, where) if k else ""
    through = _text(tokenizer, messages[:k + 1], False, options, where)
    check_calls(through[len(before):] if through.startswith(before) else through, [messages[k]], where, f"turn {k}")


def prompt_completion(tokenizer, prompt: str, completion: str,
                      train_on_prompt: bool) -> tuple[list[int], list[bool], list]:
    """Tokens, targets and the completion's span (as chat())."""
    head = _encode(tokenizer, prompt, special=True)
    tail = _encode(tokenizer, completion, special=False)
    return head + tail, [train_on_prompt] * len(head) + [True] * len(tail), [(len(head), len(head) + len(tail))]


def text(tokenizer, value: str) -> tuple[list[int], list[bool]]:
    ids = _encode(tokenizer, value, special=True)
    return ids, [True] * len(ids)
