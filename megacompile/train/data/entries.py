"""The `data` and `eval` entries of a run.yaml: which files, read how, mixed in what proportion.

    data: [a.jsonl, notes.txt]                           # plain paths
    data: [{path: a.jsonl, weight: 0.5}, {path: b.parquet, weight: 0.5}]
    dataset: alpaca_en,sharegpt_zh                       # LlamaFactory: names in dataset_dir/dataset_info.json

An entry is checked into a dict {path, weight, kind, columns, tags, formatting, num_samples}
before any file is opened: `kind` says how reading.py reads it (text, jsonl, a `datasets`
builder, a save_to_disk folder); `columns` and `tags` rename a file's own column and role names to
the ones the record formats use, and `num_samples` draws that many of its records (reading.py), as
LlamaFactory's dataset_info.json gives them. Only local paths are read: the run has no network,
and a hub id would name a different dataset on every machine that resolved it.
"""
from __future__ import annotations

import json
import os
from typing import Any

from ...errors import ArgumentError

BUNDLED = "bundled"
# file name endings and the `datasets` builder that reads each
BUILDERS = {".json": "json", ".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
KINDS = ("text", "lines", "jsonl", *BUILDERS.values(), "saved")
ENTRY_KEYS = ("path", "weight", "columns", "tags", "formatting", "num_samples")
MIX_STRATEGIES = ("concat", "interleave_under", "interleave_over")
# LlamaFactory's column names (dataset_info.json `columns`) -> the record keys read here
COLUMNS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system",
           "history": "history", "messages": "conversations", "text": "text", "images": "images",
           "videos": "videos", "chosen": "chosen", "rejected": "rejected", "tools": "tools", "kto_tag": "label"}
# dataset_info.json: the keys of an entry read here, and those that only say where a remote one is
INFO_KEYS = ("file_name", "formatting", "ranking", "columns", "tags", "num_samples", "split", "subset", "folder")
REMOTE = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "system_tag", "observation_tag",
        "function_tag")
WHAT = ("a .txt file (one document), .jsonl, .json, .parquet, .arrow or .csv file of records, a folder "
        "written by datasets' save_to_disk, or a folder of such files")


def kind_of(key: str, path: str) -> str:
    """How a local path is read; a path that is not there gets the error (hub ids are not read)."""
    kind = _kind(key, path)
    if kind not in ("text", "jsonl"):
        try:
            import datasets  # noqa: F401
        except ImportError as e:
            raise ArgumentError(f"{key}: {path} is read by the datasets library: pip install datasets (or "
                                "megacompile[data]); .txt and .jsonl files need no library") from e
    return kind


def _kind(key: str, path: str) -> str:
    if os.path.isfile(path):
        if path.endswith(".txt"):
            return "text"
        if path.endswith(".jsonl"):
            return "jsonl"
        for end, builder in BUILDERS.items():
            if path.endswith(end):
                return builder
        raise ArgumentError(f"{key}: {path} is not a kind of file the data is read from; give {WHAT}")
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(os.path.join(path, "dataset_info.json")):
            return "saved"
        found = {_kind(key, os.path.join(path, n)) for n in folder_files(path)}
        if len(found) != 1:
            raise ArgumentError(f"{key}: the folder {path} holds "
                                + (f"files of several kinds ({', '.join(sorted(found))}); give one kind a folder"
                                   if found else f"no data file; give {WHAT}"))
        kind = found.pop()
        if kind == "text":
            raise ArgumentError(f"{key}: the folder {path} holds .txt files; name them (each is one document)")
        return kind
    raise ArgumentError(f"{key}: {path} is not a local file or folder (dataset ids of the Hugging Face hub are not "
                        f"read: the run uses no network); save it with datasets' save_to_disk, or give {WHAT}")


def named_kind(path: str) -> str | None:
    """How a path is read, told by its name alone (None: a folder's, which only its files tell): an
    entry of a run read for its model alone, whose data files are not looked at (config.load's
    model_only)."""
    for end, kind in ((".txt", "text"), (".jsonl", "jsonl"), *BUILDERS.items()):
        if path.endswith(end):
            return kind
    return None


def folder_files(path: str) -> list[str]:
    """The data files of a folder, in name order (hidden files and others skipped)."""
    ends = (".txt", ".jsonl", *BUILDERS)
    return sorted(n for n in os.listdir(path) if not n.startswith(".") and n.endswith(ends)
                  and os.path.isfile(os.path.join(path, n)))


