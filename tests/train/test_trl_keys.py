"""TRL's and LlamaFactory's keys where megacompile's meaning or defaults differ: TRL's defaults as
SFTConfig.to_dict() writes them are taken (completion_only_loss: null, a bare `no` for a
strategy), packing says at the start how it differs from theirs, and their keys megacompile does
not take are refused naming the equivalent or why, not in an unknown-key list."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.aliases import ALIASES, IGNORED, SPECIAL
from megacompile.train.config import KEYS
from megacompile.train.their_keys import NOT_TAKEN
from tests.train import files


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    return files.run_yaml(str(tmp_path / "run.yaml"), **{"data": "d.jsonl", "run_dir": "run", "steps": 2, **settings})


def test_completion_only_loss_null_is_trls_default(tmp_path):
    c = load(_yaml(tmp_path, completion_only_loss=None))
    assert c.train_on_prompt is False           # the completion alone, as TRL on prompt/completion records


@pytest.mark.parametrize("key", ["eval_strategy", "evaluation_strategy"])
def test_a_bare_no_on_the_command_line_turns_eval_off(tmp_path, key):
    c = load(_yaml(tmp_path, eval_fraction=0.1, eval_steps=1), [f"{key}=no"])      # YAML reads no as false
    assert c.eval_every is None


@pytest.mark.parametrize("given, every", [({"logging_steps": 5}, 5), ({}, 500), ({"logging_steps": 5, "eval_steps": 0}, 5),
                                          ({"logging_steps": 5, "eval_steps": 3}, 3)])
def test_eval_strategy_steps_without_eval_steps_evaluates_every_logging_steps(tmp_path, capsys, given, every):
    c = load(_yaml(tmp_path, val_size=0.1, eval_strategy="steps", **given))      # as transformers sets eval_steps
    assert c.eval_every == every
    assert ("evaluates every" in capsys.readouterr().out) == ("eval_steps" not in given or not given["eval_steps"])


@pytest.mark.parametrize("written, override", [("no", []), (False, []), ("steps", ["save_strategy=no"])])
def test_save_strategy_no_means_no_checkpoint_at_all(tmp_path, written, override):
    files.model_dir(str(tmp_path / "model"))
    c = load(_yaml(tmp_path, model="model", save_strategy=written, save_steps=1), override)
    assert c.save_every is False


def test_save_strategy_no_is_refused_for_the_bundled_model_whose_checkpoint_is_its_only_copy(tmp_path):
    with pytest.raises(ArgumentError, match="bundled model.*has no other place for its trained weights"):
        load(_yaml(tmp_path, save_strategy="no"))


@pytest.mark.parametrize("key, value, says", [
    ("padding_free", True, r"padding_free -> not taken: TRL's flattens each batch .* one program per row shape "
                           r".* stage sft's rows without padding are packing: isolated"),
    ("dataset_name", "trl-lib/Capybara", r"dataset_name -> give the data files as data:"),
    ("use_peft", True, r"use_peft -> finetuning_type: lora"),
    ("quantization_bit", 4, r"quantization_bit -> not supported: the weights train in float32 masters"),
])
def test_their_keys_megacompile_does_not_take_name_the_equivalent_or_why(tmp_path, key, value, says):
    with pytest.raises(ArgumentError, match=says) as caught:
        load(_yaml(tmp_path, **{key: value}))
    assert "the keys are" not in str(caught.value)          # not the generic unknown-key list


def test_their_key_beside_an_unknown_one_names_both(tmp_path):
    with pytest.raises(ArgumentError, match=r"padding_free -> not taken.*; unknown key not_a_key"):
        load(_yaml(tmp_path, padding_free=True, not_a_key=1))


@pytest.mark.parametrize("stage, unit", [("dpo", "pair"), ("kto", "example")])
def test_padding_free_under_the_preference_stages_is_taken_with_a_note(tmp_path, capsys, stage, unit):
    # TRL 1.16's DPOTrainer warns and turns padding_free off; the rows here are cut after their longest already
    record = ('{"prompt": "a", "chosen": "b", "rejected": "c"}' if stage == "dpo"
              else '{"prompt": "a", "completion": "b", "label": true}')
    (tmp_path / "p.jsonl").write_text(record + "\n")
    files.model_dir(str(tmp_path / "model"))
    load(_yaml(tmp_path, model="model", stage=stage, data="p.jsonl", batch=2, padding_free=True))
    notes = [line for line in capsys.readouterr().out.splitlines() if "padding_free" in line]
    assert len(notes) == 1 and f"padding_free under stage {stage} asks for nothing more" in notes[0]
    assert f"cut after their longest {unit}'s last token" in notes[0] and "trim_padding" in notes[0]


def test_their_keys_asking_for_nothing_are_accepted(tmp_path):
    c = load(_yaml(tmp_path, neat_packing=False, push_to_hub=False, quantization_bit=None, use_liger_kernel=False))
    assert c.packing is None        # not given: records one a row, text packed (as LlamaFactory's sft and pt)
    # LlamaFactory's web UI writes pref_ftx: 0 (its default) into every dpo run.yaml
    load(_yaml(tmp_path, pref_ftx=0))
    with pytest.raises(ArgumentError, match="quantization_bit -> "):
        load(_yaml(tmp_path, quantization_bit=0))
    with pytest.raises(ArgumentError, match=r"stage sft: pref_ftx \(stage dpo or kto\) belongs to another stage"):
        load(_yaml(tmp_path, pref_ftx=0.1))


def test_no_key_is_both_taken_and_refused():
    assert not set(NOT_TAKEN) & (set(KEYS) | set(ALIASES) | set(IGNORED) | set(SPECIAL))


def _notes(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "packing" in line]


def test_packing_says_at_the_start_where_it_differs_from_trl_and_llamafactory(tmp_path, capsys):
    files.model_dir(str(tmp_path / "model"))
    load(_yaml(tmp_path, model="model"))
    default, = _notes(capsys)
    assert "packing not given: supervised records (chat, Alpaca, prompt/completion) are not packed" in default
    load(_yaml(tmp_path, model="model", packing=True))
    given, = _notes(capsys)
    assert "packing: true packs records whole" in given
    assert "TRL's packing: true keeps them apart, which is packing: isolated here" in given
    for same in (False, "isolated"):        # TRL's packing: false and packing: true
        load(_yaml(tmp_path, model="model", packing=same))
        assert _notes(capsys) == []


# LlamaFactory's ModelArguments, FinetuningArguments and transformers' TrainingArguments keys at their
# defaults, as a run.yaml saved by LlamaFactory's web UI or copied from its examples holds them.
LLAMAFACTORY_DEFAULTS = {
    "upcast_layernorm": False, "upcast_lmhead_output": False, "pure_bf16": False, "use_unsloth_gc": False,
    "compute_accuracy": False, "predict_with_generate": False, "do_predict": False,
    "include_num_input_tokens_seen": True, "disable_gradient_checkpointing": False, "use_reentrant_gc": True,
    "create_new_adapter": False, "moe_aux_loss_coef": None, "print_param_status": False, "train_from_scratch": False,
    "use_fast_tokenizer": True, "resize_vocab": False, "split_special_tokens": False, "new_special_tokens": None,
    "low_cpu_mem_usage": True, "infer_backend": "huggingface", "infer_dtype": "auto", "export_dir": None,
    "use_swanlab": False, "swanlab_project": None, "ray_run_name": None, "logging_dir": None,
    "ddp_find_unused_parameters": False, "dataloader_pin_memory": True, "remove_unused_columns": False,
    "label_names": None, "group_by_length": False, "eval_accumulation_steps": None, "use_llama_pro": False,
    "use_adam_mini": False, "use_galore": False, "use_apollo": False, "use_badam": False, "use_muon": False,
    "image_resolution": None, "shift_attn": False, "mixture_of_depths": None, "offload_folder": "offload",
    "use_cache": True, "use_kt": False, "kt_optimize_rule": None, "loraplus_lr_embedding": 1e-6}


def test_llamafactorys_keys_at_their_defaults_are_accepted(tmp_path, capsys):
    c = load(_yaml(tmp_path, **LLAMAFACTORY_DEFAULTS))
    assert c.steps == 2
    said = capsys.readouterr().out
    assert "upcast_lmhead_output (the loss's log-softmax runs in float32)" in said       # ignored, and said so


@pytest.mark.parametrize("key, value, says", [
    ("pure_bf16", True, "pure_bf16 -> not supported: megacompile keeps float32 masters"),
    ("use_galore", True, "use_galore -> not supported: megacompile trains with AdamW"),
    ("use_fast_tokenizer", False, "use_fast_tokenizer -> the tokenizer is transformers' AutoTokenizer"),
    ("infer_backend", "vllm", "infer_backend -> not supported: megacompile trains"),
    ("export_dir", "out", "export_dir -> export: FOLDER writes the trained model"),
    ("image_resolution", 512, "image_resolution -> image_max_pixels"),
    ("loraplus_lr_embedding", 1e-4, "loraplus_lr_embedding -> not supported: adapters sit on Linear modules alone"),
])
def test_llamafactorys_keys_asking_for_what_megacompile_does_not_do_name_why(tmp_path, key, value, says):
    with pytest.raises(ArgumentError, match=says):
        load(_yaml(tmp_path, **{key: value}))


@pytest.mark.parametrize("key", ["enable_liger_kernel", "use_liger_kernel", "use_v1_kernels"])
def test_asking_for_their_fused_kernels_runs_megacompiles(tmp_path, capsys, key):
    """Liger's kernels (LlamaFactory's enable_liger_kernel, TRL's use_liger_kernel) or LlamaFactory's
    own: what they ask for, fused kernels, is megacompile's own (fuse), said in the run's note."""
    plain = load(_yaml(tmp_path))
    capsys.readouterr()
    assert load(_yaml(tmp_path, **{key: True})) == plain
    assert f"{key} (megacompile's own fused Triton kernels run in their place" in capsys.readouterr().out
    load(_yaml(tmp_path, **{key: False}))
    assert key not in capsys.readouterr().out


def test_trls_model_config_keys_are_read_or_refused_by_name(tmp_path, capsys):
    """TRL's ModelConfig (the `trl sft --config` scripts' model keys): lora_modules_to_save is
    additional_target; attn_implementation and lora_task_type are the run's own choice, said in a
    note; bitsandbytes' quantised loading is refused by name, accepted at its defaults."""
    c = load(_yaml(tmp_path, model=files.model_dir(str(tmp_path / "llama"), dim=32), finetuning_type="lora",
                   lora_modules_to_save=["lm_head"],
                   attn_implementation="flash_attention_2", lora_task_type="CAUSAL_LM", bnb_4bit_quant_type="nf4",
                   load_in_4bit=False))
    assert c.additional_target == ["lm_head"]
    said = capsys.readouterr().out
    assert "attn_implementation (attention runs as megacompile captured and planned it" in said
    assert "lora_task_type" not in said     # at TRL's default
    for key, value in (("load_in_4bit", True), ("bnb_4bit_quant_type", "fp4"), ("lora_target_parameters", ["w"])):
        with pytest.raises(ArgumentError, match=f"{key} -> not supported"):
            load(_yaml(tmp_path, **{key: value}))


