"""Records from a data entry (entries.py), one at a time, in the file's order: (where, record).

A .txt file is one document ({"text": ...}), except one named in LlamaFactory's dataset_info.json,
read as LlamaFactory reads it (datasets' text builder): one record a line, kind `lines`. A .jsonl
line is one record (read here, so errors name the line). Every other kind is read by the `datasets` library: .json, .parquet, .arrow and
.csv files (and folders of them) through `load_dataset(builder, data_files=..., streaming=True)`,
which reads the files as they are, without writing a copy in its cache; a save_to_disk folder through
`load_from_disk`, which memory-maps it. Those rows are numbered from 0 in `where`.

A table holds every column in every row, so keys a record does not have come back as None: they
are dropped, so that a record reads as its JSON line would. A file's own column and role names
are renamed to the ones the record formats use as the entry's `columns` and `tags` say.

An entry's `num_samples` (LlamaFactory's dataset_info.json key) draws that many records, as
LlamaFactory does: every record once in a random order, as many as are asked for, and past the
file's size more drawn at random with replacement; the draw is chosen by the run's seed. Then
`limit` (max_samples) keeps the first records of what was drawn. An entry's
`chat_template_kwargs` (run.yaml's) are laid under each record's own, and run.yaml's `tools` given to each
conversation that names none (run_tools.py). Under stage pt each record is read as its text
alone (pretrain.py). An entry marked `skip_broken` (a dataset of LlamaFactory's ShareGPT
formatting, config_data.py) leaves out the conversations LlamaFactory's converter skips
(sharegpt.broken; `limit` counts them, as max_samples counts them before LlamaFactory converts),
and the run says once how many and why.
"""
from __future__ import annotations

import os
from importlib import resources
from typing import Iterator

import numpy as np

from ...errors import ArgumentError
from ...posttrain import jsonl_records, present
from . import pretrain, run_tools, sharegpt, system
from .entries import BUNDLED, COLUMNS, folder_files


def _bundled_text() -> str:
    return resources.files("megacompile").joinpath("data/corpus.txt").read_text(encoding="utf-8", errors="replace")


def records(entry: dict, readers: dict | None = None) -> Iterator[tuple[str, dict]]:
    """`readers` keeps the datasets library's reader of each file between calls (a stream reads
    the files again every pass, and making a reader opens them anew); one reader is not read by
    two threads at once, so each stream keeps its own."""
    path, kind = entry["path"], entry["kind"]
    if path == BUNDLED:
        yield "the bundled corpus", {"text": _bundled_text()}
        return
    rename, limit = _renamer(entry), entry.get("limit")
    rows = _raw(path, kind, {} if readers is None else readers)
    if entry.get("num_samples"):
        rows = _drawn(list(rows), entry["num_samples"], entry.get("seed", 0))
    skipped: dict[str, list] = {}       # why -> [count, the first record's where]
    n = 0
    for n, (where, record) in enumerate(rows, 1):
        if limit is not None and n > limit:
            n -= 1
            break
        if entry.get("pretrain"):
            yield where, pretrain.record(rename(record), where)
            continue
        record = rename(record)
        why = sharegpt.broken(record) if entry.get("skip_broken") else None
        if why is not None:
            skipped.setdefault(why, [0, where])[0] += 1
            continue
        record = system.with_default(record, entry.get("default_system"))
        record = run_tools.with_run_tools(record, entry.get("tools"))
        yield where, _with_template_kwargs(record, entry.get("chat_template_kwargs"))
    if skipped and (path, id(entry)) not in _TOLD:
        _TOLD.add((path, id(entry)))
        _tell_skipped(path, n, skipped)


# (path, entry) whose skipped records were told: a stream reads its entries again every pass, and
# starts again; the run's entries live as long as it does
_TOLD: set = set()


def _tell_skipped(path: str, read: int, skipped: dict) -> None:
    count = sum(c for c, _ in skipped.values())
    why = "; ".join(f"{c:,} {reason} (the first: {where})" for reason, (c, where) in skipped.items())
    print(f"  warning        {count:,} of the {read:,} records of {path} skipped, as LlamaFactory's ShareGPT reading "
          f"skips them: {why}", flush=True)


