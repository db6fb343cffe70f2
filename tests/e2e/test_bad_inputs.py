"""The bad-input catalogue: every misuse a user can make of compile(), AdamW, plan(), step(),
checkpoints and the command line is answered with megacompile's own error, whose message names
the problem; cases that could change state check that nothing was half-written.

CASES is the catalogue; docs/errors.md holds it as a table, and the last test keeps the two in
step (one row per case, with its error class).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn as nn

import megacompile
from megacompile import cli
from megacompile.errors import ArgumentError, CheckpointError, WeightsFileError
from tests import models

GiB = 2 ** 30
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "errors.md")
CONFIG = {"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64}
DEEPSPEED_ZERO3 = os.path.join(os.path.dirname(__file__), "..", "data", "deepspeed", "zero3")
TINY_TRAIN = ["train", "steps=1", "bundled_model.dim=32", "bundled_model.layers=1", "bundled_model.heads=2",
              "bundled_model.kv_heads=1", "bundled_model.ffn=64", "seq=16", "batch=1", "device=cpu"]


@dataclass
class Case:
    id: str
    error: type
    match: str                      # regex the message must match: it names the problem
    act: Callable                   # act(ctx) does the bad thing


class Context:
    """What the cases share: a folder, a file in it, and one engine that has run a step."""

    def __init__(self, tmp, engine):
        self.tmp, self.engine = tmp, engine
        self.file = os.path.join(tmp, "a_file")
        with open(self.file, "w") as f:
            f.write("not a folder")
        self.config = os.path.join(tmp, "config.json")
        with open(self.config, "w") as f:
            json.dump(CONFIG, f)
        self.hf_trainer = _trainer_checkpoint(tmp, "trainer_state.json", "config.json", "model.safetensors",
                                              "optimizer.pt")
        self.deepspeed = _trainer_checkpoint(tmp, "trainer_state.json", "global_step500/x_optim_states.pt")

    def cli(self, *argv):
        """The command line's way of failing: exit status 2 and one line, no traceback."""
        code = cli.main([str(a) for a in argv])
        if code != 2:
            raise AssertionError(f"megacompile {' '.join(map(str, argv))} exited {code}, not 2")


def _tiny():
    return models.NanoGPT(vocab=96, d=32, layers=2)


IDS = models.batch(96, 2, 16)


def _meta_engine():
    with torch.device("meta"):
        model = _tiny()
    return megacompile.compile(model, 1.0, device="cpu")


def _partial_load(c):
    engine = _meta_engine()
    engine.load_state_dict(_tiny().state_dict(), strict=False)
    engine.load_state_dict({k: v for k, v in _tiny().state_dict().items() if k != "transformer.ln_f.bias"})


def _with_param_groups():
    """torch's usual groups: biases and norms at weight decay 0, here at half the lr too."""
    model = _tiny()
    flat = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": [p for p in model.parameters() if p.ndim >= 2], "weight_decay": 0.1},
                             {"params": flat, "weight_decay": 0.0, "lr": 5e-4}], lr=1e-3)
    megacompile.compile(model, 1.0, device="cpu", optimizer=opt)


def _compile(**kw):
    return lambda c: megacompile.compile(_tiny(), **{"hbm_budget": 1.0, "device": "cpu", **kw})


def _plan(*args, **kw):
    return lambda c: megacompile.plan(*(args or (CONFIG,)), **{"hbm_budget": 1.0, "seq": 16, "hardware": "h100",
                                                              **kw})


def _step(**inputs):
    return lambda c: c.engine.step(**inputs)


def _causal_lm_step(**inputs):
    """A step of a transformers causal LM (the labels checks are its), refused before capture."""
    return lambda c: megacompile.compile(models.hf_llama(layers=1, d=32), 1.0, device="cpu").step(**inputs)


def _under_inference_mode(c):
    with torch.inference_mode():
        c.engine.step(idx=IDS, targets=IDS)


def _trainer_checkpoint(tmp, *files: str) -> str:
    """A folder laid out as another trainer writes its checkpoints (the files' contents do not matter:
    the layout alone says what it is)."""
    folder = os.path.join(tmp, "checkpoint-" + "-".join(f.split("/")[0] for f in files))
    for name in files:
        os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
        with open(os.path.join(folder, name), "w") as f:
            f.write("{}")
    return folder


