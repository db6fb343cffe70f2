"""Images held inside a record rather than named by it: what the `datasets` library yields for an
Image column of a .parquet, .arrow or save_to_disk table (TRL's vision-language datasets are
written so): a PIL image, or {"bytes": ..., "path": ...} where the column is not decoded.

Each is written once into the run's image folder under the sha256 of its bytes (the encoded file
as the table holds it; a decoded image as PNG, which keeps its pixels exactly), and read from
there as any image file: the token file keeps its path, so a resumed run reads the same pixels
without the table. A dict without bytes names a file by its path, read as a path is.
"""
from __future__ import annotations

import hashlib
import io
import os
from typing import Any

from ...errors import ArgumentError


def path(item: Any, folder: str | None, where: str) -> Any:
    """The file an item of `images` is read from; a path (or anything unreadable, for the caller
    to refuse) as it is."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and set(item) <= {"bytes", "path"}:
        if item.get("bytes") is None:
            return item.get("path") or item
        data = item["bytes"]
        if not isinstance(data, (bytes, bytearray)):
            return item
        return _kept(bytes(data), folder, where)
    if _is_pil(item):
        out = io.BytesIO()
        item.save(out, format="PNG")
        return _kept(out.getvalue(), folder, where)
    return item


def _is_pil(item: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:
        return False
    return isinstance(item, Image.Image)


def _kept(data: bytes, folder: str | None, where: str) -> str:
    if folder is None:
        raise ArgumentError(f"{where}: the record holds its images inside it, which are written to the run's folder "
                            "to be read; tokenise it into a run (megacompile train)")
    name = os.path.join(folder, hashlib.sha256(data).hexdigest()[:32] + _ending(data))
    if not os.path.exists(name):
        os.makedirs(folder, exist_ok=True)
        with open(name + ".tmp", "wb") as f:
            f.write(data)
        os.replace(name + ".tmp", name)
    return name


def _ending(data: bytes) -> str:
    for magic, ending in ((b"\x89PNG", ".png"), (b"\xff\xd8", ".jpg"), (b"GIF8", ".gif"), (b"RIFF", ".webp"),
                          (b"BM", ".bmp")):
        if data.startswith(magic):
            return ending
    return ".img"       # PIL reads an image by its bytes, not its name