def test_llamafactorys_neat_packing_is_packing_isolated_whatever_packing_says(tmp_path, capsys):
    """LlamaFactory turns packing on under neat_packing and keeps each packed record apart."""
    files.model_dir(str(tmp_path / "model"))
    for packing in (None, False, True):
        c = load(_yaml(tmp_path, model="model", neat_packing=True, **({} if packing is None else {"packing": packing})))
        assert c.packing == "isolated"
        assert any("neat_packing: the packed records are kept apart" in line for line in _notes(capsys))
    assert load(_yaml(tmp_path, model="model", neat_packing=False)).packing is None
    with pytest.raises(ArgumentError, match="neat_packing is true or false"):
        load(_yaml(tmp_path, model="model", neat_packing="yes"))


def test_a_recipes_model_and_hub_keys_run_as_written(tmp_path, capsys):
    """The alignment-handbook's and open-r1's recipes carry torch_dtype, model_revision: main,
    gradient_checkpointing_kwargs and a hub_model_id they do not push to; a dump made on a CPU
    machine, use_cpu: true."""
    c = load(_yaml(tmp_path, torch_dtype="bfloat16", bf16=True, model_revision="main",
                   gradient_checkpointing_kwargs={"use_reentrant": False}, hub_model_id="org/model", push_to_hub=False,
                   use_cpu=True))
    assert (c.compute_dtype, c.device) == ("bfloat16", "cpu")
    line = next(x for x in capsys.readouterr().out.splitlines() if "ignored (no effect" in x)
    assert "torch_dtype (the weights train in float32 masters; the compute's dtype is compute_dtype" in line
    assert "gradient_checkpointing_kwargs (the planner chooses what to recompute)" in line
    with pytest.raises(ArgumentError, match="hub_model_id -> the trained model is written to output_dir"):
        load(_yaml(tmp_path, hub_model_id="org/model", push_to_hub=True))
    with pytest.raises(ArgumentError, match="model_revision -> megacompile reads local files"):
        load(_yaml(tmp_path, model_revision="v2"))


