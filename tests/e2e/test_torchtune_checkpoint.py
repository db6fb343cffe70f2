"""torchtune checkpoints (tests/data/torchtune, written by torchtune itself: make.py), taken in by
engine.load_trainer_checkpoint without torchtune installed: the weights and AdamW moments are what
torchtune's own tune_to_hf makes of its state, to the bit, whether its optimizer state is keyed by
index (torchtune 0.6's single-device recipes, its recipe_state.pt beside the epoch folders) or by
name (its distributed recipes and later releases, recipe_state.pt in the epoch folder), for a
Llama and a Gemma (whose q_proj and k_proj rows torchtune permutes; the Gemma's heads wider than
hidden / heads) and a Qwen2 with biases and tied embeddings, full runs and LoRA runs (the
adapters onto the model's own base); training goes on as torchtune's went on (losses to 1e-5,
weights to the noise floor of eager float32 against float64 from the same state); what does not
fit is refused with nothing loaded."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import megacompile
from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, weight_errors
from megacompile.errors import MegacompileError, WeightsFileError
from megacompile.io import foreign_checkpoint, torchtune_layout, trainer_checkpoint
from tests.e2e.imported import assert_host_is, refused_untouched

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "torchtune")
_spec = importlib.util.spec_from_file_location("torchtune_fixtures", os.path.join(DATA, "make.py"))
make = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make)


def _folder(case: str) -> str:
    return os.path.join(DATA, case, "epoch_0")


def _expected(case: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(DATA, f"{case}.expected.safetensors"))


# torchtune's LoRA modules -> PEFT's target_modules
PEFT_TARGETS = {"q_proj": ["q_proj"], "k_proj": ["k_proj"], "v_proj": ["v_proj"],
                "mlp": ["gate_proj", "up_proj", "down_proj"]}


def _lora_config(case: str, **changes):
    import peft
    modules, mlp = make.LORA[case]
    targets = [t for m in modules + ["mlp"] * mlp for t in PEFT_TARGETS[m]]
    return peft.LoraConfig(**dict(r=make.RANK, lora_alpha=make.ALPHA, lora_dropout=0.0, target_modules=targets)
                           | changes)


def _model(case: str, seed: int = 1, lora: dict | None = None, **sizes):
    """The case's model with other weights than torchtune's: what it holds after the import is the
    import's. A LoRA case's base is torchtune's own (make.py's seed), its adapters other ones."""
    torch.manual_seed(0 if case in make.LORA else seed)
    if case.endswith("gemma2"):
        from transformers import Gemma2Config, Gemma2ForCausalLM
        model = Gemma2ForCausalLM(Gemma2Config(**make.GEMMA2 | sizes))
    elif case.endswith("gemma"):
        from transformers import GemmaConfig, GemmaForCausalLM
        model = GemmaForCausalLM(GemmaConfig(**make.GEMMA | sizes))
    elif case.endswith("qwen2"):
        model = Qwen2ForCausalLM(Qwen2Config(**make.QWEN2 | sizes))
    else:
        model = LlamaForCausalLM(LlamaConfig(**make.ds.CONFIG | sizes))
    if case in make.LORA:
        import peft
        torch.manual_seed(seed)
        model = peft.get_peft_model(model, _lora_config(case, **(lora or {})))
        for p in model.parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p)
    return model


def _adamw(**changes) -> megacompile.AdamW:
    """torchtune's AdamW: one param group, every parameter decayed."""
    return megacompile.AdamW(**dict(lr=make.LR, betas=make.BETAS, eps=make.EPS, weight_decay=make.WD,
                                    max_grad_norm=math.inf) | changes)


def _engine(case: str, model=None, **adamw):
    model = model if model is not None else _model(case)
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=_adamw(**adamw))


def _batches(expected) -> list[torch.Tensor]:
    return [expected[f"after/ids.{s}"] for s in range(make.SAVED_AT, make.SAVED_AT + make.GOING_ON)]


@pytest.mark.parametrize("case", make.CASES)
def test_the_weights_and_moments_are_torchtunes_own_to_the_bit(case):
    expected = _expected(case)
    engine = _engine(case)
    engine.load_trainer_checkpoint(_folder(case))
    assert engine.state.steps_done == make.SAVED_AT
    assert_host_is(engine, expected, _batches(expected)[0])