def _train(*flags):
    return lambda c: c.cli(*TINY_TRAIN, *flags, f"run_dir={os.path.join(c.tmp, 'run')}")


def _cli_plan(*flags):
    return lambda c: c.cli("plan", "--config", c.config, *flags)


def _save(path_of):
    return lambda c: c.engine.save_checkpoint(path_of(c))


CASES = [
    # compile()
    Case("compile: hbm_budget=inf", ArgumentError, r"hbm_budget.*finite.*inf", _compile(hbm_budget=float("inf"))),
    Case("compile: hbm_budget=nan", ArgumentError, r"hbm_budget.*nan", _compile(hbm_budget=float("nan"))),
    Case("compile: hbm_budget=True", ArgumentError, r"hbm_budget.*not a bool.*True", _compile(hbm_budget=True)),
    Case("compile: hbm_budget='8'", ArgumentError, r"hbm_budget.*'8'", _compile(hbm_budget="8")),
    Case("compile: hbm_budget=0", ArgumentError, r"hbm_budget.*positive", _compile(hbm_budget=0)),
    Case("compile: host_budget=inf", ArgumentError, r"host_budget.*inf", _compile(host_budget=float("inf"))),
    Case("compile: device='gpu'", ArgumentError, r"device must be 'cuda'.*'gpu'", _compile(device="gpu")),
    Case("compile: device=0", ArgumentError, r"device must be.*got 0", _compile(device=0)),
    Case("compile: device='mps'", ArgumentError, r"device must be.*'mps'", _compile(device="mps")),
    Case("compile: share_device=a module", ArgumentError, r"share_device takes the Engine.*got NanoGPT",
         lambda c: megacompile.compile(_tiny(), 1.0, device="cpu", share_device=_tiny())),
    Case("compile: share_device with another hbm_budget", ArgumentError, r"the device's budget is 1.00 GiB.*got 2.00 GiB",
         lambda c: megacompile.compile(_tiny(), 2.0, device="cpu", share_device=c.engine)),
    Case("compile: share_frozen=True without share_device", ArgumentError, r"share_frozen.*without share_device",
         _compile(share_frozen=True)),
    Case("compile: optimizer=torch.optim.AdamW", ArgumentError, r"megacompile\.AdamW\(lr=0\.001",
         lambda c: megacompile.compile(_tiny(), 1.0, device="cpu",
                                       optimizer=torch.optim.AdamW(nn.Linear(2, 2).parameters()))),
    Case("compile: optimizer=torch.optim.AdamW of two param groups", ArgumentError,
         r"2 param groups \(group 0: .*weight_decay 0.1.*group 1: .*lr 0.0005, weight_decay 0.0.*\) are, exactly, "
         r"megacompile\.AdamW\(lr=0\.001, .*weight_decay=0\.1, no_decay=megacompile\.hf_no_decay, lr_ratios=\{.*0\.5",
         lambda c: _with_param_groups()),
    Case("compile: optimizer='adamw'", ArgumentError, r"megacompile\.AdamW.*str", _compile(optimizer="adamw")),
    Case("compile: compute_dtype=float16", ArgumentError, r"compute_dtype.*float16",
         _compile(compute_dtype=torch.float16)),
    Case("compile: grad_accum=0", ArgumentError, r"grad_accum.*>= 1.*0", _compile(grad_accum=0)),
    Case("compile: grad_accum=True", ArgumentError, r"grad_accum.*True", _compile(grad_accum=True)),
    Case("compile: updates='eager'", ArgumentError,
         r"updates says when each owner's host AdamW update starts.*got 'eager'", _compile(updates="eager")),
    Case("compile: updates='as_gradients_land' with grad_accum=2", ArgumentError,
         r"updates='as_gradients_land' needs grad_accum=1.*got grad_accum=2",
         _compile(updates="as_gradients_land", grad_accum=2)),
    Case("compile: updates='as_gradients_land' with max_grad_norm", ArgumentError,
         r"updates='as_gradients_land' cannot clip gradients.*max_grad_norm=None",
         _compile(updates="as_gradients_land", optimizer=megacompile.AdamW(max_grad_norm=1.0))),
    Case("compile: loss_fn=3", ArgumentError, r"loss_fn must be a function", _compile(loss_fn=3)),
    Case("compile: retrace='no'", ArgumentError, r"retrace must be True or False", _compile(retrace="no")),
    Case("compile: fuse='yes'", ArgumentError, r"fuse must be True or False", _compile(fuse="yes")),
    Case("compile: dump_dir is a file", ArgumentError, r"dump_dir .* is a file",
         lambda c: megacompile.compile(_tiny(), 1.0, device="cpu", dump_dir=c.file)),
    Case("compile: not a module", megacompile.MegacompileError, r"nn\.Module, got str",
         lambda c: megacompile.compile("llama", 1.0)),
    Case("compile: no parameters", megacompile.MegacompileError, r"no parameters",
         lambda c: megacompile.compile(nn.ReLU(), 1.0, device="cpu")),
    # AdamW
    Case("AdamW: betas=(0.9,)", megacompile.OptimizerInputError, r"betas must be two numbers",
         lambda c: megacompile.AdamW(betas=(0.9,))),
    Case("AdamW: betas=(0.9, 1.5)", megacompile.OptimizerInputError, r"betas.*\[0, 1\)",
         lambda c: megacompile.AdamW(betas=(0.9, 1.5))),
    Case("AdamW: lr='1e-3'", megacompile.OptimizerInputError, r"lr must be a number in \[0, 1\].*'1e-3'",
         lambda c: megacompile.AdamW(lr="1e-3")),
    Case("AdamW: lr=True", megacompile.OptimizerInputError, r"lr .*True", lambda c: megacompile.AdamW(lr=True)),
    Case("AdamW: lr=nan", megacompile.OptimizerInputError, r"lr .*nan", lambda c: megacompile.AdamW(lr=float("nan"))),
    Case("AdamW: eps='x'", megacompile.OptimizerInputError, r"eps must be", lambda c: megacompile.AdamW(eps="x")),
    Case("AdamW: lr=1e30", megacompile.OptimizerInputError, r"lr must be a number in \[0, 1\].*1e\+30",
         lambda c: megacompile.AdamW(lr=1e30)),
    Case("AdamW: eps=inf", megacompile.OptimizerInputError, r"eps must be a number in \(0, 1\)",
         lambda c: megacompile.AdamW(eps=float("inf"))),
    Case("AdamW: lr * weight_decay >= 1", megacompile.OptimizerInputError, r"lr \* weight_decay < 1",
         lambda c: megacompile.AdamW(lr=0.5, weight_decay=4.0)),
    Case("AdamW: weight_decay=nan", megacompile.OptimizerInputError, r"weight_decay.*nan",
         lambda c: megacompile.AdamW(weight_decay=float("nan"))),
    Case("AdamW: max_grad_norm=0", megacompile.OptimizerInputError, r"max_grad_norm.*got 0",
         lambda c: megacompile.AdamW(max_grad_norm=0)),
    Case("AdamW: kernel='cuda'", megacompile.OptimizerInputError, r"kernel must be 'fused' or 'torch'",
         lambda c: megacompile.AdamW(kernel="cuda")),
    Case("AdamW: no_decay='bias'", megacompile.OptimizerInputError, r"no_decay takes parameter names .*got 'bias'",
         lambda c: megacompile.AdamW(no_decay="bias")),
    Case("compile: AdamW no_decay names no parameter", megacompile.OptimizerInputError,
         r"no_decay names 1 of 1 that are no parameter.*'ln_f.weight' is 'transformer.ln_f.weight'",
         _compile(optimizer=megacompile.AdamW(no_decay=["ln_f.weight"]))),
    # megacompile.plan
    Case("plan: hbm_budget=nan", ArgumentError, r"hbm_budget.*nan", _plan(hbm_budget=float("nan"))),
    Case("plan: hbm_budget=inf", ArgumentError, r"hbm_budget.*inf", _plan(hbm_budget=float("inf"))),
    Case("plan: hbm_budget=-1", ArgumentError, r"hbm_budget.*positive.*-1", _plan(hbm_budget=-1)),
    Case("plan: host_budget=nan", ArgumentError, r"host_budget.*nan", _plan(host_budget=float("nan"))),
    Case("plan: seq=-1", ArgumentError, r"seq .*>= 1.*-1", _plan(seq=-1)),
    Case("plan: batch=0", ArgumentError, r"batch .*>= 1.*0", _plan(batch=0)),
    Case("plan: seq=2**40", ArgumentError, r"tokens in one step", _plan(seq=2 ** 40)),
    Case("plan: batch=2**40", ArgumentError, r"tokens in one step", _plan(batch=2 ** 40)),
    Case("plan: seq=16.5", ArgumentError, r"seq .*16\.5", _plan(seq=16.5)),
    Case("plan: unknown model_type", ArgumentError, r"model_type 'nosuch' is unknown", _plan({**CONFIG, "model_type": "nosuch"})),
    Case("plan: no model_type", ArgumentError, r"no model_type",
         _plan({k: v for k, v in CONFIG.items() if k != "model_type"})),
    Case("plan: heads do not divide hidden", ArgumentError, r"hidden size \(32\).*attention heads \(5\)",
         _plan({**CONFIG, "num_attention_heads": 5, "num_key_value_heads": 5})),
    Case("plan: kv heads do not divide heads", ArgumentError, r"num_key_value_heads 3 does not divide",
         _plan({**CONFIG, "num_key_value_heads": 3})),
    Case("plan: config file missing", megacompile.MegacompileError, r"cannot read the model config",
         lambda c: megacompile.plan(os.path.join(c.tmp, "nosuch.json"), 1.0)),
    Case("plan: config is not JSON", megacompile.MegacompileError, r"cannot read the model config",
         lambda c: megacompile.plan(c.file, 1.0)),
    Case("plan: config of another type", ArgumentError, r"config path, dict or PretrainedConfig, got int",
         _plan(42)),
    Case("plan: unknown hardware", megacompile.MegacompileError, r"unknown hardware 'tpu'", _plan(hardware="tpu")),
    Case("plan: hardware=5", ArgumentError, r"hardware must be", _plan(hardware=5)),
    Case("plan: style='deepspeed'", ArgumentError, r"style must be one of megatrain, zero3", _plan(style="deepspeed")),
    Case("plan: global_batch=-4", ArgumentError, r"global_batch.*-4",
         lambda c: megacompile.planner.from_config.plan_global_batch(CONFIG, 1.0, -4, seq=16)),
    Case("plan: fuse='yes'", ArgumentError, r"fuse must be True or False", _plan(fuse="yes")),
    Case("plan: accumulation='rows'", ArgumentError, r"accumulation must be one of micro, layer, auto; got 'rows'",
         _plan(accumulation="rows")),
    Case("plan: updates='as_gradients_land' with max_grad_norm", ArgumentError,
         r"updates='as_gradients_land' cannot clip gradients",
         _plan(updates="as_gradients_land", optimizer=megacompile.AdamW(max_grad_norm=1.0))),
    Case("minimum_budget: style='zero3'", ArgumentError, r"minimum_budget takes plan\(\)'s arguments.*got style",
         lambda c: megacompile.minimum_budget(CONFIG, seq=16, style="zero3")),
    # step() inputs, checked before anything runs
    Case("step: token id >= vocab", megacompile.InputMismatchError, r"idx holds token id 2\d\d.*vocabulary of 96",
         _step(idx=IDS + 200, targets=IDS)),
    Case("step: negative token id", megacompile.InputMismatchError, r"idx holds token id -\d+",
         _step(idx=IDS - 100, targets=IDS)),
    Case("step: label >= vocab", megacompile.InputMismatchError, r"targets holds token id 1\d\d",
         _step(idx=IDS, targets=IDS + 100)),
    Case("step: label -5 (not an ignore index)", megacompile.InputMismatchError, r"targets holds token id -5",
         _step(idx=IDS, targets=torch.where(IDS > 50, -5, IDS))),
    Case("step: float token ids", megacompile.InputMismatchError, r"integer token ids, got float32",
         _step(idx=IDS.float(), targets=IDS)),
    Case("step: longer than learned positions", megacompile.InputMismatchError, r"40 tokens.*32 learned positions",
         _step(idx=models.batch(96, 2, 40), targets=models.batch(96, 2, 40))),
    Case("step: empty batch", megacompile.InputMismatchError, r"no elements", _step(idx=IDS[:0], targets=IDS[:0])),
    Case("step: inputs on meta", megacompile.InputMismatchError, r"is on meta",
         _step(idx=IDS.to("meta"), targets=IDS.to("meta"))),
    Case("step: causal LM labels of another shape than input_ids", megacompile.InputMismatchError,
         r"labels has shape \(2, 15\) and input_ids \(2, 16\)", _causal_lm_step(input_ids=IDS, labels=IDS[:, :15])),
    Case("step: causal LM int32 labels", megacompile.InputMismatchError, r"got int32; pass labels\.long\(\)",
         _causal_lm_step(input_ids=IDS, labels=IDS.int())),
    Case("step: no tensor inputs", megacompile.CaptureError, r"hold no tensor",
         lambda c: megacompile.compile(_tiny(), 1.0, device="cpu").step()),
    Case("step: under torch.inference_mode()", megacompile.MegacompileError, r"inference_mode",
         _under_inference_mode),
    # checkpoints
    Case("save_checkpoint: a folder of other files", CheckpointError, r"folder of other files, not a checkpoint",
         _save(lambda c: c.tmp)),
    Case("save_checkpoint: path under a file", CheckpointError, r"lies under the file .*a_file",
         _save(lambda c: os.path.join(c.file, "ck.pt"))),
    Case("save_checkpoint: a meta model before its weights", megacompile.MegacompileError,
         r"no weights for .*load them .*before saving", lambda c: _meta_engine().save_checkpoint(os.path.join(c.tmp, "x"))),
    Case("save_pretrained: merge_adapter=True on a model without adapters", ArgumentError,
         r"merge_adapter=True merges a PEFT model's LoRA adapter.*carries none",
         lambda c: c.engine.save_pretrained(os.path.join(c.tmp, "merged"), merge_adapter=True)),
    Case("load_state_dict: a part with strict=True, after a whole load", megacompile.MegacompileError,
         r"missing \['transformer.ln_f.bias'\].*nothing was loaded.*strict=False\) for each part", _partial_load),
    Case("load_state_dict: unknown name with strict=True", megacompile.MegacompileError, r"unexpected \['nope'\]",
         lambda c: _meta_engine().load_state_dict({"nope": torch.zeros(1)})),
    Case("load_checkpoint: a Hugging Face Trainer checkpoint", WeightsFileError,
         r"it is a Hugging Face Trainer checkpoint .*engine.load_trainer_checkpoint\('.*checkpoint-trainer_state.json"
         r".*'\) takes in its weights, AdamW moments and steps .*; or start a new run from its weights",
         lambda c: c.engine.load_checkpoint(c.hf_trainer)),
    Case("load_trainer_checkpoint: no global_step", WeightsFileError,
         r"trainer_state.json: global_step is None, not a count of steps",
         lambda c: c.engine.load_trainer_checkpoint(c.hf_trainer)),
    Case("load_trainer_checkpoint: a DeepSpeed checkpoint without its optimizer files", WeightsFileError,
         r"cannot take in the Trainer checkpoint .*: a DeepSpeed checkpoint \(its ZeRO partitions are in "
         r"global_step500/\).*its optimizer files are not all there.*; nothing was loaded",
         lambda c: c.engine.load_trainer_checkpoint(c.deepspeed)),
    Case("load_trainer_checkpoint: a DeepSpeed checkpoint of another model", WeightsFileError,
         r"cannot take in the DeepSpeed checkpoint .*zero3: its trained parameters are not this model's: "
         r"model.embed_tokens.weight is no parameter of this model.*; nothing was loaded",
         lambda c: c.engine.load_trainer_checkpoint(DEEPSPEED_ZERO3)),
    Case("cli train resume=<a DeepSpeed checkpoint without its optimizer files>", SystemExit,
         r"it is a DeepSpeed checkpoint \(its ZeRO partitions are in global_step500/\).*not all there.*zero_to_fp32.py",
         lambda c: _train(f"resume={c.deepspeed}")(c)),
    Case("cli train adapter=<folder> without finetuning_type lora", SystemExit,
         r"adapter: .* is a LoRA adapter to go on training, which needs finetuning_type: lora",
         lambda c: _train(f"adapter={c.tmp}")(c)),
    Case("load_checkpoint: not a checkpoint", WeightsFileError, r"cannot load the checkpoint .*a_file: it is a file, not a checkpoint",
         lambda c: c.engine.load_checkpoint(c.file)),
    # the command line: exit status 2, one line naming the problem
    Case("cli plan --hbm-budget nan", SystemExit, r"hbm_budget.*nan",
         _cli_plan("--hbm-budget", "nan")),
    Case("cli plan --hbm-budget -1", SystemExit, r"hbm_budget.*-1",
         _cli_plan("--hbm-budget", "-1")),
    Case("cli plan --updates as_gradients_land --global-batch 8", SystemExit,
         r"--updates as_gradients_land needs one micro-batch per step: give --batch, not --global-batch",
         _cli_plan("--hbm-budget", "1", "--updates", "as_gradients_land", "--global-batch", "8")),
    Case("cli plan --global-batch -4", SystemExit, r"global_batch.*-4",
         _cli_plan("--hbm-budget", "1", "--global-batch", "-4")),
    Case("cli plan --global-batch 0", SystemExit, r"global_batch.*got 0", _cli_plan("--hbm-budget", "1", "--global-batch", "0")),
    Case("cli plan --seq 0", SystemExit, r"seq .*0",
         _cli_plan("--hbm-budget", "1", "--seq", "0")),
    Case("cli plan --host-budget nan", SystemExit, r"host_budget.*nan",
         _cli_plan("--hbm-budget", "1", "--host-budget", "nan")),
    Case("cli plan --config missing", SystemExit, r"cannot read the model config",
         lambda c: c.cli("plan", "--config", os.path.join(c.tmp, "none.json"), "--hbm-budget", "1")),
    Case("cli train steps=0", SystemExit, r"steps must be a whole number >= 1; got 0", _train("steps=0")),
    Case("cli train batch=0", SystemExit, r"batch must be", _train("batch=0")),
    Case("cli train seq=0", SystemExit, r"seq must be a whole number >= 2; got 0", _train("seq=0")),
    Case("cli train unknown key", SystemExit, r"unknown key lr_max; docs/training.md lists the keys", _train("lr_max=1")),
    Case("cli train override without =", SystemExit, r"overrides are key=value", _train("steps")),
    Case("cli train --config missing", SystemExit, r"cannot read the run config",
         lambda c: c.cli("train", "--config", os.path.join(c.tmp, "none.yaml"))),
    Case("cli train log_every=0", SystemExit, r"log_every", _train("log_every=0")),
    Case("cli train lr=nan", SystemExit, r"lr must be a number >= 0; got nan", _train("lr=nan")),
    Case("cli train lr=1e30", SystemExit, r"lr 1e\+30 is not a learning rate AdamW can train with.*at most 1",
         _train("lr=1e30")),
    Case("cli train eps=inf", SystemExit, r"eps must be a number > 0 and < 1; got inf", _train("eps=inf")),
    Case("cli train lr * weight_decay >= 1", SystemExit, r"give lr \* weight_decay < 1",
         _train("lr=0.5", "weight_decay=2")),
    Case("cli train stop_signals=[SIGKILL]", SystemExit, r"stop_signals: SIGKILL cannot be caught",
         _train("stop_signals=[SIGKILL]")),
    Case("cli train hbm_budget=inf", SystemExit, r"hbm_budget.*inf", _train("hbm_budget=inf")),
    Case("cli train budget_fraction=0", SystemExit, r"budget_fraction must be a number > 0",
         _train("budget_fraction=0")),
    Case("cli train heads do not divide dim", SystemExit, r"heads 4 must split dim 30",
         _train("bundled_model.dim=30", "bundled_model.heads=4")),
    Case("cli train odd head size", SystemExit, r"heads 2 must split dim 30 into an even head size",
         _train("bundled_model.dim=30", "bundled_model.heads=2")),
    Case("cli train kv heads do not divide heads", SystemExit, r"kv_heads 3 must divide heads 2",
         _train("bundled_model.kv_heads=3")),
    Case("cli train run_dir is a file", SystemExit, r"run_dir .*a_file is a file",
         lambda c: c.cli(*TINY_TRAIN, f"run_dir={c.file}")),
    Case("cli calibrate --out under a file", SystemExit, r"--out .*lies under the file",
         lambda c: c.cli("calibrate", "--device", "cpu", "--out", os.path.join(c.file, "profile.json"))),
]


