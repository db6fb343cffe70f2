"""How a run's data tokenizes, as each checkpoint keeps it, and a resume checked against it.

The data check (resume.check_data) compares what the tokens are made from: the data files, the
tokenizer's files, the template, the settings. The same files can still tokenize otherwise: a newer
megacompile that writes a layout otherwise (stages dpo, kto and rm under the qwen3 and deepseekr1
templates drop the earlier answers' thoughts), another transformers or tokenizers release. A resume
that went on would train its remaining steps on other token sequences than its first ones, so each
checkpoint keeps, for each split the stage made (train, eval):

    what, items   what the stage's items are (pair, example, prompt, record) and how many
    digest        sha256 over every item's token ids, in order (each item's own digest, chained)
    first         the first FIRST items' own digests, and where: which names the first that differs

and the versions of what tokenized them (megacompile, transformers, tokenizers). Hashing is
~15 ms per 1,000 pairs of 900 tokens, against the seconds it took to tokenize them.

A stage whose data position is a token file's sha256 (sft and pt, not streamed) keeps none: that
hash is its tokens' own. A streamed run's items are the first FIRST records of each data entry,
tokenized for this alone (the rest is read as training goes).
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from typing import Iterable

from ..errors import ArgumentError

FIRST = 16      # items whose own digests a checkpoint keeps, per split
SHORT = 16      # hex digits of an item's own digest
KEY = "tokenized"       # the checkpoint extra's key


def made(splits: dict[str, Iterable[tuple[tuple, str | None]]], what: str) -> dict:
    """The record of `splits` ({"train": items, "eval": items}), each item (its token-id
    sequences, where it was read or None). An empty split is left out."""
    out: dict = {"versions": versions()}
    for split, items in splits.items():
        whole, first, wheres, n = hashlib.sha256(), [], [], 0
        for sequences, where in items:
            one = hashlib.sha256()
            for ids in sequences:
                block = array("q", ids)
                if sys.byteorder == "big":
                    block.byteswap()
                one.update(len(block).to_bytes(8, "little"))
                one.update(block.tobytes())
            whole.update(one.digest())
            if n < FIRST:
                first.append(one.hexdigest()[:SHORT])
                wheres.append(where)
            n += 1
        if n:
            out[split] = {"what": what, "items": n, "digest": whole.hexdigest(), "first": first, "where": wheres}
    return out


def versions() -> dict:
    from importlib import metadata

    from .. import __version__
    out = {"megacompile": __version__}
    for name in ("transformers", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def check(saved, fingerprint: str, now: dict | None) -> None:
    """Refuse a resume from `saved` (resume.Saved) whose data, the same files (`fingerprint` is the
    checkpoint's), tokenizes otherwise now (`now`: made() of this run's stage; None where the
    stage's fingerprint is its tokens' own). A checkpoint saved before this record was kept goes
    on, with a warning that it cannot be checked."""
    if now is None or saved.extra.get("data") != fingerprint:
        return      # other files: resume.check_data refused them, or read the rows again and found them the same
    before = saved.extra.get(KEY)
    if not isinstance(before, dict):
        print(f"  warning        {saved.path} predates the record of how its data tokenizes: its tokens cannot be "
              "checked against this run's (the data files, tokenizer and settings were)", flush=True)
        return
    changed = differences(before, now)
    if not changed:
        return
    old, new = before.get("versions") or {}, now["versions"]
    moved = [k for k in new if k in old and old[k] != new[k]]
    cause = ("; they were tokenized under " + ", ".join(f"{k} {old[k]} (now {new[k]})" for k in moved) if moved else
             "; under the same " + ", ".join(f"{k} {v}" for k, v in new.items() if v)
             + ": the code of one of them changed (a development install), or a setting or file the data check "
             "does not compare")
    again = (f"resume it under {', '.join(f'{k} {old[k]}' for k in moved)}, " if moved
             else "resume it with what tokenized its data, ")
    raise ArgumentError(f"{saved.path} was saved by a run whose data tokenized otherwise: the same data files now "
                        f"make other tokens ({'; '.join(changed)}){cause}; its remaining steps would train on other "
                        f"token sequences than its first {saved.steps_done}: {again}or start a new run_dir")


def differences(before: dict, now: dict) -> list[str]:
    """One phrase per split whose tokens differ: its item count, or the first item that tokenizes
    otherwise (named by where it was read), or that one past the first FIRST does."""
    out = []
    for split in [k for k in dict.fromkeys([*now, *before]) if k != "versions"]:
        a, b = before.get(split), now.get(split)
        if a == b or (isinstance(a, dict) and isinstance(b, dict) and a.get("digest") == b.get("digest")):
            continue
        if not isinstance(a, dict) or not isinstance(b, dict):
            out.append(f"{split}: {_count(a)} -> {_count(b)}")
            continue
        if a.get("items") != b["items"]:
            out.append(f"{split}: {_count(a)} -> {_count(b)}")
            continue
        at = next((i for i, (x, y) in enumerate(zip(a.get("first") or [], b["first"])) if x != y), None)
        if at is None:
            out.append(f"{split}: the first {len(b['first'])} of {b['items']} {b['what']}s tokenize as before, a "
                       "later one otherwise")
        else:
            where = b["where"][at]
            out.append(f"{split}: {b['what']} {at + 1} of {b['items']}{f' ({where})' if where else ''} "
                       "tokenizes otherwise")
    return out


def _count(split) -> str:
    if not isinstance(split, dict):
        return "none"
    return f"{split['items']} {split['what']}{'s' if split['items'] != 1 else ''}"
