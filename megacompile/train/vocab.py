"""Tokens a run adds to its tokenizer, and the model rows they get: LlamaFactory's `add_tokens`,
`add_special_tokens` (`new_special_tokens` in its earlier releases) and `resize_vocab`.

The tokens (a comma-separated string or a list) are added to the tokenizer wherever the run loads
it (its data, its evaluation, the exported folder), as LlamaFactory's patch_tokenizer adds them;
tokens it adds turn resize_vocab on, as there. With resize_vocab, a tokenizer longer than the
model's embedding grows the model to its length rounded up to a multiple of 64 (transformers'
resize_token_embeddings, pad_to_multiple_of 64: config.vocab_size is set before the model is
built, so the plan, the LoRA skeleton and the export all see it), and the added tokens' rows start
at the mean of the other rows plus noise of std 1/sqrt(hidden), LlamaFactory's noise_init; the
rows arrive as the weights stream in (io/grown_vocab.py). A token the tokenizer had already keeps
its trained row (LlamaFactory's current release would draw it again).

Under LoRA the embedding and the output projection then train whole beside the adapters, as
LlamaFactory adds them to additional_target when it is not given (stages sft and pt, where
additional_target trains; elsewhere the new rows could not train and the run is refused; so is a
model whose output projection is tied to its embedding, which PEFT's trained copies would untie).
"""
from __future__ import annotations

import os

from ..errors import ArgumentError
from .config_values import flag

KEYS = ("add_tokens", "add_special_tokens")
MULTIPLE = 64


def _tokens(key: str, value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [t.strip() for t in value.split(",")]
    if not isinstance(value, list) or not all(isinstance(t, str) and t.strip() for t in value):
        raise ArgumentError(f"{key} takes tokens, a comma-separated string or a list of strings (e.g. "
                            f"'<tool_call>,</tool_call>'); got {value!r}")
    return [t.strip() for t in value]


def check(c) -> None:
    """The keys read; refused where the new rows could not be made or could not train."""
    c.add_tokens = _tokens("add_tokens", c.add_tokens)
    c.add_special_tokens = _tokens("add_special_tokens", c.add_special_tokens)
    c.resize_vocab = flag("resize_vocab", c.resize_vocab)
    if not (c.add_tokens or c.add_special_tokens or c.resize_vocab):
        return
    for entry in c.data + c.eval:     # tokenised with them: a token file made before is not reused (tokens.py)
        entry["added_tokens"] = c.add_tokens + [f"special:{t}" for t in c.add_special_tokens]
    asked = "resize_vocab" if not (c.add_tokens or c.add_special_tokens) else \
        "add_tokens" if c.add_tokens else "add_special_tokens"
    if c.bundled:
        raise ArgumentError(f"{asked}: the bundled model reads bytes, a vocabulary of 256 no token can be added to; "
                            "give a model folder")
    if getattr(c, "generator", None) == "vllm":
        raise ArgumentError(f"{asked}: vLLM builds the policy it samples from the model folder's config.json and "
                            "tokenizer, which would not have the new tokens: give generator: hf (use_vllm: false)")
    from .methods import WHOLE_STAGES, adapters
    if adapters(c) and c.stage not in WHOLE_STAGES:
        raise ArgumentError(f"{asked}: under LoRA the new tokens' rows train with the embedding and output "
                            f"projection trained whole (additional_target), which stages sft and pt train; under "
                            f"stage {c.stage} they would keep their initialisation: give finetuning_type full, or "
                            "add the tokens in an sft run first")


def add(tokenizer, c) -> list[str]:
    """The run's tokens added to `tokenizer` (a transformers tokenizer, changed in place); the ones
    it did not have before."""
    if not (c.add_tokens or c.add_special_tokens):
        return []
    had = set(tokenizer.get_vocab())
    tokenizer.add_tokens(c.add_tokens, special_tokens=False)
    tokenizer.add_tokens(c.add_special_tokens, special_tokens=True)
    return [t for t in c.add_tokens + c.add_special_tokens if t not in had]


def resolve(c, meta) -> list[str]:
    """c.grown (io/grown_vocab.py's GrownVocab, or None) and, under LoRA, the modules trained whole,
    from the model `meta` as its folder builds it and the run's tokenizer; the lines the run prints."""
    c.grown = None
    if not (c.add_tokens or c.add_special_tokens or c.resize_vocab):
        return []
    from ..io.grown_vocab import GrownVocab
    from .data.tokens import load_tokenizer
    config = meta.config
    tokenizer = load_tokenizer(c.tokenizer or c.model, c.chat_template, c.template, c.model)
    added = add(tokenizer, c)
    embedding = meta.get_input_embeddings().weight
    rows = embedding.shape[0]
    lines = []
    if added and not c.resize_vocab:
        c.resize_vocab = True
        lines.append("  note           new tokens were added: resize_vocab is on, as LlamaFactory turns it on")
    if len(tokenizer) > rows:
        rows = -(-len(tokenizer) // MULTIPLE) * MULTIPLE
    if rows == embedding.shape[0] and not added:
        return lines
    output = meta.get_output_embeddings()
    modules = {m: n for n, m in meta.named_modules()}     # a module's name: its weight's key in the files
    keys = {f"{modules[meta.get_input_embeddings()]}.weight"}
    if output is not None and output.weight is not embedding:
        keys.add(f"{modules[output]}.weight")
    if getattr(config, "vision_config", None) is not None and os.path.isdir(c.model):
        from ..io.hf_load import stored_keys     # an older layout's keys (the grown rows are read by them)
        keys = set(stored_keys(c.model, meta, keys).values()) or keys
    c.grown = GrownVocab(rows=rows, new_ids=tuple(tokenizer.convert_tokens_to_ids(added)), keys=frozenset(keys),
                         std=float(getattr(config.get_text_config(), "initializer_range", 0.02)), seed=c.seed)
    from .methods import adapters
    if adapters(c) and output is not None and output.weight is embedding:
        raise ArgumentError(f"{type(meta).__name__} ties its output projection to its embedding, and the new tokens' "
                            "rows train under LoRA with both modules trained whole (additional_target), which PEFT "
                            "would untie, each a copy of its own: give finetuning_type full (or freeze) to add "
                            "tokens to this model")
    if adapters(c) and not c.additional_target:
        whole = [meta.get_input_embeddings()] + ([output] if output is not None else [])
        c.additional_target = sorted({modules[m].rsplit(".", 1)[-1] for m in whole})
        lines.append(f"  note           the vocabulary grew: {', '.join(c.additional_target)} train whole beside the "
                     "adapters (additional_target), as LlamaFactory adds them")
    lines.append(f"  vocabulary     {len(added)} token{'s' * (len(added) != 1)} added ({', '.join(added[:6])}"
                 f"{', ...' if len(added) > 6 else ''}); {embedding.shape[0]:,} -> {rows:,} rows, the new tokens' "
                 "at the mean of the others plus noise")
    return lines
