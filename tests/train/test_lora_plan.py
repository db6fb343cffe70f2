"""`megacompile plan --lora-rank R` plans a config with LoRA adapters on a frozen base: the adapters
alone trainable (PEFT's count) with fp32 masters and moments, the base held in the compute dtype
(bfloat16) and never sending a gradient back over the link."""
from __future__ import annotations

import json

import torch

from megacompile.cli import main
from megacompile.planner.from_config import model_from_config
from megacompile.train.methods.lora import lora_for_plan

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}


def test_plan_with_lora_rank_counts_the_adapters_alone(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    # h100: the GPU plan fuses its stages, the frozen embedding's empty backward among them
    assert main(["plan", "--config", str(path), "--hbm-budget", "1", "--hardware", "h100", "--batch", "1",
                 "--seq", "64", "--lora-rank", "4", "--json"]) == 0
    captured = capsys.readouterr()      # --json: the document on stdout, the text on stderr
    plan, out = json.loads(captured.out), captured.err
    model = lora_for_plan(model_from_config(str(path)), 4, "all", torch.bfloat16)
    trainable, total = model.get_nb_trainable_parameters()
    assert (plan["trainable_params"], plan["frozen_params"]) == (trainable, total - trainable)
    assert f"{trainable:,} trainable parameters, {total - trainable:,} frozen" in out
    assert plan["host_tiers"]["fp32 masters"]["bytes"] == 4 * trainable
    assert plan["host_tiers"]["exp_avg+exp_avg_sq"]["bytes"] == 8 * trainable
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert plan["host_frozen_bytes"] == 2 * (total - trainable) + buffers       # the base in bfloat16
    # Device to host: the adapters' bfloat16 gradients (and the step's few flag bytes), none of the base's.
    assert 2 * trainable <= plan["d2h_bytes_per_step"] < 2 * trainable + 64


def test_plan_refuses_a_bad_lora_rank_or_target_naming_the_flag(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    for flags, message in ((["--lora-rank", "0"], "--lora-rank must be a whole number >= 1; got 0"),
                           (["--lora-rank", "4", "--lora-target", "q_proj,qkv"],
                            "--lora-target: qkv is no Linear module of LlamaForCausalLM; its Linear modules are "
                            "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")):
        assert main(["plan", "--config", str(path), "--hbm-budget", "1", *flags]) == 2
        assert message in capsys.readouterr().err
