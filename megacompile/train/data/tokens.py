"""Tokenisation, once, into a token file in the run folder that every later read memory-maps.

    RUN/tokens/train.ids       uint32, every document's tokens, one after another
    RUN/tokens/train.targets   uint8, 1 where the loss counts the token (masking.py)
    RUN/tokens/train.docs      int64, document starts and the end: n_docs + 1 offsets
    RUN/tokens/train.json      what it was made from (files, sizes, times, tokenizer, settings), and
                               which documents are supervised records (runs of document numbers)

The files are written under temporary names in RUN/tokens.new and renamed into place once the
run's checks pass (commit), the .json last: a run cut short or refused after tokenising leaves
nothing that a later run would take for a cache, and the token files it found as they were. A resumed run
whose sources still match (paths, sizes, times, tokenizer files) reuses the files without
reading the data again; one whose sources changed tokenises again, and may resume only if the
tokens came out the same (the checkpoint holds their sha256).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field

import numpy as np

from ...errors import ArgumentError
from . import images, named_template, template_file, turn_ends
from . import workers as workers_of
from . import entries
from .encoding import Document, document, encode, loss_keys  # noqa: F401 - tokens.encode: one record's tokens
from .reading import records

CACHE_FORMAT = "megacompile-tokens/5"     # 2: where each data entry's tokens start; 3: tool calls (tools.py);
                                          # 4: a chat closed by its template's EOS takes no other (encoding.py);
                                          # 5: nor one closed by a token generation stops at (turn_ends.py)


class ByteTokenizer:
    """The bundled model's tokens: the text's UTF-8 bytes (vocab 256), no special tokens."""
    eos_token_id = None
    pad_token_id = 0
    chat_template = None
    vocab_size = 256

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": list(text.encode("utf-8"))}


def load_tokenizer(path: str | None, chat_template: str | None = None, template: str | None = None,
                   model: str | None = None):
    """The tokenizer of the folder `path` (the bundled model's bytes without one); `chat_template`:
    a template file or folder whose template it renders chats with instead of its own; `template`:
    LlamaFactory's name of a layout rendered instead (named_template.py); `model`: the model folder,
    where the turns' end tokens are read first when the tokenizer is another folder's (turn_ends.py)."""
    if path is None:
        return ByteTokenizer()
    try:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
        raise ArgumentError(f"cannot load the tokenizer from {path}: {str(e).splitlines()[0][:300]}") from e
    if os.path.isdir(path):
        turn_ends.attach(tokenizer, model if model and os.path.isdir(model) else None, path)
    if template is not None:
        named_template.apply(tokenizer, template)
    if chat_template is not None:
        tokenizer.chat_template = template_file.read(chat_template)
    return tokenizer


@dataclass
class TokenFile:
    """A memory-mapped token file: documents' tokens and targets, and where each starts."""
    ids: np.ndarray        # uint32 [n_tokens]
    targets: np.ndarray    # uint8  [n_tokens]
    docs: np.ndarray       # int64  [n_docs + 1]
    fingerprint: str       # sha256 of the three files' bytes: what a checkpoint's data position refers to
    split: str = "train"
    staged: str | None = None    # made now, in this folder, until commit() puts it in place
    sources: np.ndarray | None = None   # int64 [n_sources + 1]: where each data entry's tokens start, and the end
    # document -> (the record's `where`, its media: image files, then {"video": file} per video), if any
    images: dict = field(default_factory=dict)
    # bool [n_docs]: supervised records, kept whole in one row (placement.py); None: all plain text
    records: np.ndarray | None = None

    @property
    def n_docs(self) -> int:
        return len(self.docs) - 1


def as_entries(items: list) -> list[dict]:
    """Data entries (entries.py); plain paths are checked into entries here."""
    return [e if isinstance(e, dict) else entries.check("data", e, True, False)[0] for e in items]


def _stat(path: str) -> list[dict]:
    if path == entries.BUNDLED:
        return [{"path": entries.BUNDLED}]
    found = [os.path.join(d, n) for d, _, names in os.walk(path) for n in sorted(names)] if os.path.isdir(path) \
        else [path]
    return [{"path": os.path.abspath(p), "bytes": os.stat(p).st_size, "mtime_ns": os.stat(p).st_mtime_ns}
            for p in sorted(found)]


def _sources(items: list[dict], tokenizer_dir: str | None, train_on_prompt: bool, cutoff: int | None = None,
             model_dir: str | None = None) -> dict:
    files = [{"files": _stat(e["path"]), **{k: e.get(k) for k in ("kind", "columns", "tags", "formatting", "limit",
                                                                "chat_template_kwargs", "mask_history")},
              **{k: e[k] for k in ("chat_template", "media_dir", "default_system", "tools", "pretrain", "added_tokens",
                                   "skip_broken") if e.get(k)},
              **loss_keys(e),
              **({"num_samples": e["num_samples"], "seed": e.get("seed", 0)} if e.get("num_samples") else {})}
             for e in items]
    tokenizer = {}
    if tokenizer_dir is not None:
        for name in sorted(os.listdir(tokenizer_dir)):
            if name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template", turn_ends.FILE,
                                    *images.PROCESSOR_FILES)):
                with open(os.path.join(tokenizer_dir, name), "rb") as f:
                    tokenizer[name] = hashlib.sha256(f.read()).hexdigest()
    ends = turn_ends.source(model_dir, tokenizer_dir)
    if ends is not None and ends != tokenizer_dir:     # the model folder's, read before the tokenizer's
        with open(os.path.join(ends, turn_ends.FILE), "rb") as f:
            tokenizer["model/" + turn_ends.FILE] = hashlib.sha256(f.read()).hexdigest()
    sources = {"format": CACHE_FORMAT, "files": files, "tokenizer": tokenizer, "train_on_prompt": train_on_prompt}
    if cutoff is not None:      # records truncated to it (and marked): a token file made before is not reused
        sources["cutoff"] = cutoff
    return sources