def test_eos_token_is_taken_where_it_is_the_tokenizers_own(tmp_path):
    """SmolLM3's recipe names <|im_end|>, its tokenizer's own EOS: taken. Another token, with which
    TRL would close every record, is refused; so is any for the bundled model (no tokenizer)."""
    from transformers import AutoTokenizer
    model = files.model_dir(str(tmp_path / "model"))
    own = AutoTokenizer.from_pretrained(model).eos_token
    assert load(_yaml(tmp_path, model=model, eos_token=own)).eos_token == own
    with pytest.raises(ArgumentError, match=rf"eos_token '<other>': megacompile closes each record with the "
                                            rf"tokenizer's own end-of-sequence token, '{own}'"):
        load(_yaml(tmp_path, model=model, eos_token="<other>"))
    with pytest.raises(ArgumentError, match="eos_token: the bundled model reads bytes"):
        load(_yaml(tmp_path, eos_token=own))
    assert load(_yaml(tmp_path, model=model, eos_token="<EOS_TOKEN>")).eos_token is None     # a dump's placeholder


@pytest.mark.parametrize("more, said", [({"save_steps": 4}, True), ({"save_steps": 4, "save_total_limit": 5}, False),
                                        ({"save_steps": 4, "save_total_limit": None}, False),
                                        ({"save_every": 4}, False)])
def test_the_trainers_save_steps_without_a_limit_hears_that_three_checkpoints_are_kept(tmp_path, capsys, more, said):
    """The Trainer keeps every checkpoint-N unless save_total_limit is given; keep_last's 3 here."""
    files.model_dir(str(tmp_path / "model"))
    c = load(_yaml(tmp_path, model="model", **more))
    out = capsys.readouterr().out
    assert ("save_total_limit not given: the 3 latest checkpoints are kept (keep_last 3;" in out) is said
    assert c.keep_last == (5 if more.get("save_total_limit") == 5 else None if "save_total_limit" in more else 3)
