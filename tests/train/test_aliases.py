"""LlamaFactory's and transformers/TRL's key names are read as megacompile's own keys; two
spellings of one setting must agree; keys with no effect are named in a note; and the schedules
they name follow transformers' get_scheduler step for step."""
from __future__ import annotations

import json
import math
import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.schedule import learning_rate
from tests.train import files


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    base = dict(data="d.jsonl") if "output_dir" in settings else dict(data="d.jsonl", run_dir="run")
    return files.run_yaml(str(tmp_path / "run.yaml"), **{**base, **settings})


def test_every_alias_lands_on_its_own_key(tmp_path):
    c = load(_yaml(tmp_path, learning_rate="3e-4", per_device_train_batch_size=2, gradient_accumulation_steps=4,
                   max_steps=40, warmup_ratio=0.1, lr_scheduler_type="linear", cutoff_len=64, output_dir="out",
                   save_steps=10, save_total_limit=1, logging_steps=5, report_to="none", seed=7,
                   weight_decay=0.01, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, max_grad_norm=0.5,
                   bf16=True, val_size=0.1, eval_steps=10, resume_from_checkpoint=None, train_on_prompt=True,
                   run_name="sft", num_train_epochs=3.0))
    assert (c.lr, c.batch, c.grad_accum, c.steps, c.epochs) == (3e-4, 2, 4, 40, None)   # max_steps wins over epochs
    assert (c.warmup, c.schedule, c.seq) == (4, "linear", 64)       # ceil(40 * 0.1)
    assert c.run_dir == str(tmp_path / "out")                       # relative to the run.yaml, as run_dir is
    assert (c.save_every, c.keep_last, c.log_every, c.log, c.seed) == (10, 1, 5, ["csv"], 7)
    assert (c.weight_decay, c.betas, c.eps, c.max_grad_norm) == (0.01, [0.8, 0.95], 1e-6, 0.5)
    assert (c.compute_dtype, c.eval_fraction, c.eval_every, c.resume, c.train_on_prompt, c.name) == \
        ("bfloat16", 0.1, 10, None, True, "sft")


def test_max_steps_minus_one_means_the_epochs_and_a_ratio_waits_for_the_steps(tmp_path):
    c = load(_yaml(tmp_path, max_steps=-1, num_train_epochs=2, warmup_ratio=0.1, output_dir="out",
                   resume_from_checkpoint=True))
    assert c.steps is None and c.epochs == 2.0 and c.warmup == 0.1       # loop.run resolves it from the data
    assert c.resume == "auto"


def test_the_same_value_under_both_names_is_fine_and_a_different_one_is_refused(tmp_path):
    assert load(_yaml(tmp_path, learning_rate="2e-5", lr=2.0e-5, steps=2)).lr == 2e-5
    with pytest.raises(ArgumentError, match=r"learning_rate: 0.001 and lr: 0.002 set the same setting \(lr\)"):
        load(_yaml(tmp_path, learning_rate=1e-3, lr=2e-3, steps=2))
    with pytest.raises(ArgumentError, match="cutoff_len: 64 and max_seq_length: 128 set the same setting"):
        load(_yaml(tmp_path, cutoff_len=64, max_seq_length=128, steps=2))
    with pytest.raises(ArgumentError, match=r"betas: \[0.9, 0.999\] and adam_beta2: 0.95"):
        load(_yaml(tmp_path, betas=[0.9, 0.999], adam_beta2=0.95, steps=2))
    with pytest.raises(ArgumentError, match="bf16: True and compute_dtype: 'float32'"):
        load(_yaml(tmp_path, bf16=True, compute_dtype="float32", steps=2))
    assert not os.path.exists(tmp_path / "run")


def test_overrides_replace_the_files_value_whichever_name_either_uses(tmp_path):
    path = _yaml(tmp_path, learning_rate=1e-3, max_steps=5)
    c = load(path, ["lr=2e-3", "max_steps=7"])
    assert c.lr == 2e-3 and c.steps == 7
    c = load(_yaml(tmp_path, lr=1e-3, steps=5), ["learning_rate=3e-3", "cutoff_len=48"])
    assert c.lr == 3e-3 and c.seq == 48
    with pytest.raises(ArgumentError, match="learning_rate: '4e-3' and lr: '5e-3'"):
        load(path, ["learning_rate=4e-3", "lr=5e-3"])


