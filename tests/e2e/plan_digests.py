"""The plans of benchmarks/configs as digests of their plan.json (less what planning took): a change that should not move a
plan (a refactor of how plans are asked for) is held to the same bytes. Regenerate only when a
plan is meant to change:

    python tests/e2e/plan_digests.py > tests/data/plan_digests.json
"""
from __future__ import annotations

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "..", "benchmarks", "configs")
# One budget, shape and profile per config: an H100 profile (not this machine's calibrated cpu
# one) and an explicit host budget (not this machine's RAM), so the digests are the same anywhere.
SETTINGS = dict(hbm_budget=40.0, hardware="h100", batch=1, seq=1024, host_budget=4096)
# A model that does not fit them gets budgets that hold it (DeepSeek-V3: an MoE block's 21 GiB of
# weights, 8.5 TiB of host state; Qwen3.5-397B: 5.1 TiB of host state).
OVERRIDES = {"deepseek-v3.json": dict(hbm_budget=80.0, host_budget=16384),
             "qwen3.5-397b-a17b.json": dict(hbm_budget=80.0, host_budget=8192)}
# What planning took on this machine, not what was planned.
MEASURED = ("pass_seconds", "trace_seconds")


def digest(config: str) -> str:
    import megacompile
    with open(os.path.join(CONFIGS, config)) as f:
        plan = megacompile.plan(json.load(f), **(SETTINGS | OVERRIDES.get(config, {})))
    planned = {k: v for k, v in plan.to_json().items() if k not in MEASURED}
    return hashlib.sha256(json.dumps(planned, indent=1).encode()).hexdigest()


def configs() -> list[str]:
    return sorted(name for name in os.listdir(CONFIGS) if name.endswith(".json"))


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    print(json.dumps({name: digest(name) for name in configs()}, indent=1))
