"""The tokens that end a model's turn: the tokenizer's EOS and the ids the model folder's
generation_config.json stops generating at (`eos_token_id`, an id or a list). They differ where a
chat model ends its answers with a token of their own: Gemma's <end_of_turn>, Phi-3's <|end|>,
whose tokenizers' EOS is another token. A conversation its template closes with one of them is
trained as the template wrote it, with no EOS after (encoding._closed): TRL adds none to a
conversation, and LlamaFactory's layouts for these models make that token the EOS.
"""
from __future__ import annotations

import json
import os

from ...errors import ArgumentError

FILE = "generation_config.json"
_ATTRIBUTE = "megacompile_turn_ends"     # set on a tokenizer by attach(); read by of()


def read(folder: str) -> frozenset[int]:
    """The ids `folder`'s generation_config.json stops at; none without the file."""
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return frozenset()
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ArgumentError(f"{path} cannot be read as JSON ({e}); fix or remove it (it names the tokens that end "
                            "the model's answers)") from e
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = [ids] if isinstance(ids, int) else ids if ids is not None else []
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ArgumentError(f"{path}: eos_token_id is {config.get('eos_token_id')!r}; it is a token id or a list "
                            "of them")
    return frozenset(ids)


def attach(tokenizer, *folders: str | None) -> None:
    """Keep the turn-ending ids of the first of `folders` that holds generation_config.json on the
    tokenizer, where encoding finds them (of()): the model folder's before a tokenizer folder of
    its own, as generation reads the model's."""
    setattr(tokenizer, _ATTRIBUTE, read(source(*folders) or ""))


def source(*folders: str | None) -> str | None:
    """The first of `folders` that holds generation_config.json."""
    return next((f for f in folders if f and os.path.isfile(os.path.join(f, FILE))), None)


def of(tokenizer) -> frozenset[int]:
    """The ids that end a turn: the tokenizer's EOS and those attach() kept."""
    eos = tokenizer.eos_token_id
    return getattr(tokenizer, _ATTRIBUTE, frozenset()) | (frozenset() if eos is None else frozenset([eos]))
