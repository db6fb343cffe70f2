"""The processed pixels a vision-language run keeps (data/images.py's PixelCache): each image read
once while the images last read fit in its byte limit, the oldest let go past it; an image past
the limit alone is not kept, so the cache never holds more than the limit the run counts."""
from __future__ import annotations

import torch

from megacompile.train.data.images import PixelCache


def test_pixels_are_kept_within_the_byte_limit_the_oldest_let_go_first(monkeypatch):
    monkeypatch.setattr(PixelCache, "LIMIT", 3 * 400)       # three images of 100 float32s
    reads = []

    def load(path):
        reads.append(path)
        return {"pixel_values": torch.full((100,), float(len(reads)))}
    cache = PixelCache(load)
    for path in ("a", "b", "c", "a", "d", "a", "b"):
        cache(path)
    # a, b, c read; a kept (read again first); d lets b go; a kept; b read again, c let go
    assert reads == ["a", "b", "c", "d", "b"]
    assert list(cache.kept) == ["d", "a", "b"] and cache.held == 1200
    big = PixelCache(lambda path: (torch.zeros(1000), torch.tensor([1, 2, 2])))     # past the limit alone
    assert big("x")[0].numel() == 1000
    assert not big.kept and big.held == 0
