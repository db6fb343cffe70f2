"""Whether two `megacompile plan --json` outputs describe the same plan: every field but the
seconds planning itself took. For checking that a change to the planner moved no result.

    python benchmarks/plan_diff.py before.json after.json    # exit 1, listing the fields, if they differ
"""
from __future__ import annotations

import json
import sys

TIMING = {"pass_seconds", "trace_seconds"}     # how long planning took, not what it chose


def last_json(path: str) -> dict:
    with open(path) as f:
        return json.loads(f.read().strip().splitlines()[-1])


def differences(a: dict, b: dict) -> list[str]:
    return [k for k in sorted(set(a) | set(b) - TIMING) if k not in TIMING and a.get(k) != b.get(k)]


if __name__ == "__main__":
    before, after = last_json(sys.argv[1]), last_json(sys.argv[2])
    diff = differences(before, after)
    for k in diff:
        print(f"{k}: {str(before.get(k))[:200]} -> {str(after.get(k))[:200]}")
    print("same plan" if not diff else f"{len(diff)} fields differ")
    sys.exit(1 if diff else 0)