@pytest.mark.parametrize("settings, message", [
    ({"fp16": True}, "fp16: true is refused: megacompile computes in float32 or bfloat16"),
    ({"stage": "ppo"}, "stage 'ppo' is not supported; megacompile train runs stage: sft"),
    ({"do_train": False}, "do_train False: megacompile train always trains"),
    ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type 'polynomial': megacompile follows linear, cosine"),
    ({"lr_scheduler_type": "cosine_with_min_lr"}, "cosine_with_min_lr takes one of min_lr, min_lr_rate"),
    ({"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 2}}, "megacompile takes min_lr or"),
    ({"val_size": 200}, "val_size 200 is a count of examples"),
    ({"save_steps": 2.5}, "save_steps (megacompile's save_every): save_every must be a whole number >= 1 (steps), "
                          "or a fraction of the run's steps above 0 and below 1, or epoch"),
    ({"save_strategy": "best"}, "save_strategy 'best': megacompile saves every save_steps steps or at each epoch's"),
    ({"template": "llama3"}, "template 'llama3': the bundled model reads bytes and has no chat template"),
    ({"report_to": "mlflow"}, "log is a list of csv, tensorboard, wandb, none or all"),
    ({"report_to": ["none", "wandb"]}, "log: none goes alone"),
    ({"optim": "sgd"}, "optim 'sgd': megacompile trains with AdamW"),
    ({"warmup_steps": 2.5}, "warmup_steps (megacompile's warmup): warmup is a number of steps"),
])
def test_what_megacompile_cannot_honour_is_refused_by_name(tmp_path, settings, message):
    with pytest.raises(ArgumentError) as e:
        load(_yaml(tmp_path, steps=4, **settings))
    assert message in str(e.value)
    assert not os.path.exists(tmp_path / "run")


def test_trls_loss_switches_are_two_settings_not_train_on_prompt(tmp_path):
    # TRL's defaults as SFTConfig.to_dict() writes them: no prompt training (tests/train/test_trl_loss_keys.py)
    c = load(_yaml(tmp_path, steps=2, assistant_only_loss=False, completion_only_loss=None))
    assert (c.train_on_prompt, c.assistant_only_loss, c.completion_only_loss) == (False, False, None)
    c = load(_yaml(tmp_path, steps=2, assistant_only_loss=True, completion_only_loss=False))     # no conflict
    assert (c.train_on_prompt, c.assistant_only_loss, c.completion_only_loss) == (False, True, False)
    assert load(_yaml(tmp_path, steps=2, completion_only_loss=True, assistant_only_loss=False)).train_on_prompt is False
    with pytest.raises(ArgumentError, match="train_on_prompt: true trains every token, and completion_only_loss: "
                                            "true only the completion"):
        load(_yaml(tmp_path, steps=2, train_on_prompt=True, completion_only_loss=True))


@pytest.mark.parametrize("typo, told", [("lora_rnk", "lora_rnk (did you mean lora_rank?)"),
                                        ("learning_rat", "learning_rat (did you mean learning_rate?)"),
                                        ("warmup_ratoi", "warmup_ratoi (did you mean warmup_ratio?)"),
                                        ("zzz", "zzz")])
def test_an_unknown_key_is_named_with_the_key_it_is_closest_to_not_a_list_of_every_key(tmp_path, typo, told):
    with pytest.raises(ArgumentError) as e:
        load(_yaml(tmp_path, steps=2, **{typo: 8}))
    assert str(e.value).endswith(f"unknown key {told}; docs/training.md lists the keys, megacompile's and the "
                                 "LlamaFactory and transformers/TRL names read as them")
    assert len(str(e.value)) < 300


def test_a_template_name_llamafactory_does_not_have_is_refused_naming_the_closest(tmp_path):
    """LlamaFactory refuses a template it has not registered; a typo is not left to a note."""
    files.model_dir(str(tmp_path / "model"))
    with pytest.raises(ArgumentError, match=r"template 'qwen3_nothnk' is no template LlamaFactory has \(did you mean "
                                            r"'qwen3_nothink'\?\); megacompile renders qwen3, qwen3_nothink"):
        load(_yaml(tmp_path, model_name_or_path="model", template="qwen3_nothnk", max_steps=3))


def test_keys_without_effect_and_the_template_name_are_noted(tmp_path, capsys):
    model = files.model_dir(str(tmp_path / "model"))
    load(_yaml(tmp_path, model_name_or_path="model", template="qwen", stage="sft", do_train=True,
               trust_remote_code=True, overwrite_cache=True, preprocessing_num_workers=16, dataloader_num_workers=4,
               plot_loss=True, save_only_model=False, ddp_timeout=180000000, flash_attn="auto", max_samples=1000,
               max_steps=3, overwrite_output_dir=True))
    out = capsys.readouterr().out
    assert f"template 'qwen' is not read: chats are formatted by the tokenizer's own chat template ({model})" in out
    line = out.split("ignored (no effect in a megacompile run): ")[1].splitlines()[0]
    # save_only_model: false is transformers' default, which asks for nothing and is not named
    assert sorted(line.split(", ")) == ["dataloader_num_workers", "ddp_timeout", "flash_attn", "overwrite_cache",
                                        "overwrite_output_dir (a run_dir holding a run's checkpoints is never "
                                        "overwritten: resume: auto goes on from its latest and a new run there is "
                                        "refused (give it another output_dir))", "trust_remote_code"]


def _without_chat_template(model: str) -> None:
    config = os.path.join(model, "tokenizer_config.json")
    for name in os.listdir(model):
        if name.startswith("chat_template"):
            os.remove(os.path.join(model, name))
    import json
    with open(config) as f:
        settings = json.load(f)
    settings.pop("chat_template", None)
    with open(config, "w") as f:
        json.dump(settings, f)


def test_a_template_needs_the_tokenizers_chat_template(tmp_path):
    _without_chat_template(files.model_dir(str(tmp_path / "model")))
    with pytest.raises(ArgumentError, match="template 'mistral': megacompile formats chats with the tokenizer's own"):
        load(_yaml(tmp_path, model_name_or_path="model", template="mistral", max_steps=3))


def test_template_null_is_no_template_as_leaving_it_out(tmp_path, capsys):
    _without_chat_template(files.model_dir(str(tmp_path / "model")))
    load(_yaml(tmp_path, model_name_or_path="model", template=None, max_steps=3))      # a tokenizer without one
    assert "template" not in capsys.readouterr().out


def test_report_to_takes_a_comma_string_none_and_all(tmp_path):
    assert load(_yaml(tmp_path, steps=2, report_to="tensorboard, csv")).log == ["csv", "tensorboard"]
    assert load(_yaml(tmp_path, steps=2, report_to="none")).log == ["csv"]
    assert load(_yaml(tmp_path, steps=2, log="all")).log == ["csv", "tensorboard", "wandb"]    # the installed ones


def _hf_rates(name: str, lr: float, warmup: int, steps: int, kwargs: dict | None) -> list[float]:
    """The learning rate transformers' scheduler gives each optimizer step 1..steps."""
    import torch
    from transformers import get_scheduler
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = get_scheduler(name, optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                              scheduler_specific_kwargs=kwargs)
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("name, kwargs", [("linear", None), ("cosine", None), ("constant", None),
                                          ("constant_with_warmup", None), ("cosine_with_min_lr", {"min_lr": 3e-5}),
                                          ("cosine_with_min_lr", {"min_lr_rate": 0.1})])
@pytest.mark.parametrize("steps, ratio", [(40, 0.1), (17, 0.3), (9, 0.0)])
def test_a_scheduler_type_and_warmup_ratio_follow_transformers(tmp_path, name, kwargs, steps, ratio):
    """After the warmup, step for step to 1e-12. During the warmup megacompile is one step ahead:
    its step k trains at k/warmup of lr, transformers' at (k-1)/warmup (its first step at 0)."""
    lr = 3e-4
    c = load(_yaml(tmp_path, learning_rate=lr, lr_scheduler_type=name, lr_scheduler_kwargs=kwargs, max_steps=steps,
                   warmup_ratio=ratio))
    warmup = 0 if name == "constant" else math.ceil(steps * ratio)    # transformers' constant has no warmup
    assert c.warmup == warmup
    ours = learning_rate(c.lr, c.schedule, c.warmup, c.min_lr, c.steps)
    hf = _hf_rates(name, lr, math.ceil(steps * ratio), steps, kwargs)
    for step in range(warmup + 1, steps + 1):
        assert abs(ours(step) - hf[step - 1]) < 1e-12, (step, ours(step), hf[step - 1])
    for step in range(1, warmup + 1):
        assert abs(ours(step) - hf[step]) < 1e-12 and hf[0] == 0.0


def test_a_llamafactory_yaml_run_from_its_repositorys_root_reads_the_paths_from_there(tmp_path, monkeypatch, capsys):
    """LlamaFactory's examples sit in examples/train_lora/ and name `data` and its model from the
    root they are run from: what is not beside the run.yaml is read from the working directory;
    what is beside it wins."""
    files.model_dir(str(tmp_path / "tiny"))
    os.makedirs(tmp_path / "data")
    (tmp_path / "data" / "identity.json").write_text(json.dumps([{"instruction": "hello", "output": "hi"}]))
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"identity": {"file_name": "identity.json"}}))
    os.makedirs(tmp_path / "examples" / "train_lora")
    path = files.run_yaml(str(tmp_path / "examples" / "train_lora" / "sft.yaml"), model_name_or_path="tiny",
                          dataset="identity", stage="sft", max_steps=2, device="cpu")
    monkeypatch.chdir(tmp_path)
    c = load(path)
    assert c.model == str(tmp_path / "tiny") and c.data[0]["path"] == str(tmp_path / "data" / "identity.json")
    assert ("model, dataset_dir: not beside sft.yaml but in the working directory, read from there as "
            "LlamaFactory reads its paths") in capsys.readouterr().out
    files.model_dir(str(tmp_path / "examples" / "train_lora" / "tiny"))      # beside the run.yaml: that one
    assert load(path).model == str(tmp_path / "examples" / "train_lora" / "tiny")


