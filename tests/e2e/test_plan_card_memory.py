"""A plan for a card is held to the card's memory as well as to the budget: a budget set above the
card plans as given, but a plan that needs more than the card has does not fit it (fits false, exit
3, the verdict naming the card's memory and the need); one that stays within the card fits, with a
line saying the budget was more than the card."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import megacompile
from megacompile.cli import main
from megacompile.cost import get_profile
from megacompile.cost.hardware import H100_MEMORY, replace
from megacompile.errors import BudgetTooSmallError
from megacompile.ir.printer import fmt_need
from megacompile.planner import choose_micro_batch
from megacompile.planner.from_config import card_bytes

MiB, GiB = 2 ** 20, 2 ** 30
CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}
# An H100 profile with a card of 48 MiB: less than the 64 MiB of workspaces any plan keeps free.
SMALL = replace(get_profile("h100"), name="small card", device_bytes=48 * MiB)


def _cli(tmp_path, capsys, *args: str) -> tuple[int, dict, str]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    profile = tmp_path / "small.json"
    profile.write_text(json.dumps(SMALL.to_dict()))
    args = [str(profile) if a == "SMALL" else a for a in args]
    rc = main(["plan", "--config", str(config), "--seq", "64", "--host-budget", "4", "--json", *args])
    captured = capsys.readouterr()
    return rc, json.loads(captured.out), captured.err


def _line(text: str, label: str) -> str | None:
    return next((line.strip() for line in text.splitlines() if line.strip().startswith(label)), None)


def test_a_plan_that_needs_more_than_the_card_does_not_fit_it(tmp_path, capsys):
    rc, summary, text = _cli(tmp_path, capsys, "--hardware", "SMALL", "--hbm-budget", "1")
    need = summary["card_bytes"] + summary["card_shortfall_bytes"]
    assert rc == 3 and summary["fits"] is False and summary["card_bytes"] == 48 * MiB
    assert need > 48 * MiB and "shortfall_bytes" not in summary      # the budget itself was enough
    assert _line(text, "verdict") == (
        f"verdict        does NOT fit the small card: the plan needs {fmt_need(need)} of device memory (its peak and "
        f"reserve), the card has 48.00 MiB: {fmt_need(need - 48 * MiB)} short; the budget given is more "
        "than the card: give one within it (without --hbm-budget, 90% of it: 0.04 GiB), or plan with a profile "
        "measured on the card (`megacompile calibrate`), which counts the memory torch sees under its own driver "
        "and ECC setting")
    assert _line(text, "card") == (f"card           48.00 MiB of memory on the small card: the plan needs "
                                   f"{fmt_need(need)} (its peak and reserve), {fmt_need(need - 48 * MiB)} more: it "
                                   "does NOT fit the card; plan at a budget within the card")


def test_plan_says_the_same_from_python():
    plan = megacompile.plan(CONFIG, hbm_budget=1, seq=64, hardware=SMALL)
    assert plan.device_bytes_needed <= plan.budget_bytes and not plan.fits_card and not plan.fits
    document = plan.to_json()
    assert document["fits"] is False and document["card_bytes"] == 48 * MiB
    assert document["card_shortfall_bytes"] == plan.device_bytes_needed - 48 * MiB
    roomy = megacompile.plan(CONFIG, hbm_budget=1, seq=64, hardware=replace(SMALL, device_bytes=GiB))
    assert roomy.fits and "card_bytes" not in roomy.to_json()      # a plan that fits keeps its JSON


@pytest.mark.slow    # a search down to the smallest budget; the card's memory rows stay in the default tier
def test_a_refusal_says_when_no_budget_fits_the_card(tmp_path, capsys):
    with pytest.raises(BudgetTooSmallError):
        megacompile.plan(CONFIG, hbm_budget=0.04, seq=64, hardware=SMALL)
    rc, summary, text = _cli(tmp_path, capsys, "--hardware", "SMALL", "--hbm-budget", "0.04")
    assert rc == 3 and summary["fits"] is False and summary["shortfall_bytes"] > 0
    assert _line(text, "verdict").endswith("short; that is more than the 48.00 MiB of the small card: it fits that "
                                           "card at no budget")


@pytest.mark.parametrize("budget", ["80", "100"])
def test_a_budget_above_the_card_plans_as_given_when_the_plan_stays_within_it(tmp_path, capsys, budget):
    rc, summary, text = _cli(tmp_path, capsys, "--hardware", "h100", "--hbm-budget", budget)
    assert rc == 0 and summary["fits"] is True and summary["budget_bytes"] == int(budget) * GiB
    assert summary["card_bytes"] == H100_MEMORY and "card_shortfall_bytes" not in summary
    assert _line(text, "verdict") == "verdict        fits"
    assert _line(text, "card").startswith(f"card           79.18 GiB of memory on the h100 (SXM, 80 GB, PCIe Gen5 "
                                          f"host link): the {budget}.00 GiB budget is more than that; the plan needs ")
    assert _line(text, "card").endswith(", within the card")


def test_a_budget_within_the_card_has_no_card_line(tmp_path, capsys):
    rc, summary, text = _cli(tmp_path, capsys, "--hardware", "h100", "--hbm-budget", "1")
    assert rc == 0 and summary["fits"] is True and _line(text, "card") is None


def test_a_stage_plan_is_held_to_the_card_too(tmp_path, capsys):
    rc, summary, text = _cli(tmp_path, capsys, "--hardware", "SMALL", "--hbm-budget", "1", "--stage", "dpo")
    assert rc == 3 and summary["fits"] is False and summary["card_bytes"] == 48 * MiB
    assert _line(text, "verdict").startswith("verdict        does NOT fit the small card: the plan needs ")


def test_the_simulated_cpu_device_is_no_card():
    assert card_bytes(replace(SMALL, name="cpu (simulated device, measured)")) is None
    assert card_bytes(get_profile("rtx4090")) == 24080 * MiB   # 23.52 GiB, what torch reports


def test_a_global_batch_takes_the_fastest_split_that_fits_the_card():
    def planned(micro: int, k: int):     # the whole batch at once is fastest, but only 4 rows fit the card
        return SimpleNamespace(fits_card=micro <= 4, prediction=SimpleNamespace(tokens_per_s=float(micro)))
    chosen, k = choose_micro_batch(16, planned)
    assert (chosen.prediction.tokens_per_s, k) == (4.0, 4)
    chosen, k = choose_micro_batch(16, lambda micro, k: SimpleNamespace(
        fits_card=False, prediction=SimpleNamespace(tokens_per_s=float(micro))))
    assert k == 1       # none fits the card: the fastest, which the verdict then refuses