def fingerprint(items: list, tokenizer_dir: str | None, train_on_prompt: bool, cutoff: int | None = None,
                model_dir: str | None = None) -> str:
    """What a streamed run's data position refers to: its sources (files, sizes, times,
    tokenizer, settings, the row length records are truncated to), as a token file's cache key
    is made. Stages dpo and grpo name their records by it too (no cutoff)."""
    sources = _sources(as_entries(items), tokenizer_dir, train_on_prompt, cutoff, model_dir)
    made = "stream-" + hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()[:16]
    _MADE[made] = sources
    return made


_MADE: dict[str, dict] = {}     # fingerprint() or a token file's sha256 -> its sources, in this process


def sources(fingerprint: str) -> dict | None:
    """The sources a fingerprint() or a token file of this process was made from (data files with
    their sizes and times, tokenizer files' sha256, settings, format), which a checkpoint keeps
    beside the fingerprint so that a resume on other data can name what changed (resume.py)."""
    found = _MADE.get(fingerprint)
    return json.loads(json.dumps(found)) if found is not None else None


def token_file(folder: str, split: str, paths: list, tokenizer, tokenizer_dir: str | None,
               train_on_prompt: bool, media=None, cutoff: int | None = None, workers: int = 1,
               model_dir: str | None = None) -> TokenFile:
    """The split's token file in `folder`, when one made from the same sources is there; else made
    now in `folder`.new and put in place by commit() (a run that is refused after tokenising, its
    resume checks among them, leaves the run's own token files as they were). `cutoff`: the row
    length, to which supervised records are truncated (None: none is). `workers`: processes that
    tokenise (workers.py; the file is the same whatever their number)."""
    paths = as_entries(paths)
    sources = _sources(paths, tokenizer_dir, train_on_prompt, cutoff, model_dir)
    if media is not None:
        # images held inside records, written out once beside the token files (embedded.py)
        media.keep_embedded_in(os.path.join(os.path.dirname(os.path.abspath(folder)), "images"))
        sources["image_rows"] = images.ROWS     # how a record with images is written (images.py)
        limits = media.limits
        if limits is not None and limits.given:     # image_max_pixels / image_min_pixels change the widths
            sources["image_limits"] = [limits.max_pixels, limits.min_pixels]
        if media.video_settings is not None:        # the video_* keys change a video's frames and tokens
            sources["video_settings"] = media.video_settings.key()
    made_from = hashlib.sha256(json.dumps(sources, sort_keys=True).encode()).hexdigest()[:16]
    meta = os.path.join(folder, f"{split}.json")
    try:
        with open(meta) as f:
            content = json.load(f)
        starts, pictures, marked = content.get("source_tokens"), content.get("images", []), content.get("records", [])
        content = content["content"] if content.get("made_from") == made_from else None
    except (OSError, ValueError, KeyError):
        content = None
    broken = _broken(folder, split, pictures) if content is not None else None
    if broken:      # a copy cut short, a file lost: the sources are still there to make it again
        print(f"  tokens         {broken}; made again from the data", flush=True)
        content = None
    staged = None
    if content is None:     # the sources changed (or were never read): their tokens may not
        staged = folder.rstrip(os.sep) + ".new"
        content, starts, pictures, marked = _write(staged, split, paths, tokenizer, train_on_prompt, sources,
                                                    made_from, media, cutoff, workers)
    _MADE[content] = sources    # a checkpoint keeps them too: a resume on changed data is told what changed
    base = os.path.join(staged or folder, split)
    docs = np.fromfile(base + ".docs", dtype=np.int64)
    return TokenFile(np.memmap(base + ".ids", dtype=np.uint32, mode="r"),
                     np.memmap(base + ".targets", dtype=np.uint8, mode="r"),
                     docs, content, split, staged,
                     np.asarray(starts, dtype=np.int64), {int(d): (w, list(p)) for d, w, p in pictures},
                     _marked(marked, len(docs) - 1))