@pytest.fixture(scope="module")
def context(tmp_path_factory):
    engine = megacompile.compile(_tiny(), 1.0, device="cpu")
    engine.step(idx=IDS, targets=IDS)
    yield Context(str(tmp_path_factory.mktemp("bad-inputs")), engine)
    engine.close()


def _snapshot(ctx: Context) -> tuple:
    """The engine's state and the folder's files: what a refused call must leave as it was."""
    files = sorted((root, tuple(sorted(names))) for root, _, names in os.walk(ctx.tmp))
    return ctx.engine.state_dict(), ctx.engine.steps_done, ctx.engine.micro_batches, files


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_gets_the_projects_error(case, context, capsys):
    before = _snapshot(context)
    if case.error is SystemExit:    # the command line prints the project's error and exits 2
        case.act(context)
        err = capsys.readouterr().err
        assert err.startswith("megacompile: error: ") and "Traceback" not in err, err
        assert re.search(case.match, err), err
    else:
        with pytest.raises(case.error) as info:
            case.act(context)
        assert isinstance(info.value, megacompile.MegacompileError), type(info.value)
        assert re.search(case.match, str(info.value)), str(info.value)
    state, steps, micro, files = _snapshot(context)
    assert (steps, micro) == before[1:3], "a refused call counted a step"
    assert files == before[3], "a refused call wrote files"
    for name, value in before[0].items():
        assert torch.equal(state[name], value), f"{name} changed by a refused call"


