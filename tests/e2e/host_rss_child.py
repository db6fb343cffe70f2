"""Run as a child process by test_host_rss.py and benchmarks/host_memory.py: build one engine by
one path, train two steps, and print (one JSON line) how far the process's resident set grew from
before the model existed to after the steps and synchronize(), less the simulated device's arena,
beside the plan's host figure.

    python tests/e2e/host_rss_child.py PATH SIZE FOLDER

PATH: compile (the model's own fp32 weights) | compile_bf16 (a bf16 module, bf16 compute) |
from_pretrained | trainer (from_pretrained, then a Trainer checkpoint's weights and optimizer.pt taken
in; the peak growth while prepare() reads them in is reported too) | disk (from_pretrained with a host budget of 6 B/param and a disk tier) |
accum (from_pretrained, grad_accum=2) | moe (compile, a Qwen2-MoE) | reference (compile, and beside it the same
model frozen, compiled with share_device: a post-training reference; the figures are the two engines'
together, the policy's steps each after a forward of the reference). SIZE: small | medium.
FOLDER: where the Hugging Face folder and the disk tier go. bf16 compute, cpu backend.
"""
from __future__ import annotations

import gc
import json
import os
import sys

import torch

import megacompile
from megacompile.acceptance.models import batch, hf_llama
from megacompile.runtime.host_heap import resident_set_bytes

SIZES = {   # hidden, layers, intermediate: ~58M and ~134M parameters with a 32000-token vocabulary
    "small": (512, 8, 1408),
    "medium": (768, 12, 2048),
}


def model(path: str, size: str) -> torch.nn.Module:
    import transformers
    d, layers, inter = SIZES[size]
    common = dict(vocab_size=32000, hidden_size=d, num_hidden_layers=layers, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=256, use_cache=False)
    if path == "moe":
        config = transformers.Qwen2MoeConfig(**common, intermediate_size=inter, num_experts=4, num_experts_per_tok=2,
                                             moe_intermediate_size=inter // 4, shared_expert_intermediate_size=inter // 4,
                                             tie_word_embeddings=False)
        return transformers.Qwen2MoeForCausalLM(config)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, intermediate_size=inter))


def trainer_checkpoint(size: str, folder: str) -> None:
    """A Trainer checkpoint of the model after two steps, written by the engine's way back (in a
    process of its own: its host state is not the measured one's)."""
    torch.manual_seed(0)
    model("trainer", size).save_pretrained(os.path.join(folder, "src"))
    engine = megacompile.from_pretrained(os.path.join(folder, "src"), hbm_budget=4.0, device="cpu",
                                         compute_dtype=torch.bfloat16,
                                         optimizer=megacompile.AdamW(no_decay=megacompile.hf_no_decay))
    ids = batch(32000, 2, 64)
    for _ in range(2):
        engine.step(input_ids=ids, labels=ids)
    engine.save_trainer_checkpoint(os.path.join(folder, "checkpoint-2"), batch_size=2)


def peak_resident_bytes() -> int:
    """The process's peak resident set (VmHWM) since it was last reset."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def main(path: str, size: str, folder: str) -> None:
    if path == "trainer":
        import subprocess
        subprocess.run([sys.executable, __file__, "trainer_checkpoint", size, folder], check=True)
    # The one-time costs of a first trace and step (imports, dispatch caches, thread pools) are
    # paid on a tiny model first, so the figure is the engine's own.
    tiny = megacompile.compile(hf_llama(layers=1, d=32), 1.0, device="cpu", compute_dtype=torch.bfloat16)
    ids = batch(96, 1, 16)
    tiny.step(input_ids=ids, labels=ids)
    tiny.close()
    del tiny
    src = os.path.join(folder, "src")
    if path in ("from_pretrained", "disk", "accum"):
        torch.manual_seed(0)
        model(path, size).save_pretrained(src)
    gc.collect()
    ids = batch(32000, 2, 64)
    base = resident_set_bytes()
    load_peak = None
    if path == "trainer":
        with open("/proc/self/clear_refs", "w") as f:     # VmHWM from here on
            f.write("5")
    budget = 4.0
    if path in ("compile", "moe", "compile_bf16"):
        torch.manual_seed(0)
        m = model(path, size)
        if path == "compile_bf16":
            m = m.to(torch.bfloat16)
        engine = megacompile.compile(m, budget, device="cpu", compute_dtype=torch.bfloat16)
        del m
    elif path == "reference":
        torch.manual_seed(0)
        engine = megacompile.compile(model(path, size), budget, device="cpu", compute_dtype=torch.bfloat16)
        torch.manual_seed(0)
        frozen = model(path, size).requires_grad_(False)
        reference = megacompile.compile(frozen, budget, device="cpu", compute_dtype=torch.bfloat16,
                                        share_device=engine)
        del frozen
    else:
        extra = {"grad_accum": 2} if path == "accum" else {}
        if path == "disk":
            with torch.device("meta"):
                n = sum(p.numel() for p in model(path, size).parameters())
            extra = {"host_budget": 6 * n / 2 ** 30, "nvme_dir": os.path.join(folder, "tier")}
        if path == "trainer":
            extra = {"optimizer": megacompile.AdamW(no_decay=megacompile.hf_no_decay)}
        engine = megacompile.from_pretrained(src, hbm_budget=budget, device="cpu", compute_dtype=torch.bfloat16,
                                             **extra)
        if path == "trainer":
            engine.load_trainer_checkpoint(os.path.join(folder, "checkpoint-2"))
            engine.prepare(input_ids=ids, labels=ids)      # the host state built, the checkpoint read into it
            load_peak = peak_resident_bytes() - base
    engines = [engine] if path != "reference" else [engine, reference]
    for _ in range(2):
        if path == "reference":
            reference(input_ids=ids, labels=ids)
        engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    stats = engine.memory_stats()
    parts = {}
    for e in engines:
        for k, v in e.memory_stats()["host_parts"].items():
            parts[k] = parts.get(k, 0) + v
    print(json.dumps({
        "path": path, "params": sum(p.numel() for p in engine.model.parameters()),
        # The cpu backend's simulated device is host memory: its arena (held from the first step on,
        # as a GPU's is) is the device's, not the host state the plan figures.
        "growth_bytes": resident_set_bytes() - base - stats["device_arena_bytes"],
        "device_arena_bytes": stats["device_arena_bytes"],
        "predicted_host_bytes": sum(e.host_cost.ram_bytes for e in engines),
        "plan_host_bytes": sum(e.plan.host_bytes for e in engines),
        "host_bytes": sum(e.memory_stats()["host_bytes"] for e in engines), "host_parts": parts,
        "host_budget_bytes": engine.host_budget_bytes, "placement": engine.host_cost.placement.describe(),
        "load_peak_growth_bytes": load_peak,
        "largest_tensor_bytes": max(4 * p.numel() for p in engine.model.parameters()),
    }))


if __name__ == "__main__":
    if sys.argv[1] == "trainer_checkpoint":
        trainer_checkpoint(*sys.argv[2:4])
    else:
        main(*sys.argv[1:4])
