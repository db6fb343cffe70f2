"""Byte-identical plans for the configs in benchmarks/configs (tests/e2e/plan_digests.py)."""
from __future__ import annotations

import json
import os

import pytest

from tests.e2e.plan_digests import HERE, configs, digest

with open(os.path.join(HERE, "..", "data", "plan_digests.json")) as f:
    EXPECTED = json.load(f)


# The four slowest to plan (20-55 s each on two cores) with -m long, and two dense Llama-shaped
# models whose planning the other three (llama-2-7b, qwen2.5-14b, llama-70b) stand for; the rest
# (5-15 s) in the slow tier.
LONG = {"qwen3.5-397b-a17b.json", "qwen3-next-80b-a3b.json", "deepseek-v3.json", "gpt-oss-120b.json",
        "llama-118b.json", "qwen2.5-32b.json"}


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.long if c in LONG else pytest.mark.slow)
                                    for c in configs()])
def test_the_plan_of_a_benchmark_config_is_byte_identical(config):
    assert digest(config) == EXPECTED[config], (
        f"the plan.json of {config} changed; if the change is meant, regenerate tests/data/plan_digests.json "
        "(python tests/e2e/plan_digests.py) and say why in the commit")