def check(key: str, value: Any, allow_bundled: bool, allow_weights: bool, files: bool = True) -> list[dict]:
    """The entries of `data` or `eval`, checked; weights are None when no entry gives one. files
    False: the paths are not looked at (their kind told by the name: named_kind)."""
    items = [value] if isinstance(value, (str, dict)) else value
    if not isinstance(items, list):
        raise ArgumentError(f"{key} is a path or a list of paths or {{path, weight}} entries; got {value!r}")
    out = []
    for item in items:
        entry = {"path": item} if isinstance(item, str) else item
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise ArgumentError(f"{key}: an entry is a path or a mapping with a path ({{path: a.jsonl, weight: 0.5}}); "
                                f"got {item!r}")
        unknown = sorted(set(entry) - set(ENTRY_KEYS))
        if unknown:
            raise ArgumentError(f"{key}: the entry for {entry['path']} has unknown key{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(str, unknown))}; an entry takes {', '.join(ENTRY_KEYS)}")
        path, weight = entry["path"], entry.get("weight")
        if weight is not None:
            if not allow_weights:
                raise ArgumentError(f"{key}: {path} has a weight, and {key} data is not mixed; leave weight out")
            weight = _weight(key, path, weight)
        if path == BUNDLED and allow_bundled:
            kind = "text"
        else:
            kind = kind_of(key, path) if files else named_kind(path)
        columns = entry.get("columns") or {}
        tags = entry.get("tags") or {}
        if not isinstance(columns, dict) or not isinstance(tags, dict):
            raise ArgumentError(f"{key}: columns and tags of {path} are mappings (as in LlamaFactory's dataset_info.json)")
        bad = sorted(set(columns) - set(COLUMNS)) + sorted(set(tags) - set(TAGS))
        if bad:
            raise ArgumentError(f"{key}: {path}: unknown column or tag name {', '.join(bad)}; columns take "
                                f"{', '.join(COLUMNS)}, tags take {', '.join(TAGS)}")
        formatting = entry.get("formatting")
        if formatting not in (None, "alpaca", "sharegpt"):
            raise ArgumentError(f"{key}: formatting of {path} is alpaca or sharegpt; got {formatting!r}")
        samples = entry.get("num_samples")
        if samples is not None and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 1):
            raise ArgumentError(f"{key}: num_samples of {path} is a whole number >= 1 (records drawn from it); got "
                                f"{samples!r}")
        out.append({"path": path, "weight": weight, "kind": kind, "columns": dict(columns), "tags": dict(tags),
                    "formatting": formatting, "num_samples": samples})
    _all_or_none(key, out)
    return out


def _weight(key: str, path: str, value: Any) -> float:
    weight = value
    if isinstance(weight, str):         # YAML reads 1e-1 (no dot) as a string
        try:
            weight = float(weight)
        except ValueError:
            pass
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < float("inf"):
        raise ArgumentError(f"{key}: the weight of {path} must be a finite number >= 0; got {value!r}")
    return float(weight)


def _all_or_none(key: str, out: list[dict]) -> None:
    weights = [e["weight"] for e in out]
    if any(w is not None for w in weights):
        if any(w is None for w in weights):
            missing = [e["path"] for e in out if e["weight"] is None]
            raise ArgumentError(f"{key}: some entries have a weight and {', '.join(missing)} has none; give every "
                                "entry a weight, or none")
        if not sum(weights) > 0:
            raise ArgumentError(f"{key}: the weights are all zero; at least one source must be sampled")


def mixture(entries: list[dict], strategy: Any, probs: Any) -> tuple[str, list[float] | None]:
    """The mix strategy and the normalised weights (None: concat, every document once an epoch).
    `interleave_probs` (LlamaFactory) gives the weights as a list or a comma-separated string."""
    if probs is not None:
        if any(e["weight"] is not None for e in entries):
            raise ArgumentError("interleave_probs and data entries' weights both give the mixture: give one of them")
        items = probs.split(",") if isinstance(probs, str) else probs
        if not isinstance(items, list) or len(items) != len(entries):
            raise ArgumentError(f"interleave_probs gives one weight per data entry ({len(entries)}); got {probs!r}")
        for entry, w in zip(entries, items):
            entry["weight"] = _weight("interleave_probs", entry["path"], w.strip() if isinstance(w, str) else w)
        _all_or_none("interleave_probs", entries)
    weights = [e["weight"] for e in entries]
    given = weights[0] is not None
    if strategy is None:
        strategy = "interleave_under" if given else "concat"
    if strategy not in MIX_STRATEGIES:
        raise ArgumentError(f"mix_strategy must be one of {', '.join(MIX_STRATEGIES)}; got {strategy!r}")
    if strategy == "concat":
        if given:
            raise ArgumentError("mix_strategy: concat takes every document once an epoch, and weights would not "
                                "apply; use interleave_under or interleave_over with weights")
        return strategy, None
    if not given:
        weights = [1.0] * len(entries)      # interleaved in equal shares, as LlamaFactory does without probs
    total = sum(weights)
    return strategy, [w / total for w in weights]


