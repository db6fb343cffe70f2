"""An SFT run from a TRL YAML and one from a LlamaFactory YAML leave the trained model in
output_dir as TRL and LlamaFactory do, without `export:`: a Hugging Face folder transformers
loads (a LoRA adapter PEFT loads), beside the run's own files; the run's last line says where."""
from __future__ import annotations

import os

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from tests.train import files


def _last_line(capsys) -> str:
    return capsys.readouterr().out.rstrip().splitlines()[-1]


def _trl(tmp_path, work: dict, output_dir: str) -> str:
    """SFTConfig's keys, as TRL's example YAMLs and SFTConfig.to_dict() write them."""
    return files.run_yaml(
        str(tmp_path / "trl.yaml"), model_name_or_path=work["model"], data=work["chats"], output_dir=output_dir,
        learning_rate=3e-3, per_device_train_batch_size=2, gradient_accumulation_steps=1, max_steps=2,
        max_length=32, packing=False, completion_only_loss=None, assistant_only_loss=False, eval_strategy="no",
        save_strategy="no", logging_steps=1, report_to="none", bf16=False, lr_scheduler_type="linear",
        warmup_ratio=0.0, seed=0, device="cpu")


@pytest.mark.long   # two short runs and two loads: 35-60 s on 2 cores
def test_trl_and_llamafactory_sft_runs_leave_a_model_in_output_dir(tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    work = files.workspace(tmp_path)
    base = AutoModelForCausalLM.from_pretrained(work["model"])

    out = str(tmp_path / "trl-out")
    result = run(load(_trl(tmp_path, work, out), []))
    assert _last_line(capsys) == f"model: {out} (a Hugging Face model folder: transformers' from_pretrained({out!r}) " \
                                 "loads it)"
    assert result["model"] == out
    assert not os.path.exists(os.path.join(out, "checkpoints"))        # save_strategy: no
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "log.csv"} <= set(os.listdir(out))
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out).chat_template == files.TEMPLATE
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight, base.model.layers[0].mlp.up_proj.weight)

    out = str(tmp_path / "saves" / "lora" / "sft")
    lf = files.run_yaml(
        str(tmp_path / "lf.yaml"), model_name_or_path=work["model"], trust_remote_code=True, stage="sft",
        do_train=True, finetuning_type="lora", lora_rank=4, lora_target="all", data=work["chats"], cutoff_len=32,
        output_dir="saves/lora/sft", logging_steps=1, save_steps=2, plot_loss=True, overwrite_output_dir=True,
        report_to="none", per_device_train_batch_size=2, gradient_accumulation_steps=1, learning_rate=3e-3,
        max_steps=2, lr_scheduler_type="cosine", bf16=False, device="cpu")
    run(load(lf, []))
    assert _last_line(capsys).startswith(f"model: {out} (a LoRA adapter in PEFT's format")
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(os.listdir(out))
    assert os.path.isdir(os.path.join(out, "checkpoints", "step-000002"))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(work["model"]), out)
    ids = torch.tensor([[2, 4, 9, 10, 11]])
    assert not torch.allclose(adapted(ids).logits, base(ids).logits)     # the adapter trained


def test_a_new_run_does_not_write_over_a_model_in_its_output_dir(tmp_path):
    work = files.workspace(tmp_path)
    out = str(tmp_path / "out")
    os.makedirs(out)
    files.model_dir(out)        # a model of someone else's in output_dir
    with pytest.raises(ArgumentError, match=r"run_dir .*out already holds a model \(.*config.json, .*\), which this "
                                            r"new run would write its own over"):
        run(load(_trl(tmp_path, work, out), []))
    assert not os.path.exists(os.path.join(out, "tokens"))     # refused before anything was written


def test_the_bundled_models_run_names_its_checkpoint_last(tmp_path, capsys):
    run(load(files.run_yaml(str(tmp_path / "b.yaml"), run_dir="run", steps=1, seq=16, device="cpu",
                            bundled_model={"dim": 32, "layers": 1, "heads": 2, "kv_heads": 1, "ffn": 64}), []))
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-000001")
    assert _last_line(capsys) == f"model: {checkpoint} (the bundled model is no Hugging Face model: its weights " \
                                 "are in this checkpoint)"