def _eager(case: str, expected, dtype: torch.dtype, losses: list | None = None):
    """torchtune's state going on in eager torch: its weights, and torch AdamW with its moments;
    `losses`, a list given, gets each step's."""
    model = _model(case).to(dtype)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for n, p in trained:
            p.copy_(expected[f"master/{n}"])
    optimizer = torch.optim.AdamW([p for _, p in trained], lr=make.LR, betas=make.BETAS, eps=make.EPS,
                                  weight_decay=make.WD)
    for n, p in trained:
        optimizer.state[p] = {"step": torch.tensor(float(make.SAVED_AT)),
                              "exp_avg": expected[f"exp_avg/{n}"].to(dtype),
                              "exp_avg_sq": expected[f"exp_avg_sq/{n}"].to(dtype)}
    for ids in _batches(expected):
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if losses is not None:
            losses.append(loss.item())
    return model


# Cases whose torchtune model computes otherwise than transformers' at the same weights: Gemma 2's
# losses differ by 8e-5 of themselves (measured at the imported state); the run is held to
# transformers' there, and to torchtune's at this tolerance.
OWN_MODEL = {"gemma2": 1e-3}


@pytest.mark.parametrize("case", [c if c in ("llama", "fqn_lora_qwen2") else pytest.param(c, marks=pytest.mark.slow)
                                  for c in make.CASES])
def test_training_goes_on_as_torchtunes_went_on(case):
    expected, eager_losses = _expected(case), []
    reference = _eager(case, expected, torch.float32, eager_losses)
    exact = _eager(case, expected, torch.float64)
    tolerance = max(1e-5, WEIGHT_NOISE_FACTOR * max(weight_errors(exact, reference).values()))
    engine = _engine(case)
    engine.load_trainer_checkpoint(_folder(case))
    losses = [engine.step(input_ids=ids, labels=ids) for ids in _batches(expected)]
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    assert losses == pytest.approx(expected["after/losses"].tolist(), rel=OWN_MODEL.get(case, 1e-5))
    if case in OWN_MODEL:       # their weights went on from their own gradients
        assert max(weight_errors(engine, reference).values()) <= tolerance
        return
    ours = engine.state_dict()
    theirs = {n: (ours[n] - expected[f"after/{n}"]).abs().max().item() / expected[f"after/{n}"].abs().max().item()
              for n in engine.host.slots}
    assert max(theirs.values()) <= tolerance, theirs
    assert max(weight_errors(engine, reference).values()) <= tolerance


@pytest.mark.parametrize("case", ["llama", "fqn_qwen2"])
def test_a_torchtune_save_is_one_a_run_resumes_from(case):
    folder = _folder(case)
    assert trainer_checkpoint.is_trainer_checkpoint(folder)
    assert trainer_checkpoint.named(folder) == "the torchtune checkpoint"
    why = foreign_checkpoint.describe(folder)
    assert "a torchtune checkpoint" in why and f"load_trainer_checkpoint({folder!r})" in why
    with torch.device("meta"):
        meta = _model(case)
    trainer_checkpoint.check(meta, _adamw(), folder)       # a run's check before anything is written
    with pytest.raises(WeightsFileError, match=r"gate_proj.weight is \(22, \d+\), this model's"):
        with torch.device("meta"):
            wider = _model(case, intermediate_size=24)
        trainer_checkpoint.check(wider, _adamw(), folder)


def _copy(tmp_path, case: str) -> str:
    return shutil.copytree(os.path.join(DATA, case), str(tmp_path / case))


def _edit_recipe(file: str, edit) -> None:
    saved = torch.load(file, weights_only=True)
    edit(saved)
    torch.save(saved, file)


def test_the_recipe_state_of_another_epoch_is_refused(tmp_path):
    root = _copy(tmp_path, "llama")
    later = os.path.join(root, "epoch_1")
    shutil.copytree(os.path.join(root, "epoch_0"), later)
    refused_untouched(_engine("llama"), later, WeightsFileError,
                       r"recipe_state\.pt is the state of the save after 1 epochs, not of this folder's: .*go on from "
                       r"epoch_0")


