"""Records from one local file, as TRL's users load them with `datasets.load_dataset(builder,
data_files=...)`: a .jsonl line is a record (read here, so errors name the line); .json, .parquet
and .csv files are read by the `datasets` library, their rows numbered from 0. A table holds every
column in every row, so a key a record does not have reads as None: such keys are dropped, and
the record reads as its JSON line would."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from ..errors import ArgumentError

BUILDERS = {".json": "json", ".parquet": "parquet", ".csv": "csv"}


def read_records(path: str | Path) -> Iterator[tuple[str, dict]]:
    """(where, record) of each record of `path`, in the file's order; `where` names the file and the
    record (`file:line` for .jsonl, `file row n` otherwise)."""
    path = str(path)
    suffix = Path(path).suffix
    if suffix == ".jsonl":
        yield from jsonl_records(path)
    elif suffix in BUILDERS:
        yield from _table(path, BUILDERS[suffix])
    else:
        raise ArgumentError(f"{path}: records are read from .jsonl, .json, .parquet or .csv files; rename it to the "
                            "ending its contents have")


def jsonl_records(path: str) -> Iterator[tuple[str, dict]]:
    """(`file:line`, record) of each non-blank line of a .jsonl file; a line that is not a JSON
    object is refused by its number."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ArgumentError(f"cannot read {path}: {e.strerror or e}") from e
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise ArgumentError(f"{path}:{n} is not a JSON object: {e}") from e
            if not isinstance(record, dict):
                raise ArgumentError(f"{path}:{n} is not a JSON object")
            yield f"{path}:{n}", record


def _table(path: str, builder: str) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError as e:
        raise ArgumentError(f"{path} is read by the datasets library: pip install datasets (.jsonl files need no "
                            "library)") from e
    try:
        rows = datasets.load_dataset(builder, data_files=[path], split="train", streaming=True)
        for n, row in enumerate(rows):
            yield f"{path} row {n}", present(row)
    except ArgumentError:
        raise
    except Exception as e:  # noqa: BLE001 - the library's own words, with the file named
        raise ArgumentError(f"{path}: the datasets library cannot read it as {builder}: "
                            f"{str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from e


def present(value):
    """A table row without the None its missing keys read as (nested turns included)."""
    if isinstance(value, dict):
        return {k: present(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [present(v) for v in value]
    return value
