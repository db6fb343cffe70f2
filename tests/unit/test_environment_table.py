"""docs/environment.md lists every MEGACOMPILE_* environment variable the code reads, and no other.

The names are found in the package source (megacompile/, kernels/, passes/) and in the tests and
benchmarks, which read a few of their own (the soak's length); the table's rows are the lines of
docs/environment.md whose first cell names one."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "docs" / "environment.md"
PACKAGE = ("megacompile", "kernels", "passes")
HARNESS = ("tests", "benchmarks", ".ci")
NAME = re.compile(r"MEGACOMPILE_[A-Z0-9_]+")
ROW = re.compile(r"^\|\s*`(MEGACOMPILE_[A-Z0-9_]+)`\s*\|")

# Names with the prefix that are not read from the environment (the table's closing paragraph).
NOT_VARIABLES = {
    "MEGACOMPILE_VECTOR": "a preprocessor macro of megacompile/optim/csrc/fused_adamw.cpp",
    "MEGACOMPILE_BUDGETS": "the default --budgets of megacompile/bench/peers.py",
}


def names_in(folders: tuple[str, ...]) -> dict[str, list[str]]:
    """Each MEGACOMPILE_* name in the files under `folders`, with the files it appears in."""
    found: dict[str, list[str]] = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts or path.resolve() == Path(__file__).resolve():
                continue
            text = path.read_bytes().decode("utf-8", errors="ignore")
            for name in sorted(set(NAME.findall(text))):
                found.setdefault(name, []).append(str(path.relative_to(ROOT)))
    return found


def table_rows() -> list[str]:
    return [m.group(1) for line in TABLE.read_text().splitlines() if (m := ROW.match(line))]


def test_every_variable_the_source_reads_is_in_the_table():
    rows = set(table_rows())
    used = names_in(PACKAGE + HARNESS)
    missing = {name: files for name, files in used.items() if name not in rows and name not in NOT_VARIABLES}
    assert not missing, ("docs/environment.md has no row for " + "; ".join(
        f"{name} (in {', '.join(files)})" for name, files in sorted(missing.items())))


def test_every_row_of_the_table_is_still_read():
    used = names_in(PACKAGE + HARNESS)
    stale = [name for name in table_rows() if name not in used]
    assert not stale, f"docs/environment.md lists variables nothing reads any more: {', '.join(stale)}"


def test_rows_read_by_the_tests_alone_say_so():
    # The package's own variables must come from megacompile/, kernels/ or passes/; the test tier's
    # (read in tests/ alone) say so in their row.
    package, harness = names_in(PACKAGE), names_in(HARNESS)
    harness_only = [name for name in table_rows() if name in harness and name not in package]
    lines = {m.group(1): line for line in TABLE.read_text().splitlines() if (m := ROW.match(line))}
    unmarked = [name for name in harness_only if "tests only" not in lines[name]]
    assert not unmarked, f"read only by the tests, but their rows do not say so: {', '.join(unmarked)}"


def test_rows_are_unique_and_complete():
    rows = table_rows()
    assert len(rows) == len(set(rows)), f"rows listed twice: {sorted({r for r in rows if rows.count(r) > 1})}"
    for line in TABLE.read_text().splitlines():
        if ROW.match(line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 4 and all(cells), f"a row needs its four cells: {line[:80]}"


def test_names_that_are_not_variables():
    used = names_in(PACKAGE)
    rows = set(table_rows())
    for name, what in NOT_VARIABLES.items():
        assert name in used, f"{name} ({what}) is gone from the source: drop it from NOT_VARIABLES and the doc"
        assert name not in rows, f"{name} is {what}, not an environment variable"
        assert name in TABLE.read_text(), f"docs/environment.md should say that {name} is {what}"