def test_what_torchtune_saved_otherwise_is_refused_and_nothing_is_loaded(tmp_path):
    folder = os.path.join(_copy(tmp_path, "fqn_llama"), "epoch_0")
    recipe = os.path.join(folder, torchtune_layout.RECIPE_STATE)
    engine = _engine("fqn_llama")
    refused_untouched(_engine("fqn_llama", betas=(0.9, 0.99)), folder, MegacompileError, r"betas: the checkpoint has")
    refused_untouched(_engine("fqn_llama", _model("fqn_llama", num_hidden_layers=3)), folder, WeightsFileError, r"layers\.2\..* are not in it")

    def lora(saved):        # a LoRA run's adapter among the trained parameters
        name = "layers.0.attn.q_proj.lora_a.weight"
        saved["optimizer"]["state"][name] = saved["optimizer"]["state"]["layers.0.attn.q_proj.weight"]
        saved["optimizer"]["param_groups"][0]["params"].append(name)
    _edit_recipe(recipe, lora)
    refused_untouched(engine, folder, WeightsFileError, r"lora_a\.weight is none of the weights it wrote")

    def sgd(saved):
        saved["optimizer"]["state"] = {n: {"momentum_buffer": e["exp_avg"]}
                                       for n, e in saved["optimizer"]["state"].items() if "lora" not in n}
        saved["optimizer"]["param_groups"][0]["params"].pop()
    _edit_recipe(recipe, sgd)
    refused_untouched(engine, folder, WeightsFileError, r"is not AdamW's \(exp_avg and exp_avg_sq\)")
    _edit_recipe(recipe, lambda saved: saved.pop("optimizer"))
    refused_untouched(engine, folder, WeightsFileError, r"holds no optimizer state_dict .*optimizer_in_bwd")


def test_an_index_keyed_state_of_another_model_and_another_family_are_refused(tmp_path):
    root = _copy(tmp_path, "llama")
    folder = os.path.join(root, "epoch_0")
    _edit_recipe(os.path.join(root, "recipe_state", torchtune_layout.RECIPE_STATE),
                 lambda saved: saved["optimizer"]["param_groups"][0]["params"].append(21))
    refused_untouched(_engine("llama"), folder, WeightsFileError,
                       r"its optimizer holds 22 parameters, the model it wrote has 21")
    config = os.path.join(folder, "config.json")
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('"model_type": "llama"', '"model_type": "phi3"'))
    refused_untouched(_engine("llama"), folder, WeightsFileError,
                       r"its model is 'phi3'; torchtune's names are read for llama, mistral, gemma, gemma2, qwen2, qwen3; start a "
                       r"new "
                       r"run from its weights")


def test_torchtunes_decay_of_every_parameter_is_named_where_this_engine_exempts_some():
    engine = _engine("fqn_llama", no_decay=megacompile.hf_no_decay)
    refused_untouched(engine, _folder("fqn_llama"), MegacompileError,
                       r"the weight decay of 5 parameters: model\.layers\.0\.input_layernorm\.weight 0\.1 \(this "
                       r"engine 0\.0\).*strict=False")
    with pytest.warns(RuntimeWarning, match="this engine's are kept"):
        engine.load_trainer_checkpoint(_folder("fqn_llama"), strict=False)
    assert engine.state.steps_done == make.SAVED_AT


def test_a_lora_runs_checkpoint_goes_into_a_model_with_the_same_adapters_on_the_same_base():
    folder = _folder("lora_llama")
    refused_untouched(_engine("llama"), folder, WeightsFileError,
                       r"holds a LoRA adapter \(rank 4, alpha 8.0, on down_proj, gate_proj, k_proj, q_proj, up_proj, "
                       r"v_proj\) and this model has none")
    refused_untouched(_engine("lora_llama", _model("lora_llama", lora={"lora_alpha": 16})), folder,
                       WeightsFileError, r"not this model's: lora_alpha 8.0 \(this model 16; run.yaml lora_alpha\)")
    fewer = _model("lora_llama", lora={"target_modules": ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]})
    refused_untouched(_engine("lora_llama", fewer), folder, WeightsFileError, r"target_modules")


def test_a_dora_runs_magnitudes_are_refused(tmp_path):
    folder = os.path.join(_copy(tmp_path, "fqn_lora_qwen2"), "epoch_0")

    def dora(saved):
        name = "layers.0.attn.q_proj.magnitude"
        saved["optimizer"]["state"][name] = {"step": torch.tensor(3.0), "exp_avg": torch.zeros(16),
                                             "exp_avg_sq": torch.zeros(16)}
        saved["optimizer"]["param_groups"][0]["params"].append(name)
    _edit_recipe(os.path.join(folder, torchtune_layout.RECIPE_STATE), dora)
    refused_untouched(_engine("fqn_lora_qwen2"), folder, WeightsFileError,
                       r"its trained parameter layers\.0\.attn\.q_proj\.magnitude is none of the weights it wrote "
                       r"\(a DoRA magnitude")