def test_the_catalogue_is_in_the_docs():
    """docs/errors.md has one row per case, with the error class the case raises."""
    with open(DOC) as f:
        rows = [line.split("|")[1:-1] for line in f if line.startswith("| ")]
    documented = {cells[0].strip().strip("`"): cells[1].strip().strip("`") for cells in rows if len(cells) >= 4}
    expected = {c.id: ("exit 2" if c.error is SystemExit else c.error.__name__) for c in CASES}
    assert {k: documented.get(k) for k in expected} == expected


def test_labels_may_hold_the_ignore_index():
    """-100 (torch's and Hugging Face's ignore_index) is not refused as outside the vocabulary."""
    model = models.hf_llama(layers=1, d=32)
    engine = megacompile.compile(model, 1.0, device="cpu")
    labels = IDS.clone()
    labels[:, :4] = -100
    expected = model(input_ids=IDS, labels=labels).loss.item()
    assert engine.step(input_ids=IDS, labels=labels) == pytest.approx(expected, rel=1e-5)
    engine.close()


def test_int32_input_ids_train_as_in_eager_transformers():
    """int32 token ids are taken (the embedding reads them as eager transformers does); only
    labels, which cross_entropy takes as int64 alone, are refused in another integer dtype."""
    model = models.hf_llama(layers=1, d=32)
    engine = megacompile.compile(model, 1.0, device="cpu")
    expected = model(input_ids=IDS.int(), labels=IDS).loss.item()
    assert engine.step(input_ids=IDS.int(), labels=IDS) == pytest.approx(expected, rel=1e-5)
    engine.close()


