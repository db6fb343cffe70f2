"""`--host` plans a card with another host's memory bandwidth, AdamW rate and disk; with no --hbm-budget
the plan takes 90% of the card's memory, as compile() takes a GPU's."""
from __future__ import annotations

import json

import pytest

from megacompile.cli import main
from megacompile.cost import PROFILES
from megacompile.cost.hardware import H100_MEMORY
from megacompile.cost.host import HOSTS, with_host
from megacompile.errors import ArgumentError
from megacompile.planner.from_config import hardware_profile

SMALL_LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}


def test_with_host_replaces_only_the_host_side():
    card = PROFILES["rtx4090"]
    on_server = with_host(card, "server")
    assert (on_server.host_bw, on_server.host_adam_params_per_s) == (300e9, PROFILES["h100"].host_adam_params_per_s)
    assert (on_server.device_bytes, on_server.peak_bf16, on_server.h2d_bw) == (card.device_bytes, card.peak_bf16,
                                                                             card.h2d_bw)
    assert "server" in on_server.name
    # --nvme-bandwidth is laid over the host's disk, not under it
    both = hardware_profile("h100", nvme_bandwidth=2.0, host="desktop")
    assert (both.host_bw, both.disk_read_bw, both.disk_write_bw) == (HOSTS["desktop"].host_bw, 2e9, 2e9)
    with pytest.raises(ArgumentError, match="unknown host"):
        hardware_profile("h100", host="laptop")


def _plan(tmp_path, capsys, *args):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    rc = main(["plan", "--config", str(config), "--batch", "1", "--seq", "64", "--host-budget", "4", "--json", *args])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_plan_takes_the_host_and_the_cards_memory(tmp_path, capsys):
    rc, desktop = _plan(tmp_path, capsys, "--hardware", "h100", "--host", "desktop")
    assert rc == 0 and desktop["fits"]
    assert desktop["budget_bytes"] == int(0.9 * H100_MEMORY)
    _, server = _plan(tmp_path, capsys, "--hardware", "h100")
    # The same device plan, its host AdamW timed at a desktop's rate: 85% of 89.6 GB/s against the
    # 150 GB/s a server's 16 cores stream
    assert desktop["host_busy_s"] == pytest.approx(server["host_busy_s"] * 150 / (0.85 * 89.6), rel=1e-6)
    _, card = _plan(tmp_path, capsys, "--hardware", "rtx4090", "--hbm-budget", "20")
    assert card["budget_bytes"] == 20 * 2**30


def test_a_ddr4_desktop_times_the_host_adamw_at_its_bandwidth(tmp_path, capsys):
    """A 3090 often sits in a DDR4 desktop (DDR4-3200, two channels: 51.2 GB/s), whose AdamW runs at
    57% of the DDR5 desktop's the GeForce profiles assume."""
    assert HOSTS["desktop-ddr4"].host_bw == 2 * 8 * 3200e6
    rc, ddr4 = _plan(tmp_path, capsys, "--hardware", "rtx3090", "--host", "desktop-ddr4")
    assert rc == 0
    _, ddr5 = _plan(tmp_path, capsys, "--hardware", "rtx3090")
    assert ddr4["host_busy_s"] == pytest.approx(ddr5["host_busy_s"] * 89.6 / 51.2, rel=1e-6)


def test_host_cores_plan_the_adamw_a_host_with_more_cores_runs(tmp_path, capsys):
    """A cloud GPU's server host is 16 cores; 26 stream more (9.375 GB/s each), up to 85% of the
    socket's bandwidth; a measured profile holds its own host's rate and takes no count."""
    _, sixteen = _plan(tmp_path, capsys, "--hardware", "h200")
    rc, more = _plan(tmp_path, capsys, "--hardware", "h200", "--host-cores", "26")
    assert rc == 0
    assert more["host_busy_s"] == pytest.approx(sixteen["host_busy_s"] * 150 / (26 * 150 / 16), rel=1e-6)
    _, many = _plan(tmp_path, capsys, "--hardware", "h200", "--host-cores", "64")
    assert many["host_busy_s"] == pytest.approx(sixteen["host_busy_s"] * 150 / (0.85 * 300), rel=1e-6)
    with pytest.raises(ArgumentError, match="--host-cores must be a whole number of cores, 1 or more; got 0"):
        hardware_profile("h200", host_cores=0)
    measured = tmp_path / "profile.json"
    measured.write_text(json.dumps(PROFILES["h200"].to_dict()))
    with pytest.raises(ArgumentError, match="--host-cores 26 with the measured profile .*leave --host-cores out"):
        hardware_profile(str(measured), host_cores=26)
    assert hardware_profile(str(measured), host="server", host_cores=26).host_adam_params_per_s == \
        pytest.approx(26 * 150e9 / 16 / 28)
