"""A fine-tuning run from files, killed with SIGKILL between checkpoints and resumed with
`resume: auto`, ends with the weights and the log of a run that was never interrupted, bit for
bit; its export loads in transformers."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files, killed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAME = ("step", "loss", "lr", "grad_norm", "tokens", "device_peak_bytes", "predicted_device_peak_bytes",
        "eval_loss", "eval_perplexity")


def _settings(work: dict, name: str) -> dict:
    return dict(model=work["model"], data=[work["chats"], work["notes"]], seq=24, packing="isolated", batch=2,
                grad_accum=2, steps=7, lr=3e-3, warmup=2, schedule="cosine", min_lr=1e-4, max_grad_norm=1.0,
                eval_fraction=0.2, eval_every=3, save_every=2, keep_last=2, device="cpu", resume="auto",
                run_dir=name, export=f"{name}-export", log_every=3)


def _weights(folder: str) -> dict:
    import safetensors.torch
    return safetensors.torch.load_file(os.path.join(folder, "model.safetensors"))


@pytest.mark.slow   # two runs and a killed one: ~30 s on 2 cores
def test_a_run_killed_mid_way_resumes_to_the_uninterrupted_result(tmp_path):
    work = files.workspace(tmp_path)
    whole = run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **_settings(work, "whole")), []))
    assert whole["steps"] == 7

    config = files.run_yaml(str(tmp_path / "cut.yaml"), **_settings(work, "cut"))
    child = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "train", "crash_child.py"), config, "5"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    cut = str(tmp_path / "cut")
    assert [r["step"] for r in log.read(os.path.join(cut, "log.csv"))] == ["1", "2", "3", "4", "5"]
    assert sorted(os.listdir(os.path.join(cut, "checkpoints"))) == ["step-000002", "step-000004"]
    assert not os.path.exists(cut + "-export")

    resumed = run(load(config, []))          # resume: auto, from step 4; step 5's row is written again
    assert resumed["steps"] == 7
    a, b = log.read(str(tmp_path / "whole" / "log.csv")), log.read(os.path.join(cut, "log.csv"))
    assert [{k: r[k] for k in SAME} for r in a] == [{k: r[k] for k in SAME} for r in b]
    assert sum(bool(r["eval_loss"]) for r in b) == 3            # after steps 3, 6 and the last
    # LlamaFactory's log too: step 6's line averages steps 5 and 6, trained again, with step 4, trained before
    assert killed.trainer_log(tmp_path / "whole") == killed.trainer_log(cut)
    ours, theirs = _weights(str(tmp_path / "whole-export")), _weights(cut + "-export")
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    before = _weights(work["model"])
    assert not all(torch.equal(before[k], ours[k]) for k in ours)     # it trained

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(cut + "-export")
    tokenizer = AutoTokenizer.from_pretrained(cut + "-export")
    ids = torch.tensor([tokenizer("the cat sat on the mat")["input_ids"]])
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, labels=ids).loss)
    assert all(torch.equal(model.state_dict()[k], ours[k]) for k in ours)

    # Other tokens under the same run_dir: refused, not resumed on a different data stream.
    with open(work["chats"], "a") as f:
        f.write('{"text": "the dog sat on the cat"}\n')
    with pytest.raises(ArgumentError, match=r"was saved by a run on other data: .*chats.jsonl changed size"):
        run(load(config, []))



def test_a_resume_that_would_cut_other_rows_is_refused(tmp_path):
    """The data position is a count of rows, and seq, packing and seed decide which rows those are:
    a resume under other values would silently train on other data."""
    tiny = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
            "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "save_every=1", "resume=auto",
            f"run_dir={tmp_path / 'run'}"]
    assert run(load(None, ["steps=1", *tiny]))["steps"] == 1
    with pytest.raises(ArgumentError, match=r"cut its rows otherwise \(seed 0 -> 1\)"):
        run(load(None, ["steps=2", "seed=1", *tiny]))
    assert run(load(None, ["steps=2", *tiny]))["steps"] == 2      # the same rows: it resumes