def _with_template_kwargs(record: dict, run: dict | None) -> dict:
    """The run's chat_template_kwargs laid under the record's own (TRL's column), which win."""
    own = record.get("chat_template_kwargs")
    if not run or not (own is None or isinstance(own, dict)):
        return record       # a malformed column is refused where it is read (tools.py)
    return {**record, "chat_template_kwargs": {**run, **(own or {})}}


def _drawn(rows: list, count: int, seed: int) -> list:
    """`count` of `rows` as LlamaFactory's num_samples draws them: a permutation's first `count`,
    then the rest with replacement."""
    if not rows:
        return rows
    rng = np.random.default_rng([seed, count])
    chosen = rng.permutation(len(rows))[:count]
    if count > len(rows):
        chosen = np.concatenate([chosen, rng.choice(len(rows), count - len(rows))])
    return [rows[i] for i in chosen.tolist()]


def _raw(path: str, kind: str, readers: dict) -> Iterator[tuple[str, dict]]:
    if kind == "text":
        with open(path, encoding="utf-8") as f:
            yield path, {"text": f.read()}
    elif kind == "lines":
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):      # an empty line too is a record, as datasets reads it
                yield f"{path} line {n}", {"text": line.rstrip("\n")}
    elif kind == "jsonl":
        for file in _files(path):
            yield from jsonl_records(file)
    elif kind == "saved":
        yield from _rows(path, _saved(path))
    else:
        try:
            if path not in readers:
                readers[path] = _streamed(kind, _files(path))
            yield from _rows(path, readers[path])
        except ArgumentError:
            raise
        except Exception as e:  # noqa: BLE001 - the library's own words, with the file named
            raise ArgumentError(f"{path}: the datasets library cannot read it as {kind}: "
                                f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from e


def _streamed(kind: str, files: list[str]):
    import datasets
    return datasets.load_dataset(kind, data_files=files, split="train", streaming=True)


def _files(path: str) -> list[str]:
    return [os.path.join(path, n) for n in folder_files(path)] if os.path.isdir(path) else [path]


def _saved(path: str):
    import datasets
    try:
        table = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001
        raise ArgumentError(f"{path}: datasets' load_from_disk cannot read it: {str(e).splitlines()[0][:300]}") from e
    if isinstance(table, datasets.DatasetDict):
        if "train" not in table:
            raise ArgumentError(f"{path} holds the splits {', '.join(table)} and no train split; save the split to "
                                "train on (dataset_dict['name'].save_to_disk(...))")
        table = table["train"]
    return table


def _rows(path: str, table) -> Iterator[tuple[str, dict]]:
    for n, row in enumerate(table):
        yield f"{path} row {n}", present(row)


def _renamer(entry: dict):
    columns, tags = entry.get("columns") or {}, entry.get("tags") or {}
    if not columns and not tags:
        return lambda record: record
    # dataset_info.json maps LlamaFactory's names to the file's; the file's become the names read here
    by_file = {file_name: COLUMNS[ours] for ours, file_name in columns.items()}
    if entry.get("formatting") == "sharegpt" and "messages" not in columns:
        by_file.setdefault("conversations", "conversations")
    role, content = tags.get("role_tag", "from"), tags.get("content_tag", "value")
    roles = {tags.get("user_tag", "human"): "human", tags.get("assistant_tag", "gpt"): "gpt",
             tags.get("system_tag", "system"): "system", tags.get("observation_tag", "observation"): "observation",
             tags.get("function_tag", "function_call"): "function_call"}

    def turn(t):
        if not isinstance(t, dict) or role not in t:
            return t
        return {"from": roles.get(t[role], t[role]), "value": t.get(content)}

    def rename(record: dict) -> dict:
        out = {k: v for k, v in record.items() if k not in by_file}
        out.update({by_file[k]: v for k, v in record.items() if k in by_file})    # a mapped column wins
        if tags and isinstance(out.get("conversations"), list):
            out["conversations"] = [turn(t) for t in out["conversations"]]
        for k in ("chosen", "rejected"):        # a ranking record's two answers are turns too
            if tags and isinstance(out.get(k), dict):
                out[k] = turn(out[k])
        return out
    return rename
