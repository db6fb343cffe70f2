"""run.yaml's `chat_template` (TRL's `chat_template_path`): the chat template conversations are
rendered with in place of the tokenizer's own, read from a Jinja file or from a folder that holds a
tokenizer's template. A model whose own template cannot be masked (Qwen3's, masking.py) trains
with one that marks the assistant's text (marks.py); the trained model is written with the
template it was trained with, as TRL writes it.
"""
from __future__ import annotations

import hashlib
import json
import os

from ...errors import ArgumentError
from .marks import without_marks

_FILES = ("chat_template.jinja", "tokenizer_config.json", "chat_template.json")


def read(path: str) -> str:
    """The template text at `path`: a Jinja file, or a folder's chat_template.jinja, else the
    `chat_template` of its tokenizer_config.json or chat_template.json (the default one of named
    templates). Refused, naming the path, where there is none or it is not Jinja."""
    text = _folder(path) if os.path.isdir(path) else _file(path)
    _check_syntax(text, path)
    return text


def digest(text: str) -> str:
    """What a token file made with this template records (tokens.py): another template, other tokens."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ArgumentError(f"chat_template: cannot read {path}: {getattr(e, 'strerror', None) or e}") from e
    if path.endswith(".json"):
        return _from_json(text, path)
    if not text.strip():
        raise ArgumentError(f"chat_template: {path} is empty; give a Jinja chat template")
    return text


def _folder(path: str) -> str:
    for name in _FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            try:
                return _file(file)
            except ArgumentError:
                if name == "chat_template.jinja":
                    raise
    raise ArgumentError(f"chat_template: {path} holds no chat template ({', '.join(_FILES)}); give a folder "
                        "that does, or the template's .jinja file")


def _from_json(text: str, path: str) -> str:
    try:
        template = json.loads(text).get("chat_template")
    except (ValueError, AttributeError) as e:
        raise ArgumentError(f"chat_template: {path} is not a JSON object") from e
    if isinstance(template, list):      # named templates: [{name, template}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ArgumentError(f"chat_template: {path} has no chat_template (a default one, where it names several)")
    return template


def _check_syntax(text: str, path: str) -> None:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
    try:       # transformers' own tags ({% generation %}) are not Jinja's: read without them
        env.parse(without_marks(text))
    except jinja2.TemplateSyntaxError as e:
        raise ArgumentError(f"chat_template: {path} is not a valid Jinja template: line {e.lineno}: "
                            f"{e.message}") from e