def test_the_llamafactory_example_in_the_docs_loads_as_it_is_written(tmp_path, capsys):
    docs = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "training.md")
    with open(docs) as f:
        section = f.read().split("## Coming from LlamaFactory or TRL", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "sft.yaml").write_text(example)
    files.model_dir(str(tmp_path / "meta-llama" / "Meta-Llama-3-8B-Instruct"))
    os.makedirs(tmp_path / "data")
    for name in ("identity", "alpaca_en_demo"):     # LlamaFactory's own two, in their Alpaca layout
        (tmp_path / "data" / f"{name}.json").write_text(json.dumps([{"instruction": "hello", "output": "hi"}]))
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(
        {"identity": {"file_name": "identity.json"}, "alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}}))
    c = load(str(tmp_path / "sft.yaml"))
    assert [e["path"] for e in c.data] == [str(tmp_path / "data" / f"{n}.json") for n in ("identity", "alpaca_en_demo")]
    assert c.max_samples == 1000 and c.finetuning_type == "full"
    assert (c.lr, c.batch, c.grad_accum, c.epochs, c.steps, c.schedule, c.warmup) == \
        (1e-5, 1, 2, 3.0, None, "cosine", 0.1)
    assert (c.seq, c.compute_dtype, c.eval_fraction, c.eval_every, c.save_every, c.log_every, c.log) == \
        (2048, "bfloat16", 0.1, 500, 500, 10, ["csv"])
    assert c.run_dir == str(tmp_path / "saves/llama3-8b/full/sft") and c.resume is None
    out = capsys.readouterr().out
    assert "template 'llama3': chats are written in LlamaFactory's llama3 layout" in out
    assert "deepspeed (megacompile places weights" in out
