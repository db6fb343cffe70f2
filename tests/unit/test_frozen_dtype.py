"""The host tiers line says which dtype the frozen weights are held in: compile() holds a PEFT
model's base as the model holds it, so a base loaded in float32 takes twice the RAM of the bfloat16
base `megacompile plan --lora-rank` and `megacompile train` hold; the line names that figure."""
from __future__ import annotations

import megacompile
import torch
from megacompile.ir.printer import fmt_bytes
from megacompile.planner.from_config import model_from_config
from megacompile.train.methods.lora import with_adapters

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}


def _tiers(base: torch.dtype) -> tuple[str, int]:
    model = with_adapters(model_from_config(dict(CONFIG)), 4, 8, 0.0, "all", base)
    plan = megacompile.plan(model, 1.0, hardware="h100", batch=1, seq=32)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    return next(line for line in plan.summary().splitlines() if line.startswith("  host tiers")), frozen


def test_a_float32_base_is_named_with_what_bfloat16_would_take():
    line, frozen = _tiers(torch.float32)
    assert (f"(the frozen weights in float32: {fmt_bytes(4 * frozen)} of them wider than the bfloat16 compute reads; "
            f"loaded in bfloat16, torch_dtype=torch.bfloat16, they take {fmt_bytes(2 * frozen)})") in line, line
    line, _ = _tiers(torch.bfloat16)
    assert line.endswith("(the frozen weights in bfloat16)"), line
