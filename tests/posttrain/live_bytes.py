"""The peak of the bytes held by tensors that ops create while a block of code runs, on any device:
a dispatch mode that keeps a weak reference to each new storage and sums those still alive after
every op. What existed before (the model's weights) is not counted."""
from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakLiveBytes(TorchDispatchMode):
    def __init__(self, existing=()):
        super().__init__()
        self.known = {t.untyped_storage().data_ptr() for t in existing}
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if storage.nbytes() and key not in self.known and key not in self.live:
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out
