"""The cpu half of `python -m megacompile.acceptance`: every section that does not need a GPU runs
here on the cpu backend, so the command's logic is tested before it meets a device."""
from __future__ import annotations

import csv
import math

import pytest
import torch

from megacompile.calibrate import cpu_profile
from megacompile.acceptance import checks, main
from megacompile.acceptance.table import Row, markdown, write
from megacompile.acceptance.speed import step_rows

TINY = dict(vocab=96, dim=32, ffn=64, heads=4, kv_heads=2, layers=2)


def test_without_a_gpu_it_says_so_and_exits_0(capsys):
    assert main([]) == 0
    assert "no GPU" in capsys.readouterr().out


def test_parity_rows_pass_for_a_right_run_and_fail_for_a_wrong_one(monkeypatch):
    rows = checks.parity_rows("cpu", width=32, layers=2, steps=3, only=("tinyllama",))
    assert {r.name for r in rows} == {"tinyllama float32", "tinyllama bfloat16"}
    assert all(r.passed for r in rows), [(r.name, r.value, r.detail) for r in rows]
    fp32 = [r for r in rows if "float32" in r.name]
    assert all(r.value <= 1e-5 and r.detail["weight_error"] <= 1e-5 and r.detail["first_grad_error"] <= 1e-5
               for r in fp32)
    # on the host eager is its own reference: no noise floor widens the weights' tolerance
    assert all(r.detail["weight_tolerance"] == 1e-5 for r in fp32)
    # an eager run 0.1% off must read as a failure: the comparison is not vacuous
    real = checks.eager_losses
    monkeypatch.setattr(checks, "eager_losses", lambda *a, **k: [x * 1.001 for x in real(*a, **k)])
    wrong = checks.parity_rows("cpu", width=32, layers=2, steps=2, dtypes=(torch.float32,), only=("tinyllama",))
    assert [r.passed for r in wrong] == [False]


def test_a_wrong_first_gradient_fails_the_parity_row(monkeypatch):
    """The first step's gradients are compared on their own (a wrong one that the losses would
    not show yet must fail the row)."""
    real = checks.megacompile_run

    def off(*a, first_moments=None, **k):
        run = real(*a, first_moments=first_moments, **k)
        name = next(iter(first_moments))
        first_moments[name] = first_moments[name] * 1.001
        return run
    monkeypatch.setattr(checks, "megacompile_run", off)
    rows = checks.parity_rows("cpu", width=32, layers=2, steps=2, dtypes=(torch.float32,), only=("tinyllama",))
    assert [r.passed for r in rows] == [False] and rows[0].detail["first_grad_error"] > 1e-5


@pytest.mark.slow
def test_every_parity_model_passes_on_the_cpu_backend():
    rows = checks.parity_rows("cpu", width=32, layers=2, steps=3)
    assert {r.name.split()[0] for r in rows} >= {"tinyllama", "llama", "qwen2", "gpt2"}
    assert all(r.passed for r in rows), [(r.name, r.value, r.detail) for r in rows]


def test_budget_rows_hold_the_peak_at_the_smallest_budget_and_three_more():
    from megacompile.models.llama import LlamaConfig, TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(**TINY))
    ids = torch.randint(0, 96, (2, 16))
    rows = checks.budget_rows("cpu", model=model, ids=ids)
    assert len(rows) == 4 and all(r.passed for r in rows)
    budgets = [r.limit for r in rows]
    assert budgets == sorted(budgets) and all(r.value <= r.limit for r in rows)


def test_kernel_rows_come_from_the_kernel_check():
    rows = checks.kernel_rows("test", only="scale")
    assert [r.name for r in rows] == ["scale float32", "scale bfloat16"] and all(r.passed for r in rows)


def test_a_step_row_reports_measured_beside_predicted():
    (row,) = step_rows("cpu", "llama-1b", layers=2, profile=cpu_profile(), batch=1, seq=16, steps=1,
                       dims=TINY)
    assert row.value > 0 and row.limit > 0
    for key in ("predicted_exposed_transfer_s", "measured_host_optimizer_s", "predicted_host_optimizer_s",
                "measured_tflops_6nd", "predicted_tflops_6nd"):
        assert math.isfinite(row.detail[key]), key
    assert row.detail["measured_host_optimizer_s"] > 0


def test_the_report_is_a_long_csv_and_a_markdown_table(tmp_path):
    rows = [Row("parity", "llama float32", 2e-7, 1e-5, True, {"weight_error": 1e-7}),
            Row("budget", "at 1x", 120.0, 100.0, False), Row("step", "llama-1b", 1.5, 1.2)]
    csv_path, md_path = write(tmp_path, rows, {"torch": "x"})
    lines = list(csv.DictReader(csv_path.open()))
    assert len(lines) == 4 and {line["section"] for line in lines} == {"parity", "budget", "step"}
    text = md_path.read_text()
    assert "**FAIL**" in text and "1 checks passed, 1 failed: budget/at 1x" in text
    assert text == markdown(rows, {"torch": "x"}) + "\n"
