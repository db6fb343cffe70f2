"""`--global-batch`'s split lines say which figure is the micro-batch and which the accumulation, as
the chosen split's `micro-batch` line does ("4 x 16 accumulated = 64")."""
from __future__ import annotations

from megacompile.errors import BudgetTooSmallError
from megacompile.planner import split_line


def test_a_split_line_names_its_micro_batch_rows_and_accumulation():
    line = split_line(4, 16, BudgetTooSmallError("too small", 2**30), 1.0)
    assert line.startswith("  split          4 rows x 16 accumulated ")
    assert "does not fit: its smallest budget is 1.00 GiB" in line
    assert split_line(1, 64, BudgetTooSmallError("too small", 2**30), 1.0).startswith("  split          1 row x 64 ")
