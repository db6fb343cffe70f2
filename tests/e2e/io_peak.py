"""Run as a child process by test_io_memory.py: load a Hugging Face folder with from_pretrained,
then save a checkpoint and export it, and print, per phase, how far the process's resident
high-water mark (VmHWM) rose above its resident size when the phase began. The mark is reset
before each phase (/proc/self/clear_refs, 5), so each figure is that phase's own peak.

    python tests/e2e/io_peak.py SRC OUT
"""
from __future__ import annotations

import json
import os
import sys

import torch

import megacompile
from megacompile.acceptance.models import batch, hf_llama


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(phase) -> int:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")            # VmHWM := VmRSS
    base = status("VmRSS")
    phase()
    return status("VmHWM") - base


def main(src: str, out: str) -> None:
    # Pay the one-time costs of a first trace (imports, dispatch caches) on a tiny model, so that
    # the load's figure is the load's own.
    tiny, ids = megacompile.compile(hf_llama(layers=1, d=32), 1.0, device="cpu"), batch(96, 1, 16)
    tiny.prepare(input_ids=ids, labels=ids)
    del tiny
    ids = batch(32000, 1, 16)
    box = {}

    def load():
        box["e"] = megacompile.from_pretrained(src, hbm_budget=4.0, device="cpu")
        box["e"].prepare(input_ids=ids, labels=ids)
    growth = {"load": measure(load)}
    engine = box["e"]
    growth["save_checkpoint"] = measure(lambda: engine.save_checkpoint(os.path.join(out, "ckpt")))
    growth["save_pretrained_fp32"] = measure(
        lambda: engine.save_pretrained(os.path.join(out, "fp32"), max_shard_size="150MB"))
    growth["save_pretrained_bf16"] = measure(
        lambda: engine.save_pretrained(os.path.join(out, "bf16"), dtype=torch.bfloat16, max_shard_size="150MB"))
    print(json.dumps({"growth": growth, "host_bytes": engine.host.nbytes,
                      "largest_tensor_bytes": max(p.numel() * 4 for p in engine.model.parameters()),
                      "params": sum(p.numel() for p in engine.model.parameters())}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
