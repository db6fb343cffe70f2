"""`log: [wandb]` writes a W&B run in the run folder, offline here (never the network): its history
holds every step's loss as log.csv does, and a resumed run continues the same W&B run."""
from __future__ import annotations

import glob
import json
import os
import struct
import zlib

import pytest

from megacompile.train import load, run
from megacompile.train.log import read

wandb = pytest.importorskip("wandb")

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "log_every=1"]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline with its files under tmp, and its service process gone after the test."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    before = _children()
    yield
    wandb.teardown()
    assert _children() <= before, "a W&B process outlived the test"


def _children() -> set[int]:
    """Processes whose parent is this one."""
    mine, found = str(os.getpid()), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == mine and fields[0] != "Z":
            found.add(int(pid))
    return found


def records(path: str) -> list:
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", 0xBEE1, version 0), then
    LevelDB-log-style chunks in 32 KiB blocks (crc32 of type+data, length, type: full, first,
    middle, last)."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    block, pos, parts, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:      # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            break
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + chunk) == crc, f"{path}: a record's checksum does not match"
        parts += chunk
        pos += 7 + length
        if kind in (1, 4):          # full, or the last part of a record cut across blocks
            record = pb.Record()
            record.ParseFromString(parts)
            out.append(record)
            parts = b""
    return out


def history(path: str) -> dict[int, dict]:
    rows = {}
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            rows[record.history.step.num] = items
    return rows


def _run_id(record_path: str) -> str:
    return next(r.run.run_id for r in records(record_path) if r.WhichOneof("record_type") == "run")


def test_offline_run_history_holds_the_loss_of_every_step_and_a_resume_continues_it(tmp_path, offline):
    run_dir = str(tmp_path / "run")
    run(load(None, [*TINY, "steps=3", "save_every=2", f"run_dir={run_dir}", "report_to=wandb", "name=tiny",
                    "wandb_project=keys"]))
    made = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(made) == 1
    steps = history(made[0])
    logged = read(os.path.join(run_dir, "log.csv"))
    assert sorted(steps) == [1, 2, 3]
    for row in logged:
        got = steps[int(row["step"])]
        assert got["train/loss"] == float(row["loss"]) and got["train/lr"] == float(row["lr"])
    first = records(made[0])
    info = next(r.run for r in first if r.WhichOneof("record_type") == "run")
    assert info.project == "keys" and info.display_name == "tiny"
    config = {item.key: json.loads(item.value_json) for item in info.config.update}
    assert config["steps"] == 3 and config["log"] == ["csv", "wandb"]
    assert "given" not in config and "grown" not in config       # run.yaml's keys alone, not what the run derives
    with open(os.path.join(run_dir, "wandb-run-id")) as f:
        assert f.read() == info.run_id

    # From the checkpoint at step 2 on to step 5: the same W&B run id; W&B keeps what it logged first
    # of step 3 (it takes back no step; the resumed run's step 3 is the same anyway).
    run(load(None, [*TINY, "steps=5", f"run_dir={run_dir}", "log=wandb", "resume=auto", "name=tiny",
                    "wandb_project=keys"]))
    second = [p for p in glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb")) if p not in made]
    assert len(second) == 1 and _run_id(second[0]) == info.run_id
    resumed = history(second[0])
    assert {4, 5} <= set(resumed) <= {3, 4, 5}
    logged = {int(r["step"]): float(r["loss"]) for r in read(os.path.join(run_dir, "log.csv"))}
    both = {**resumed, **steps}
    assert sorted(both) == sorted(logged) == [1, 2, 3, 4, 5]
    assert all(both[s]["train/loss"] == logged[s] for s in logged)


def test_log_wandb_without_the_package_is_refused_at_the_check(tmp_path, monkeypatch):
    import importlib.util
    from megacompile.errors import ArgumentError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ArgumentError, match="log: wandb needs `pip install wandb`; or leave it out"):
        load(None, [*TINY, "steps=1", f"run_dir={tmp_path / 'run'}", "log=[csv, wandb]"])
    assert not os.path.exists(tmp_path / "run")
