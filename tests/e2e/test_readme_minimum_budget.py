"""The README's minimum_budget example prints what the call returns."""
from __future__ import annotations

import os
import re

import megacompile  # noqa: F401 - the README line evaluated below calls it


ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_the_readme_minimum_budget_figure_is_what_the_call_returns(monkeypatch):
    with open(os.path.join(ROOT, "README.md")) as f:
        line = next(l for l in f if l.startswith("megacompile.minimum_budget("))
    call, shown = re.fullmatch(r"(megacompile\.minimum_budget\(.*\))\s+#\s*([0-9.]+)\s*", line).groups()
    monkeypatch.chdir(ROOT)      # the call names its config relative to the repository
    assert f"{eval(call):.2f}" == shown
