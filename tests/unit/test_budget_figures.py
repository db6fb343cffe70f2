"""A budget printed for the reader to give back is rounded up at the digit it shows (a device's
memory, down): given back, it holds the bytes it names (ir/printer.py)."""
from __future__ import annotations

import re

import pytest

from megacompile.ir.printer import fmt_bytes, fmt_need, gib_need, gib_within

GiB = 2**30
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def test_the_smallest_fit_of_a_8b_on_a_4090_is_written_so_that_it_fits():
    n = 4_610_156_407           # 4.2935 GiB: written 4.29 to the nearest, 3.63 MiB short when given back
    assert fmt_bytes(n) == "4.29 GiB" and fmt_need(n) == "4.30 GiB"
    assert gib_need(n) == "4.294" and gib_within(n) == "4.293"


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 71_882_665, 211_150_592, 4_610_156_407, 2**30, 2**30 + 1,
                               987_756_578_734, 3 * 2**40 + 5, 10 * 2**30 - 1])
def test_a_figure_given_back_holds_the_bytes_it_names(n):
    figure, unit = re.fullmatch(r"(\d+(?:\.\d\d)?) (\w+)", fmt_need(n)).groups()
    assert int(float(figure) * UNITS[unit]) >= n                     # as arguments.budget_bytes reads GiB
    assert float(figure) * UNITS[unit] - n < 0.01 * UNITS[unit]      # and no more than the last digit above
    assert int(float(gib_need(n)) * GiB) >= n
    assert float(gib_within(n)) * GiB <= n
