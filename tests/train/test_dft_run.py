"""stage sft with TRL's loss_type dft (LlamaFactory's use_dft_loss), and LlamaFactory's
use_eaft_loss (loss_type eaft, eaft_alpha): the run trains the weighted loss and evaluates the
plain cross-entropy; a resume keeps the loss it began with."""
from __future__ import annotations

import os

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files

TINY = ["bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2", "bundled_model.kv_heads=1",
        "bundled_model.ffn=64", "device=cpu", "batch=1", "seq=16", "resume=auto", "warmup=0"]


@pytest.mark.parametrize("given, loss_type", [({"loss_type": "dft"}, "dft"), ({"use_dft_loss": True}, "dft"),
                                              ({"use_dft_loss": False}, None), ({"loss_type": "nll"}, None),
                                              ({"use_dft_loss": True, "loss_type": "dft"}, "dft"),
                                              ({"use_eaft_loss": True}, "eaft"), ({"loss_type": "eaft"}, "eaft"),
                                              ({"use_eaft_loss": False, "eaft_alpha": 1.0}, None)])
def test_trl_and_llamafactory_spell_it(tmp_path, given, loss_type):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), steps=1, **given), [])
    assert (c.loss_type, c.eaft_alpha) == (loss_type, 1.0 if loss_type == "eaft" else None)


@pytest.mark.parametrize("given, message", [
    ({"use_dft_loss": "yes"}, "use_dft_loss must be true or false; got 'yes'"),
    ({"use_dft_loss": True, "loss_type": "nll"}, "use_dft_loss"),
    ({"loss_type": "sigmoid"}, "stage sft: loss_type is nll (TRL's SFT default, the cross-entropy), dft"),
    ({"stage": "dpo", "packing": None, "use_dft_loss": True}, "loss_type dft (use_dft_loss) is stage sft's"),
    ({"stage": "grpo", "packing": None, "loss_type": "dft"}, "loss_type dft (use_dft_loss) is stage sft's"),
    ({"stage": "dpo", "packing": None, "use_eaft_loss": True}, "loss_type eaft (use_eaft_loss) is stage sft's"),
    ({"eaft_alpha": 0.5}, "eaft_alpha 0.5 weights the EAFT loss, which this run does not train"),
    ({"use_eaft_loss": True, "eaft_alpha": -1}, "eaft_alpha must be a number >= 0"),
    ({"use_asft_loss": True}, "use_asft_loss -> not supported: its KL term to the reference model"),
])
def test_what_is_not_a_supervised_loss_is_refused(tmp_path, given, message):
    with pytest.raises(ArgumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(files.run_yaml(str(tmp_path / "run.yaml"), steps=1, **given), [])


@pytest.mark.parametrize("loss", ["dft", "eaft"])
def test_the_run_trains_its_loss_and_evaluates_the_cross_entropy(tmp_path, loss):
    """The first logged loss is DFT's (EAFT's) of the first micro-batch under the model as loaded;
    the eval loss after the step is the exported model's own cross-entropy of the held-out rows."""
    from transformers import AutoModelForCausalLM

    from megacompile.posttrain import DFTObjective, EAFTObjective
    from megacompile.train.data import packing
    from megacompile.train.stages.sft import SFTStage
    work = files.workspace(tmp_path)
    given = {"loss_type": "dft"} if loss == "dft" else {"use_eaft_loss": True, "eaft_alpha": 0.5}
    config = files.run_yaml(str(tmp_path / "run.yaml"), model=work["model"], data=work["chats"], seq=24, batch=2,
                            steps=1, lr=1e-2, **given, eval_fraction=0.25, eval_every=1, eval_batches=1, device="cpu",
                            run_dir=str(tmp_path / "run"), export=str(tmp_path / "export"), log_every=1)
    c = load(config, [])
    stage = SFTStage(c, str(tmp_path / "inputs"))
    try:
        first = stage.first_inputs(2)
        held = packing.batch(stage.eval_rows, 0, 2, shifted=False)
    finally:
        stage.discard()
        stage.close()
    run(c)
    row = log.read(str(tmp_path / "run" / "log.csv"))[0]
    loaded = AutoModelForCausalLM.from_pretrained(work["model"], dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), dtype=torch.float32)
    with torch.no_grad():
        weighted = (DFTObjective(loaded) if loss == "dft" else EAFTObjective(loaded, 0.5))(**first).item()
        cross_entropy = loaded(**first).loss.item()
        eval_loss = trained(**held).loss.item()
    assert float(row["loss"]) == pytest.approx(weighted, rel=1e-5)
    # each token's -log p weighted by its p < 1, or by (H / 3) ** 0.5 < 1 (H of 20 tokens <= ln 20 < 3)
    assert weighted < cross_entropy
    assert float(row["eval_loss"]) == pytest.approx(eval_loss, rel=1e-5)
    assert not torch.equal(trained.lm_head.weight, loaded.lm_head.weight)


def test_a_resume_keeps_the_loss_it_began_with(tmp_path):
    run(load(None, [*TINY, f"run_dir={tmp_path / 'run'}", "steps=1", "loss_type=dft"]))
    with pytest.raises(ArgumentError, match=r"loss_type 'dft' -> None"):
        run(load(None, [*TINY, f"run_dir={tmp_path / 'run'}", "steps=2"]))
    run(load(None, [*TINY, f"run_dir={tmp_path / 'run'}", "steps=2", "use_dft_loss=true"]))
    assert [r["step"] for r in log.read(os.path.join(tmp_path, "run", "log.csv"))] == ["1", "2"]