def _broken(folder: str, split: str, pictures: list) -> str | None:
    """What is wrong with a token file whose sources match, or None: the sizes its documents'
    offsets give, and the image files its documents name."""
    base = os.path.join(folder, split)
    try:
        docs = np.fromfile(base + ".docs", dtype=np.int64)
        sizes = {ext: os.path.getsize(f"{base}.{ext}") for ext in ("ids", "targets")}
    except (OSError, ValueError) as e:
        return f"{split} token file unreadable ({e})"
    n = int(docs[-1]) if len(docs) else -1
    if n < 0 or docs[0] != 0 or (np.diff(docs) < 0).any() or sizes != {"ids": 4 * n, "targets": n}:
        return (f"{split} token file's sizes disagree with its document offsets ({sizes['ids']} bytes of ids, "
                f"{sizes['targets']} of targets for {max(n, 0)} tokens)")
    lost = [p for _, _, files in pictures for p in files if isinstance(p, str) and not os.path.isfile(p)]
    if lost:
        return f"{split} token file names {len(lost)} image file(s) that are gone ({lost[0]})"
    return None


def _runs(flags: list[bool]) -> list[list[int]]:
    """[first, end) of each run of True in `flags`: the records among the documents, compactly."""
    out: list[list[int]] = []
    for d, flag in enumerate(flags):
        if flag and out and out[-1][1] == d:
            out[-1][1] = d + 1
        elif flag:
            out.append([d, d + 1])
    return out


def _marked(runs: list, n_docs: int) -> np.ndarray | None:
    if not runs:
        return None
    flags = np.zeros(n_docs, dtype=bool)
    for first, end in runs:
        flags[first:end] = True
    return flags


def commit(tokens: TokenFile, folder: str) -> None:
    """Put a token file made by token_file() in place in `folder`, the .json last (the old files
    stop counting as a cache before they are replaced). The open memory maps follow the files."""
    if tokens.staged is None:
        return
    os.makedirs(folder, exist_ok=True)
    meta = os.path.join(folder, f"{tokens.split}.json")
    if os.path.exists(meta):
        os.remove(meta)
    for ext in ("ids", "targets", "docs", "json"):
        os.replace(os.path.join(tokens.staged, f"{tokens.split}.{ext}"), os.path.join(folder, f"{tokens.split}.{ext}"))
    _remove_if_empty(tokens.staged)
    tokens.staged = None


def discard(tokens: TokenFile) -> None:
    """Drop a token file made by token_file() and not committed."""
    if tokens.staged is None:
        return
    for ext in ("ids", "targets", "docs", "json"):
        path = os.path.join(tokens.staged, f"{tokens.split}.{ext}")
        if os.path.exists(path):
            os.remove(path)
    _remove_if_empty(tokens.staged)
    tokens.staged = None


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass        # the other split's files are still there


@dataclass
class _FileCount:
    """What one data file gave: tokens, tokens the loss counts, and the roles of its chat turns."""
    tokens: int = 0
    counted: int = 0
    roles: dict = field(default_factory=dict)

    def why(self) -> str:
        """Why none of the file's tokens counts, and the fix."""
        if self.roles:
            seen = ", ".join(f"{role} ({n:,} turn{'s' if n != 1 else ''})"
                             for role, n in sorted(self.roles.items(), key=lambda x: -x[1]))
            return (f"the loss counts the assistant's turns, and the roles seen are {seen}; name the model's "
                    "turns assistant (ShareGPT's gpt, with from/value, is mapped), or train_on_prompt: true")
        return "every record is prompt only; add assistant turns or completions, or train_on_prompt: true"


