"""Weights in and out hold no second copy: loading a ~100M-parameter Llama from 3+ shards peaks
at the host state plus the largest tensor plus 64 MiB; saving a checkpoint or exporting adds at
most the largest tensor plus 64 MiB. Measured from the child process's own high-water mark."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

MiB = 2 ** 20
ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _can_reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _can_reset_peak(), reason="needs Linux's /proc/self/clear_refs to reset the peak RSS")
def test_load_save_and_export_peak_at_one_tensor_above_the_host_state(tmp_path):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048,
                                         num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                                         max_position_embeddings=256))
    src = str(tmp_path / "src")
    model.save_pretrained(src, max_shard_size="150MB")
    del model
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) >= 3
    child = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "io_peak.py"), src,
                            str(tmp_path / "out")], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    print(report)
    growth, host, largest = report["growth"], report["host_bytes"], report["largest_tensor_bytes"]
    assert 95e6 < report["params"] < 115e6
    assert host <= growth["load"] <= host + largest + 64 * MiB
    for phase in ("save_checkpoint", "save_pretrained_fp32", "save_pretrained_bf16"):
        assert growth[phase] <= largest + 64 * MiB, phase
    for folder in ("ckpt", "fp32", "bf16"):
        assert os.path.isdir(tmp_path / "out" / folder)
