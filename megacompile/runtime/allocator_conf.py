"""The caching allocator's settings a cuda backend runs with: expandable segments, unless the user
chose the allocator's configuration.

With fixed segments a block freed in one segment cannot serve a larger request that spans two,
so a stream of weight slots and gradients of varied sizes fragments the budget: a Llama-2-7B
shape at 0.34x its bf16 weights (4.27 GiB, 4 x 4096 tokens) ran out of memory on an H100 with
456 MiB reserved but unallocated, beyond the plan's 5% fragmentation share (cost/reserve.py).
Expandable segments grow one segment per stream by mapping pages, so freed space is reused at
any size; the 3B shape at its smallest budget then held 3.50 GiB reserved of 3.55.
The setting is process-wide and applies to segments made after it (segments made before stay
fixed); it stays on when the backend closes, as other engines may be running on it.
"""
from __future__ import annotations

import os

import torch

# Either variable configures the allocator (PYTORCH_ALLOC_CONF is the newer name); a user who
# set one chose, and is left alone (expandable_segments:False included).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"


def enable_expandable_segments() -> str:
    """Turn on expandable segments if no allocator configuration was given; says what the
    allocator runs with, for the memory stats ("expandable_segments:True (set by megacompile)",
    the user's configuration, or "fixed segments (...)" where this torch offers no way to set it)."""
    for var in ALLOC_CONF_VARS:
        if os.environ.get(var):
            return f"{var}={os.environ[var]}"
    setter = _settings_setter()
    if setter is None:
        return "fixed segments (this torch cannot set the allocator's configuration at run time)"
    setter(EXPANDABLE)
    return f"{EXPANDABLE} (set by megacompile)"


def _settings_setter():
    # torch >= 2.9 moved the setter from torch.cuda.memory._set_allocator_settings (now a
    # deprecated alias) to torch._C; the allocator reads expandable_segments at each new segment,
    # so setting it after CUDA is initialised takes effect from the next segment on.
    for owner, name in ((torch._C, "_accelerator_setAllocatorSettings"), (torch._C, "_cuda_setAllocatorSettings"),
                        (torch.cuda.memory, "_set_allocator_settings")):
        setter = getattr(owner, name, None)
        if setter is not None:
            return setter
    return None