def by_line(items: list[dict]) -> None:
    """In place: a .txt named in dataset_info.json is read as LlamaFactory reads it, through
    datasets' text builder, one record a line ({"text": line}); a .txt given in `data` is one
    document."""
    for entry in items:
        if entry["kind"] == "text":
            entry["kind"] = "lines"


def llamafactory(names: Any, folder: Any, key: str = "dataset", stage: str = "sft", files: bool = True) -> list[dict]:
    """Entries for LlamaFactory's `dataset: a,b` (or `eval_dataset`) read from
    `dataset_dir/dataset_info.json`. As in LlamaFactory, a ranking (preference) dataset trains
    under stage dpo and only there; stage grpo takes its prompts from the others. files False:
    dataset_info.json is not read, each name an entry of its own (dataset_dir/NAME)."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise ArgumentError(f"{key} is a name or a comma-separated list of names in dataset_info.json; got {names!r}")
    folder = folder if folder is not None else "data"
    if not files:
        return [{"path": os.path.normpath(os.path.join(str(folder), name))} for name in names]
    info_path = os.path.normpath(os.path.join(str(folder), "dataset_info.json"))
    try:
        with open(info_path) as f:
            info = json.load(f)
    except OSError as e:
        raise ArgumentError(f"{key}: cannot read {info_path} (dataset_dir names its folder): {e.strerror or e}") from e
    except ValueError as e:
        raise ArgumentError(f"{key}: {info_path} is not valid JSON: {e}") from e
    out = []
    for name in names:
        spec = info.get(name) if isinstance(info, dict) else None
        if not isinstance(spec, dict):
            raise ArgumentError(f"{key}: {name} is not in {info_path}; it names {', '.join(sorted(info)) or 'nothing'}")
        if "file_name" not in spec:
            remote = [k for k in REMOTE if k in spec]
            raise ArgumentError(f"{key}: {name} in {info_path} is read from {', '.join(remote) or 'no file_name'}; only "
                                "local files (file_name) are read: the run uses no network")
        unknown = sorted(k for k in spec if k not in INFO_KEYS + REMOTE)
        if unknown:
            raise ArgumentError(f"{key}: {name} in {info_path} has unknown key{'s' if len(unknown) > 1 else ''} "
                                f"{', '.join(map(str, unknown))}; an entry takes {', '.join(INFO_KEYS)}")
        if spec.get("split", "train") != "train":
            raise ArgumentError(f"{key}: {name} in {info_path} has split {spec['split']!r}; a local file is one split, "
                                "train (LlamaFactory's default): leave split out, or name the file of that split")
        ranking = spec.get("ranking", False)
        if ranking and stage not in ("dpo", "rm"):
            reads = ("prompts from supervised (alpaca or sharegpt) datasets" if stage == "grpo"
                     else "text" if stage == "pt" else "datasets with a kto_tag column" if stage == "kto"
                     else "supervised datasets")
            raise ArgumentError(f"{key}: {name} in {info_path} is a ranking (preference) dataset, which trains under "
                                f"stage: dpo or rm (as in LlamaFactory); stage {stage} reads {reads}")
        if not ranking and stage in ("dpo", "rm"):
            raise ArgumentError(f"{key}: {name} in {info_path} is not a ranking dataset, and stage {stage} trains on "
                                "preference pairs: mark a dataset of them ranking: true, as LlamaFactory does")
        out.append({"path": os.path.normpath(os.path.join(str(folder), spec["file_name"])), "columns": spec.get("columns") or {},
                    "tags": spec.get("tags") or {}, "formatting": spec.get("formatting", "alpaca"),
                    "num_samples": spec.get("num_samples")})
    return out
