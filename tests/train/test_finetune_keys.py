"""The fine-tuning keys are checked with run.yaml (values, keys of another finetuning_type), and
the module names they give against the model before the data is read: each bad one is an
ArgumentError naming the key, and a refused run leaves no run folder."""
from __future__ import annotations

import os

import pytest
import torch.nn as nn

from megacompile.errors import ArgumentError
from megacompile.train import load, run
from megacompile.train.methods import apply
from tests.train import files


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return files.workspace(tmp_path_factory.mktemp("finetune"))


def _config(tmp_path, work, **settings):
    base = dict(model=work["model"], data=[work["notes"]], seq=16, steps=1, device="cpu",
                run_dir=str(tmp_path / "run"))
    return load(files.run_yaml(str(tmp_path / "run.yaml"), **{**base, **settings}), [])


@pytest.mark.parametrize("settings, message", [
    ({"finetuning_type": "qlora"}, "finetuning_type must be one of full, lora, freeze; got 'qlora'"),
    ({"lora_rank": 16}, "lora_rank applies to finetuning_type: lora, and this run is finetuning_type: full"),
    ({"merge_adapter": True}, "merge_adapter applies to finetuning_type: lora"),
    ({"finetuning_type": "lora", "freeze_trainable_layers": 3},     # at LlamaFactory's default, 2, it asks nothing
     "freeze_trainable_layers applies to finetuning_type: freeze, and this run is finetuning_type: lora"),
    ({"finetuning_type": "freeze", "lora_target": "q_proj"}, "lora_target applies to finetuning_type: lora"),
    ({"finetuning_type": "lora", "lora_rank": 0}, "lora_rank must be a whole number >= 1; got 0"),
    ({"finetuning_type": "lora", "lora_alpha": -2}, "lora_alpha must be a number > 0"),
    ({"finetuning_type": "lora", "lora_dropout": 1.0}, r"lora_dropout must be a number in \[0, 1\); got 1.0"),
    ({"finetuning_type": "lora", "lora_target": 5}, "lora_target is a comma-separated string or a list"),
    ({"finetuning_type": "lora", "lora_target": "all,q_proj"}, "lora_target: all stands alone"),
    ({"finetuning_type": "lora", "merge_adapter": "yes"}, "merge_adapter must be true"),
    ({"finetuning_type": "lora", "use_dora": "yes"}, "use_dora must be true"),
    ({"use_dora": True}, "use_dora applies to finetuning_type: lora"),
    ({"finetuning_type": "lora", "use_rslora": 1}, "use_rslora must be true"),
    ({"use_rslora": True}, "use_rslora applies to finetuning_type: lora"),
    ({"finetuning_type": "lora", "loraplus_lr_ratio": -1}, "loraplus_lr_ratio must be a number > 0"),
    ({"loraplus_lr_ratio": 16}, "loraplus_lr_ratio applies to finetuning_type: lora"),
    ({"finetuning_type": "lora", "lr": 1e-3, "loraplus_lr_ratio": 1600}, "lr 1.6, above the 1 AdamW can train with"),
    ({"finetuning_type": "freeze", "freeze_trainable_layers": 0}, "freeze_trainable_layers must be a whole number"),
    ({"finetuning_type": "freeze", "freeze_trainable_modules": []}, "freeze_trainable_modules is a comma-separated"),
    ({"finetuning_type": "freeze", "freeze_extra_modules": "all"}, "freeze_extra_modules: all is not taken here"),
    ({"finetuning_type": "lora", "model": "bundled"}, "finetuning_type: lora needs a Hugging Face model"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, work, settings, message):
    with pytest.raises(ArgumentError, match=message):
        _config(tmp_path, work, **settings)


@pytest.mark.parametrize("settings, message", [
    ({"finetuning_type": "lora", "lora_target": "q_proj,qkv"},
     "lora_target: qkv is no Linear module of LlamaForCausalLM; its Linear modules are down_proj, gate_proj, "
     "k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
    ({"finetuning_type": "freeze", "freeze_trainable_layers": -3},
     r"freeze_trainable_layers -3: LlamaForCausalLM has 2 decoder blocks; give 1..2 \(the last N\) or -2..-1"),
    ({"finetuning_type": "freeze", "freeze_trainable_modules": "attn"},
     "freeze_trainable_modules: attn names no parameter of the decoder blocks; their modules are .*self_attn"),
    ({"finetuning_type": "freeze", "freeze_extra_modules": ["embed_tokens", "head"]},
     "freeze_extra_modules: head names no parameter of LlamaForCausalLM outside its decoder blocks; modules "
     "outside the blocks are .*lm_head"),
])
def test_names_the_model_lacks_are_refused_before_the_run_starts(tmp_path, work, settings, message):
    c = _config(tmp_path, work, **settings)
    with pytest.raises(ArgumentError, match=message):
        run(c)
    assert not os.path.exists(c.run_dir)


def test_lora_target_all_is_every_linear_of_the_blocks_and_freeze_counts_blocks_from_either_end(tmp_path, work):
    c = _config(tmp_path, work, finetuning_type="lora", lora_rank=2)
    from megacompile.train.model import meta_model
    model = apply(c, meta_model(c))
    assert model.peft_config["default"].lora_alpha == 4             # 2 * lora_rank
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert type(model.base_model.model.lm_head) is nn.Linear           # not wrapped

    first = apply(_config(tmp_path, work, finetuning_type="freeze", freeze_trainable_layers=-1), meta_model(c))
    assert {n.split(".")[2] for n, p in first.named_parameters() if p.requires_grad} == {"0"}
    last = apply(_config(tmp_path, work, finetuning_type="freeze", freeze_trainable_layers=1,
                         freeze_extra_modules="embed_tokens,norm"), meta_model(c))
    assert sorted({n for n, p in last.named_parameters() if p.requires_grad and "layers" not in n}) == [
        "model.embed_tokens.weight", "model.norm.weight"]
    # norm trains every parameter whose name holds it, as in LlamaFactory: block 0's norms too (test_freeze_names.py)
    assert sorted(n for n, p in last.named_parameters() if p.requires_grad and ".layers.0." in n) == [
        "model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"]


def test_a_lora_checkpoint_saved_before_use_dora_and_use_rslora_were_keys_resumes_as_plain_lora(tmp_path, work):
    from megacompile.train.methods import check_resume, saved
    c = _config(tmp_path, work, finetuning_type="lora", lora_rank=2)
    before = {k: v for k, v in saved(c).items() if k not in ("use_dora", "use_rslora", "additional_target")}
    check_resume(c, {"finetuning": before})
    with pytest.raises(ArgumentError, match=r"additional_target \[\] -> \['lm_head'\]"):
        check_resume(_config(tmp_path, work, finetuning_type="lora", lora_rank=2, additional_target="lm_head"),
                     {"finetuning": before})
    with pytest.raises(ArgumentError, match="use_dora False -> True"):
        check_resume(_config(tmp_path, work, finetuning_type="lora", lora_rank=2, use_dora=True), {"finetuning": before})
    with pytest.raises(ArgumentError, match="use_rslora False -> True"):
        check_resume(_config(tmp_path, work, finetuning_type="lora", lora_rank=2, use_rslora=True),
                     {"finetuning": before})


def test_a_resume_with_other_fine_tuning_keys_is_refused(tmp_path, work):
    first = _config(tmp_path, work, finetuning_type="lora", lora_rank=2, resume="auto", hbm_budget=0.001, batch=2)
    run(first)
    logged = os.path.getmtime(os.path.join(first.run_dir, "log.csv"))
    for changed, message in (({"finetuning_type": "full"}, "finetuning_type 'lora' -> 'full', lora_rank 2 -> None"),
                             ({"finetuning_type": "lora", "lora_rank": 4}, "lora_rank 2 -> 4")):
        c = _config(tmp_path, work, resume="auto", hbm_budget=0.001, batch=2, steps=2, **changed)
        with pytest.raises(ArgumentError, match=f"resume: the checkpoint trained other parameters .*{message}"):
            run(c)
        assert os.path.getmtime(os.path.join(first.run_dir, "log.csv")) == logged
    assert run(_config(tmp_path, work, finetuning_type="lora", lora_rank=2, resume="auto", hbm_budget=0.001, batch=2,
                       steps=2, merge_adapter=True))["steps"] == 2     # merge_adapter shapes the export only