def test_labels_of_another_shape_are_a_causal_lms_refusal_only():
    """A sequence classifier's labels are one per row: not refused by the causal LM's check."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from megacompile.arguments import InputLimits
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=3)
    rows = torch.tensor([0, 2])
    InputLimits(LlamaForSequenceClassification(config)).check((), {"input_ids": IDS, "labels": rows}, "cpu")
    with pytest.raises(megacompile.InputMismatchError, match=r"labels has shape \(2,\) and input_ids \(2, 16\)"):
        InputLimits(models.hf_llama(layers=1, d=32)).check((), {"input_ids": IDS, "labels": rows}, "cpu")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_save_into_a_read_only_folder(context, tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    with pytest.raises(CheckpointError, match=r"ro/ck\.pt.*[Pp]ermission denied"):
        context.engine.save_checkpoint(str(folder / "ck.pt"))
    assert os.listdir(folder) == []


@pytest.mark.parametrize("failure", ["disk full", "permission denied"])
def test_a_failed_write_keeps_the_previous_checkpoint(failure, context, tmp_path, monkeypatch):
    """The safetensors writer fails halfway: CheckpointError names the path and the cause, no
    temporary folder is left, and the checkpoint already at that path is byte for byte the one
    written before."""
    import safetensors.torch
    path = str(tmp_path / "ck")
    context.engine.save_checkpoint(path)
    previous = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}

    def failing_save(tensors, target, metadata=None):
        with open(target, "wb") as f:
            f.write(b"half a file")
        if failure == "disk full":
            raise OSError(28, "No space left on device", target)
        raise PermissionError(13, "Permission denied", target)

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    cause = r"disk is full" if failure == "disk full" else r"Permission denied"
    with pytest.raises(CheckpointError, match=rf"{re.escape(path)}: .*{cause}.*previous checkpoint there is untouched"):
        context.engine.save_checkpoint(path)
    assert os.listdir(tmp_path) == ["ck"]
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == previous
    assert isinstance(CheckpointError("x"), OSError)
