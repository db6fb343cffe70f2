"""Data files in the layouts people bring: ShareGPT, Alpaca, text records, in the kinds of file
the datasets library writes (parquet, json, arrow, save_to_disk), made on the spot."""
from __future__ import annotations

import json

from tests.train.files import SENTENCES


def _s(i: int) -> str:
    return SENTENCES[i % len(SENTENCES)]


def sharegpt(n: int, start: int = 0) -> list[dict]:
    out = []
    for i in range(start, start + n):
        turns = [{"from": "human", "value": _s(i)}, {"from": "gpt", "value": _s(i * 3 + 1)}]
        out.append({"conversations": turns, **({"system": _s(i + 2)} if i % 4 == 0 else {})})
    return out


def alpaca(n: int, start: int = 0) -> list[dict]:
    out = []
    for i in range(start, start + n):
        record = {"instruction": _s(i + 1), "input": _s(i + 4) if i % 2 else "", "output": _s(i * 7 + 2)}
        if i % 5 == 0:
            record["history"] = [[_s(i + 3), _s(i + 6)]]
        out.append(record)
    return out


def texts(n: int, start: int = 0) -> list[dict]:
    return [{"text": _s(i) + " " + _s(i + 5)} for i in range(start, start + n)]


def jsonl(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def _table(rows: list[dict]):
    """A datasets table with every key some row has (from_list would take the first row's alone)."""
    import datasets
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in rows] for k in keys})


def parquet(path, rows: list[dict]) -> str:
    _table(rows).to_parquet(str(path))
    return str(path)


def json_array(path, rows: list[dict]) -> str:
    with open(path, "w") as f:
        json.dump(rows, f)
    return str(path)


def saved(path, rows: list[dict]) -> str:
    _table(rows).save_to_disk(str(path))
    return str(path)
