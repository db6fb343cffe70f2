"""What `megacompile plan` says is true: the smallest budget it names plans and nothing below it
does; the host budget it checks is named with where it came from; a refusal shows the budget the
user gave and the shortfall; the values at the peak are named by their modules; budgets and disk
folders that cannot be meant are named as such."""
from __future__ import annotations

import json
import re

import pytest
import torch
import transformers

import megacompile
from megacompile.cli import main
from megacompile.cost import host_memory
from megacompile.errors import ArgumentError, BudgetTooSmallError
from megacompile.ir.printer import describe_value, fmt_bytes, fmt_need
from tests import models

GiB = 2 ** 30
SMALL_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def _cli(tmp_path, capsys, *args: str) -> tuple[int, list[str]]:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    rc = main(["plan", "--config", str(config), "--batch", "2", "--seq", "64", *args])
    captured = capsys.readouterr()      # with --json the text is on stderr, the document alone on stdout
    if "--json" in args:
        json.loads(captured.out)
    return rc, (captured.err + captured.out).strip().splitlines()


def _line(out: list[str], label: str) -> str:
    return next(line.strip() for line in out if line.strip().startswith(label))


# about 30 s on 2 cores, with -m long: the config's minimum-budget test below holds the same verdict
@pytest.mark.long
def test_the_smallest_fit_plans_and_a_little_less_does_not():
    # Long sequences on a narrow model: below the whole blocks' smallest budget the planner runs
    # the blocks over sequence chunks, which fit less.
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=128, max_position_embeddings=1024)
    roomy = megacompile.plan(config, hbm_budget=1.0, seq=1024, hardware="h100", smallest=True)
    smallest = roomy.minimum_budget_bytes
    assert megacompile.plan(config, hbm_budget=smallest * 1.0001 / GiB, seq=1024, hardware="h100").fits
    with pytest.raises(BudgetTooSmallError) as refused:
        megacompile.plan(config, hbm_budget=smallest * 0.99 / GiB, seq=1024, hardware="h100")
    assert refused.value.minimum_bytes == smallest
    assert "the smallest budget any plan fits" in _line(roomy.summary().splitlines(), "smallest fit")
    # Without the search, the line says whose smallest budget it names.
    own = megacompile.plan(config, hbm_budget=1.0, seq=1024, hardware="h100")
    assert own.minimum_budget_bytes > smallest
    assert f"{fmt_need(own.minimum_budget_bytes)} with the blocks whole" in _line(own.summary().splitlines(),
                                                                                     "smallest fit")


# the meta module's search (about 30 s on 2 cores) with -m long: the config's is the same search
@pytest.mark.parametrize("given", [pytest.param("config", marks=pytest.mark.slow),    # 30 s
                                   pytest.param("meta module", marks=pytest.mark.long)])
def test_minimum_budget_is_the_budget_the_refusal_names_and_it_fits(given):
    # Blocks that fit whole only above what they fit over sequence chunks: the lowest of both.
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, vocab_size=128, max_position_embeddings=1024)
    if given == "meta module":
        with torch.device("meta"):
            config = transformers.LlamaForCausalLM(config)
    smallest = megacompile.minimum_budget(config, seq=1024, hardware="h100")
    assert isinstance(smallest, float)
    # A millionth less (the figure is rounded up to the byte over the device reserve's share).
    with pytest.raises(BudgetTooSmallError) as refused:
        megacompile.plan(config, hbm_budget=smallest * (1 - 1e-6), seq=1024, hardware="h100")
    assert refused.value.minimum_bytes == smallest * GiB
    assert megacompile.plan(config, hbm_budget=smallest, seq=1024, hardware="h100").fits


def test_the_host_budget_defaults_to_this_machines_ram_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_memory, "physical_ram", lambda: 8 * 2 ** 20)   # less than the masters and moments
    rc, out = _cli(tmp_path, capsys, "--hbm-budget", "1", "--json")
    assert rc == 3
    assert "this machine's RAM (90% of 8.00 MiB" in _line(out, "host budget")
    assert "--host-budget GiB to plan for another machine" in _line(out, "host budget")
    assert "does NOT fit: the host RAM budget" in _line(out, "verdict")
    data = json.loads(out[-1])
    assert data["host_budget_bytes"] == int(0.9 * 8 * 2 ** 20) and data["host_budget_source"] == "this machine"
    rc, out = _cli(tmp_path, capsys, "--hbm-budget", "1", "--host-budget", "1", "--json")
    assert rc == 0
    assert _line(out, "host budget") == "host budget    1.00 GiB checked: given with --host-budget"
    assert json.loads(out[-1])["host_budget_source"] == "--host-budget"


def test_the_host_budget_defaults_to_a_lower_memory_cgroup_limit_and_says_so(tmp_path, capsys, monkeypatch):
    """A container's or a SLURM job's memory limit below the machine's RAM is what the process may
    fill: the default host budget is its share of that, and the line names it."""
    monkeypatch.setattr(host_memory, "physical_ram", lambda: 64 * 2 ** 30)
    monkeypatch.setattr(host_memory, "cgroup_memory_limit", lambda: 8 * 2 ** 20)
    rc, out = _cli(tmp_path, capsys, "--hbm-budget", "1", "--json")
    assert rc == 3 and json.loads(out[-1])["host_budget_bytes"] == int(0.9 * 8 * 2 ** 20)
    assert json.loads(out[-1])["host_budget_source"] == "this process's memory limit"
    assert ("this process's memory limit (90% of the 8.00 MiB its cgroup allows, of 64.00 GiB of RAM on the "
            "machine; as compile() takes it)") in _line(out, "host budget")
    monkeypatch.setattr(host_memory, "cgroup_memory_limit", lambda: 128 * 2 ** 30)     # above the RAM: the RAM
    assert host_memory.default_host_budget_bytes() == int(0.9 * 64 * 2 ** 30)


