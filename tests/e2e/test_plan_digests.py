"""Byte-identical plans for the configs in benchmarks/configs (tests/e2e/plan_digests.py)."""
from __future__ import annotations

import json
import os

import pytest

from tests.e2e.plan_digests import HERE, configs, digest

with open(os.path.join(HERE, "..", "data", "plan_digests.json")) as f:
    EXPECTED = json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize("config", configs())
def test_the_plan_of_a_benchmark_config_is_byte_identical(config):
    assert digest(config) == EXPECTED[config], (
        f"the plan.json of {config} changed; if the change is meant, regenerate tests/data/plan_digests.json "
        "(python tests/e2e/plan_digests.py) and say why in the commit")
