"""Which tokens of a document the loss counts (its targets), for each kind of record.

A target mask has one bool per token: True where the model is trained to produce that token.
`messages` are rendered with the tokenizer's own chat template; the tokens of each assistant turn
are found as the difference between the conversation rendered up to the turn's start (with the
template's generation prompt, i.e. the assistant header) and rendered through its end. A
template that does not render the earlier turns as a prefix of the later ones cannot be split
this way and is refused, naming the line.
"""
from __future__ import annotations

from ...errors import ArgumentError


def _encode(tokenizer, text: str, special: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _render(tokenizer, messages: list, generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return _encode(tokenizer, text, special=False)    # the template writes its own special tokens


def chat(tokenizer, messages: list, train_on_prompt: bool, where: str) -> tuple[list[int], list[bool], list]:
    """Tokens of a conversation, its target mask (assistant turns only, unless train_on_prompt)
    and where each assistant turn lies ([start, end) token spans, in order: cutoff.py)."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise ArgumentError(f"{where}: messages must be a non-empty list of {{role, content}} objects with string "
                            "values (ShareGPT's conversations: {from, value})")
    if not getattr(tokenizer, "chat_template", None):
        raise ArgumentError(f"{where}: records with messages need the tokenizer's chat template, and this tokenizer "
                            "has none (chat_template in tokenizer_config.json); use prompt/completion records")
    ids = _render(tokenizer, messages, generation_prompt=False)
    targets = [train_on_prompt] * len(ids)
    answers = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:k], generation_prompt=True) if k else []
        through = _render(tokenizer, messages[:k + 1], generation_prompt=False)
        if ids[:len(through)] != through or through[:len(before)] != before:
            raise ArgumentError(f"{where}: the chat template does not render the conversation up to turn {k} as a "
                                "prefix of the whole, so the assistant's tokens cannot be told apart; use "
                                "prompt/completion records, or train_on_prompt: true")
        for i in range(len(before), len(through)):
            targets[i] = True
        if len(through) > len(before):
            answers.append((len(before), len(through)))
    return ids, targets, answers


def prompt_completion(tokenizer, prompt: str, completion: str,
                      train_on_prompt: bool) -> tuple[list[int], list[bool], list]:
    """Tokens, targets and the completion's span (as chat())."""
    head = _encode(tokenizer, prompt, special=True)
    tail = _encode(tokenizer, completion, special=False)
    return head + tail, [train_on_prompt] * len(head) + [True] * len(tail), [(len(head), len(head) + len(tail))]


def text(tokenizer, value: str) -> tuple[list[int], list[bool]]:
    ids = _encode(tokenizer, value, special=True)
    return ids, [True] * len(ids)