def test_a_refusal_shows_the_budget_given_and_the_shortfall(tmp_path, capsys):
    rc, out = _cli(tmp_path, capsys, "--hbm-budget", "0.01", "--json")
    assert rc == 3
    data = json.loads(out[-1])
    given, needs = int(0.01 * GiB), data["minimum_budget_bytes"]
    assert data["budget_bytes"] == given and data["shortfall_bytes"] == needs - given > 0
    peak = _line(out, "device peak")
    assert f"{fmt_need(needs - given)} more than the {fmt_bytes(given)} budget given" in peak
    assert f"{fmt_bytes(given)} given: {fmt_need(needs - given)} short" in _line(out, "verdict")


@pytest.mark.slow      # five plans, about 20 s on 2 cores; tests/unit/test_budget_figures.py holds the rounding
def test_every_budget_printed_to_be_given_back_fits_when_given_back():
    """The smallest fit, a refusal's smallest budget (in GiB and in its own unit) and the verdict's
    need are rounded up at the digit shown: 4.2935 GiB printed as 4.29 was refused, 3.6 MiB short.
    At these shapes each figure rounded to the nearest would be below the bytes it names."""
    def fits(gib: float) -> bool:
        return megacompile.plan(SMALL_LLAMA, gib, hardware="h100", batch=2, seq=96).fits

    def gib(figure: str, unit: str) -> float:
        return float(figure) / {"KiB": 2**20, "MiB": 2**10, "GiB": 1}[unit]

    roomy = megacompile.plan(SMALL_LLAMA, 1.0, hardware="h100", batch=2, seq=96)
    smallest = re.search(r"smallest fit   ([0-9.]+) (\w+)", roomy.summary())
    assert gib(*smallest.groups()) * GiB >= roomy.minimum_budget_bytes and fits(gib(*smallest.groups()))
    with pytest.raises(BudgetTooSmallError) as refused:
        megacompile.plan(SMALL_LLAMA, 0.01, hardware="h100", batch=2, seq=96)
    named = re.search(r"these input shapes is ([0-9.]+) GiB \(([0-9.]+) (\w+)\).*at least ([0-9.]+),",
                      str(refused.value))
    assert named.group(1) == named.group(4)
    for given in (float(named.group(1)), gib(*named.group(2, 3))):
        assert given * GiB >= refused.value.minimum_bytes and fits(given)


def test_the_values_at_the_peak_are_named_by_their_modules(tmp_path, capsys):
    rc, out = _cli(tmp_path, capsys, "--hbm-budget", "1")
    assert rc == 0
    parts = _line(out, "at the peak").split("at the peak", 1)[1].strip().split("; ")
    for part in parts[:-1]:     # "weights of model.layers.3 (w4) 288.50 KiB"
        assert re.fullmatch(r"(weights|saved activations|gradients|output|gradient)[^()]* of "
                            r"(model\.layers\.\d+|the prologue|the epilogue)[^()]*\((\w|\.)+\) [\d.]+ \w+", part), part
    assert re.fullmatch(r"working set of the (forward|backward|recompute) of (\S+|the \w+) [\d.]+ \w+",
                        parts[-1]), parts[-1]


def test_value_names_in_words():
    places = ["the prologue", "model.layers.0", "model.layers.1", "the epilogue"]
    assert describe_value("hsaved2", places) == "saved activations of model.layers.1, back from host memory"
    assert describe_value("g1", places) == "gradients of model.layers.0's parameters"
    assert describe_value("dx2.0", places) == "gradient of the input of model.layers.1"
    assert describe_value("x0.2@1", places) == "output 2 of the prologue, micro-batch 1"
    assert describe_value("gsum7", places) == "gsum7"       # a name it does not know stays as it is


def test_a_budget_beyond_any_device_is_named():
    with pytest.raises(ArgumentError, match=r"hbm_budget of 1e\+30 GiB is more than any device holds: budgets are "
                                            r"at most 1,048,576 GiB"):
        megacompile.plan(SMALL_LLAMA, hbm_budget=1e30, hardware="h100")
    with pytest.raises(ArgumentError, match=r"host_budget of 1e\+18 GiB is more than any machine's RAM holds"):
        megacompile.compile(models.NanoGPT(), hbm_budget=1.0, device="cpu", host_budget=1e18)


@pytest.mark.parametrize("folder", ["/proc/megacompile_tier", "/sys/kernel/megacompile_tier"])
def test_a_disk_tier_folder_that_is_no_disk_is_named(folder):
    with pytest.raises(ArgumentError, match=rf"nvme_dir {folder} is not on a disk: .* filesystem of 0 bytes"):
        megacompile.compile(models.NanoGPT(), hbm_budget=1.0, device="cpu", nvme_dir=folder)


def test_calibrate_refuses_a_disk_folder_that_is_no_disk(tmp_path, capsys):
    assert main(["calibrate", "--device", "cpu", "--nvme-dir", "/proc/megacompile_tier",
                 "--out", str(tmp_path / "profile.json")]) == 2
    assert "--nvme-dir /proc/megacompile_tier is not on a disk" in capsys.readouterr().err
    assert not (tmp_path / "profile.json").exists()
