"""A stage that reads a reference at every step (GRPO with beta > 0) runs it as a second engine on
the policy's device (train/reference_model.py): its weights the model folder's, frozen and held
once on the host (no moments, gradients or compute copies), in eval mode, planned before the first
step; the KL term is 0 at the first step, when policy and reference are the same weights; and
building it leaves the run's random stream as it was, so the rollouts are those of a run without it."""
from __future__ import annotations

import glob
import os

from safetensors.torch import load_file

from megacompile.ir import fmt_bytes
from megacompile.train import load, log, loop, run
from tests.posttrain import stage_files
from tests.train import files


def _engines(monkeypatch) -> list:
    """(policy, reference) of each run from now on, as the loop builds them."""
    made = []
    build = loop.reference_engine

    def keep(c, meta, setup, first_inputs, wrap):
        engine = build(c, meta, setup, first_inputs, wrap)
        made.append((setup.engine, engine))
        return engine
    monkeypatch.setattr(loop, "reference_engine", keep)
    return made


def test_the_reference_is_the_loaded_model_frozen_on_the_policys_device(tmp_path, monkeypatch, capsys):
    work = stage_files.workspace(tmp_path)
    made = _engines(monkeypatch)
    run(load(files.run_yaml(str(tmp_path / "kl.yaml"), **stage_files.grpo(work, str(tmp_path / "kl"), beta=0.05)), []))
    (policy, reference), = made
    assert "reference      the model as loaded, forward only, in eval mode" in capsys.readouterr().out

    assert reference.backend is policy.backend and reference.budget_bytes == policy.budget_bytes
    assert not reference.model.training and not any(p.requires_grad for p in reference.model.parameters())
    n = sum(p.numel() for p in reference.model.parameters())
    parts = reference.host.parts()
    assert set(parts) == {"frozen weights and buffers"} and 4 * n <= parts["frozen weights and buffers"] < 4 * n + 4096
    assert reference.host_cost.ram_bytes == reference.host.nbytes
    (loaded,) = glob.glob(os.path.join(work["model"], "*.safetensors"))
    weights = load_file(loaded)
    held = reference.state_dict()
    for key, t in weights.items():
        assert held[f"policy.{key}"].equal(t), key       # never trained, never cast

    rows = log.read(str(tmp_path / "kl" / "log.csv"))
    assert float(rows[0]["kl"]) == 0.0 and float(rows[1]["kl"]) > 0     # the same weights at step 1; apart after
    run(load(files.run_yaml(str(tmp_path / "none.yaml"), **stage_files.grpo(work, str(tmp_path / "none"), beta=0.0)),
             []))
    alone = log.read(str(tmp_path / "none" / "log.csv"))
    assert alone[0]["reward"] == rows[0]["reward"] and alone[0]["completions/mean_length"] == \
        rows[0]["completions/mean_length"]


def test_beside_a_lora_policy_the_reference_holds_only_its_adapters(tmp_path, monkeypatch, capsys):
    work = stage_files.workspace(tmp_path)
    made = _engines(monkeypatch)
    run(load(files.run_yaml(str(tmp_path / "lora.yaml"), **stage_files.grpo(
        work, str(tmp_path / "lora"), beta=0.05, finetuning_type="lora", lora_rank=4)), []))
    (policy, reference), = made
    owner, host = policy.host, reference.host
    base = [n for n in owner.consts if "lora_" not in n]
    assert base and host.borrowed >= set(base)
    assert all(host.consts[n] is owner.consts[n] for n in base)      # the base once, the policy's
    adapters = sum(p.numel() * p.element_size() for n, p in reference.model.named_parameters() if "lora_" in n)
    assert reference.host.nbytes == reference.host_cost.ram_bytes == adapters
    shared = sum(owner.consts[n].untyped_storage().nbytes() for n in host.borrowed)
    assert f"(the {fmt_bytes(shared)} of frozen weights both hold are the policy's)" in capsys.readouterr().out
    rows = log.read(str(tmp_path / "lora" / "log.csv"))
    assert float(rows[0]["kl"]) == 0.0           # the policy at step 1 is the base: B = 0


def test_a_reference_of_a_config_without_weights_is_the_policys_random_init(tmp_path, monkeypatch):
    """A model folder with a config and no weights trains from a seeded random init: the reference
    draws the same init (the run's seed, the policy's draw order), so the KL term starts at 0."""
    work = stage_files.workspace(tmp_path)
    for f in glob.glob(os.path.join(work["model"], "*.safetensors")):
        os.remove(f)
    made = _engines(monkeypatch)
    run(load(files.run_yaml(str(tmp_path / "init.yaml"), **stage_files.grpo(work, str(tmp_path / "init"), beta=0.05,
                                                                           seed=7)), []))
    (policy, reference), = made
    rows = log.read(str(tmp_path / "init" / "log.csv"))
    assert float(rows[0]["kl"]) == 0.0 and float(rows[1]["kl"]) > 0
    held = reference.state_dict()
    assert not any(t.eq(0).all() for t in held.values() if t.dim() > 1)      # drawn, not left empty
