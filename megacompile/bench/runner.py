"""One system of the peers bench, in a process of its own: its memory peaks are its own, a crash or
an out-of-memory kill loses only its row, and DeepSpeed's and FSDP2's process groups end with it.

    python -m megacompile.bench.runner SPEC.json RESULT.json
"""
from __future__ import annotations

import json
import sys
import traceback

from .systems import SYSTEMS
from .workload import Workload


def main(spec_path: str, result_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    workload = Workload(**spec["workload"])
    try:
        result = {"ok": True, **SYSTEMS[spec["system"]](workload, **spec.get("options", {}))}
    except Exception as e:      # reported in the table as the row's reason; the bench goes on
        result = {"ok": False, "reason": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400],
                  "traceback": "".join(traceback.format_exception(e))[-6000:]}
    with open(result_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
