"""TRL's eos_token, taken where it names the tokenizer's own end-of-sequence token.

TRL's SFTConfig writes `eos_token` into its recipes (SmolLM3's names `<|im_end|>`, which is its
tokenizer's own); another token there makes TRL close every record with it instead. megacompile
closes records with the tokenizer's own EOS (the turn ends its chat template writes, data/turn_ends.py),
so the key is taken when it names that token and refused otherwise, before any data is read.
"""
from __future__ import annotations

import json
import os

from ..errors import ArgumentError


PLACEHOLDER = "<EOS_TOKEN>"    # what TRL's config dumps write for "the tokenizer's own"


def check(c) -> None:
    if c.eos_token == PLACEHOLDER:
        c.eos_token = None
    if c.eos_token is None:
        return
    if c.bundled:
        raise ArgumentError("eos_token: the bundled model reads bytes and takes no tokenizer; leave it out")
    own = tokenizer_eos(c.tokenizer or c.model)
    if c.eos_token != own:
        raise ArgumentError(f"eos_token {c.eos_token!r}: megacompile closes each record with the tokenizer's own "
                            f"end-of-sequence token, {own!r} ({c.tokenizer or c.model}); leave eos_token out, or give "
                            "a tokenizer whose EOS it is")


def tokenizer_eos(folder: str) -> str | None:
    """The EOS the tokenizer folder's tokenizer_config.json names (a string, or added-token dict);
    transformers' tokenizer's where the file does not name one."""
    path = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            eos = json.load(f).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            return eos
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder).eos_token