def _write(folder: str, split: str, items: list[dict], tokenizer, train_on_prompt: bool, sources: dict,
           made_from: str, media=None, cutoff: int | None = None,
           workers: int = 1) -> tuple[str, list[int], list, list]:
    """Tokenise into the three files; returns the sha256 of their contents (the image paths and
    the records included), where each entry's tokens start, [document, where, image files] of the
    documents with images, and the runs of documents that are records."""
    from tqdm import tqdm
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, split)
    meta = base + ".json"
    if os.path.exists(meta):
        os.remove(meta)                   # the old files stop counting as a cache before they change
    tmp = {ext: f"{base}.{ext}.tmp" for ext in ("ids", "targets", "docs")}
    offsets, total, content = [0], 0, hashlib.sha256()
    paths = [e["path"] for e in items]
    counts = {path: _FileCount() for path in paths}
    starts, pictures, marked, truncated = [], [], [], [0, 0]
    try:
        with open(tmp["ids"], "wb") as ids_f, open(tmp["targets"], "wb") as tgt_f:
            for entry in items:
                count = counts[entry["path"]]
                starts.append(total)
                if media is not None:
                    media.at(entry["path"], entry.get("media_dir"))
                work = workers_of.Work(tokenizer, train_on_prompt, cutoff, entry.get("mask_history", False), media,
                                      loss_keys(entry))
                read = tqdm(records(entry), desc=f"tokenising {split}", unit=" docs", file=sys.stderr,
                            disable=not sys.stderr.isatty())
                for made in workers_of.documents(read, work, workers):
                    for role in made.roles:
                        count.roles[role] = count.roles.get(role, 0) + 1
                    if not made.ids.size:
                        continue
                    for f, data in ((ids_f, made.ids.tobytes()), (tgt_f, made.targets.tobytes())):
                        f.write(data)
                        content.update(data)
                    if made.images is not None:
                        pictures.append([len(offsets) - 1, made.where, made.images])
                    marked.append(made.record)
                    if made.cut:
                        truncated[0], truncated[1] = truncated[0] + 1, truncated[1] + made.cut
                    total += made.ids.size
                    count.tokens += made.ids.size
                    count.counted += int(made.targets.sum())
                    offsets.append(total)
        if total == 0:
            raise ArgumentError(f"{split} data ({', '.join(paths)}) holds no tokens")
        uncounted = [path for path, count in counts.items() if count.tokens and not count.counted]
        if not any(count.counted for count in counts.values()):
            raise ArgumentError(f"no token of the {split} data ({', '.join(paths)}) is counted by the loss: "
                                + "; ".join(counts[path].why() for path in uncounted))
        for path in uncounted:      # the others train; this one only fills rows
            print(f"  warning        none of the {counts[path].tokens:,} tokens of {path} is counted by the loss: "
                  f"{counts[path].why()}", flush=True)
        np.asarray(offsets, dtype=np.int64).tofile(tmp["docs"])
        content.update(np.asarray(offsets, dtype=np.int64).tobytes())
        if pictures:
            content.update(json.dumps(pictures).encode())
        marked = _runs(marked)
        if marked:          # a token file of plain text alone keeps the sha256 it had before records were marked
            content.update(json.dumps(marked).encode())
        if truncated[0]:
            print(f"  note           {truncated[0]:,} {split} record{'s' if truncated[0] > 1 else ''} longer than a "
                  f"row ({cutoff:,} tokens: seq, cutoff_len) truncated to it as LlamaFactory truncates them "
                  f"({truncated[1]:,} tokens dropped; docs/training.md, \"Rows and batches\")", flush=True)
        for ext, path in tmp.items():
            os.replace(path, f"{base}.{ext}")
        with open(meta + ".tmp", "w") as f:
            json.dump({"made_from": made_from, "content": content.hexdigest()[:16], "tokens": total,
                       "source_tokens": starts + [total],
                       "docs": len(offsets) - 1, "images": pictures, "records": marked, **sources}, f, indent=1)
        os.replace(meta + ".tmp", meta)
        return content.hexdigest()[:16], starts + [total], pictures, marked
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
        if not os.path.exists(meta):
            _remove_if_empty(folder)
