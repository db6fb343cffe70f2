"""DeepSpeed ZeRO checkpoints (tests/data/deepspeed, written by DeepSpeed itself: make.py), taken
in by engine.load_trainer_checkpoint without DeepSpeed installed: the fp32 masters and AdamW
moments are what DeepSpeed gathers from its own partitions, to the bit, for ZeRO 1, 2 and 3, two to
four ranks, bf16 or fp32, sub-groups and padding, LoRA adapters on a frozen base; training goes on as DeepSpeed's went on (losses
to 1e-5, weights to the noise floor of eager float32 against float64 from the same state); a
checkpoint that does not fit is refused with nothing loaded."""
from __future__ import annotations

import importlib.util
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, weight_errors
from megacompile.errors import MegacompileError, WeightsFileError
from megacompile.io import foreign_checkpoint, trainer_checkpoint
from tests.e2e.imported import assert_host_is, refused_untouched

DATA = os.path.join(os.path.dirname(__file__), "..", "data")


def _fixtures(layout: str):
    spec = importlib.util.spec_from_file_location(f"{layout}_fixtures", os.path.join(DATA, layout, "make.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


make, fsdp = _fixtures("deepspeed"), _fixtures("fsdp")
CASES = [f"deepspeed/{name}" for name in make.CASES if not name.startswith(("adam_l2", "sgd_"))] + \
    [f"fsdp/{name}" for name in fsdp.CASES]
FP32 = [case for case in CASES if not (case.startswith("deepspeed/") and make.CASES[case.partition("/")[2]][2])]


def _lora(case: str) -> bool:
    return case.partition("/")[2].startswith("lora_")


def _folder(case: str) -> str:
    return os.path.join(DATA, case)


def _expected(case: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(DATA, f"{case}.expected.safetensors"))


def _model(case: str, seed: int = 1):
    """The case's model with other weights than the trainer's: what it holds after the import is the
    import's. A LoRA case's base is the trainer's own (make.py's seed), its adapters other ones."""
    layout, _, name = case.partition("/")
    torch.manual_seed(0 if _lora(case) else seed)
    tied = layout == "deepspeed" and make.CASES[name][3]
    model = LlamaForCausalLM(LlamaConfig(**make.CONFIG, tie_word_embeddings=tied))
    if _lora(case):
        import peft
        torch.manual_seed(seed)
        model = peft.get_peft_model(model, peft.LoraConfig(**make.LORA))
        torch.nn.init.normal_(model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight)
    return model


def _adamw(**changes) -> megacompile.AdamW:
    settings = dict(lr=make.LR, betas=make.BETAS, eps=make.EPS, weight_decay=make.WD, max_grad_norm=math.inf,
                    no_decay=megacompile.hf_no_decay) | changes
    return megacompile.AdamW(**settings)


def _plus(case: str, model) -> dict[str, float]:
    """A LoRA+ case's ratios (each B, and any trained 1-D parameter, at lr x make.PLUS); none otherwise."""
    if not case.partition("/")[2].startswith("lora_plus"):
        return {}
    return {n: make.PLUS for n, p in model.named_parameters() if p.requires_grad and ("lora_B" in n or p.ndim == 1)}


def _engine(case: str, model=None, **adamw):
    model = model if model is not None else _model(case)
    adamw.setdefault("lr_ratios", _plus(case, model))
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=_adamw(**adamw))


def _batches(expected) -> list[torch.Tensor]:
    return [expected[f"after/ids.{s}"] for s in range(make.SAVED_AT, make.SAVED_AT + make.GOING_ON)]


@pytest.mark.parametrize("case", CASES)
def test_the_masters_and_moments_are_the_trainers_own_to_the_bit(case):
    expected = _expected(case)
    engine = _engine(case)
    trainer_state = engine.load_trainer_checkpoint(_folder(case))
    assert trainer_state["global_step"] == make.SAVED_AT and engine.state.steps_done == make.SAVED_AT
    assert_host_is(engine, expected, _batches(expected)[0])


def _eager(case: str, expected, dtype: torch.dtype) -> tuple[LlamaForCausalLM, list[float]]:
    """The trainer's state going on in eager torch: its masters, and torch AdamW with its moments."""
    model = _model(case).to(dtype)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        for n, p in named:
            p.copy_(expected[f"master/{n}"])
    exempt, plus = set(megacompile.hf_no_decay(model)), _plus(case, model)
    optimizer = torch.optim.AdamW([{"params": [p], "weight_decay": 0.0 if n in exempt else make.WD,
                                    "lr": make.LR * plus.get(n, 1.0)} for n, p in named],
                                  lr=make.LR, betas=make.BETAS, eps=make.EPS)
    for n, p in named:
        optimizer.state[p] = {"step": torch.tensor(float(make.SAVED_AT)),
                              "exp_avg": expected[f"exp_avg/{n}"].to(dtype),
                              "exp_avg_sq": expected[f"exp_avg_sq/{n}"].to(dtype)}
    losses = []
    for ids in _batches(expected):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


@pytest.mark.parametrize("case", FP32)
def test_training_goes_on_as_the_trainers_went_on(case):
    expected = _expected(case)
    reference, eager_losses = _eager(case, expected, torch.float32)
    exact, _ = _eager(case, expected, torch.float64)
    tolerance = max(1e-5, WEIGHT_NOISE_FACTOR * max(weight_errors(exact, reference).values()))
    engine = _engine(case)
    engine.load_trainer_checkpoint(_folder(case))
    losses = [engine.step(input_ids=ids, labels=ids) for ids in _batches(expected)]
    assert losses == pytest.approx(expected["after/losses"].tolist(), rel=1e-5)
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    ours = engine.state_dict()
    theirs = {n: (ours[n] - expected[f"after/{n}"]).abs().max().item() / expected[f"after/{n}"].abs().max().item()
              for n in engine.host.slots}
    assert set(theirs) == {k.partition("/")[2] for k in expected if k.startswith("master/")}
    assert max(theirs.values()) <= tolerance, theirs
    assert max(weight_errors(engine, reference).values()) <= tolerance


@pytest.mark.parametrize("case", ["deepspeed/lora_zero3", "fsdp/lora_checkpoint-3"])
def test_a_lora_runs_checkpoint_goes_into_a_model_with_the_same_adapters_on_the_same_base(case):
    folder = _folder(case)
    refused_untouched(_engine("deepspeed/zero3"), folder, WeightsFileError,
                       r"it froze 21 parameters, this model freezes 0")
    wider = _model("deepspeed/zero3")
    import peft
    wider = peft.get_peft_model(wider, peft.LoraConfig(**make.LORA | {"target_modules": ["q_proj", "k_proj", "v_proj"]}))
    refused_untouched(_engine(case, wider), folder, WeightsFileError,
                       r"it froze 21 parameters, this model freezes 21 \(.*k_proj.*differ\)")


@pytest.mark.parametrize("case", ["deepspeed/checkpoint-3", "fsdp/checkpoint-3", "fsdp/full_checkpoint-3"])
def test_a_trainers_sharded_checkpoint_is_one_a_run_resumes_from(case):
    folder = _folder(case)
    assert trainer_checkpoint.is_trainer_checkpoint(folder)
    assert "load_trainer_checkpoint" in foreign_checkpoint.describe(folder)
    with torch.device("meta"):
        meta = _model(case)
    trainer_checkpoint.check(meta, _adamw(), folder)       # a run's check before anything is written
    with pytest.raises(WeightsFileError, match="not this model's"):
        with torch.device("meta"):
            wider = LlamaForCausalLM(LlamaConfig(**make.CONFIG | {"intermediate_size": 24}))
        trainer_checkpoint.check(wider, _adamw(), folder)


def _copy(tmp_path, case: str) -> str:
    return shutil.copytree(_folder(case), str(tmp_path / case.replace("/", "_")))


def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_is_loaded(tmp_path):
    folder = _copy(tmp_path, "deepspeed/zero3")
    case = "deepspeed/zero3"
    other = LlamaForCausalLM(LlamaConfig(**make.CONFIG | {"num_hidden_layers": 3}))
    refused_untouched(_engine(case, other), folder, WeightsFileError, r"layers\.2\..* are not in it")
    frozen = _model(case)
    frozen.model.embed_tokens.weight.requires_grad_(False)
    refused_untouched(_engine(case, frozen), folder, WeightsFileError, r"froze 0 parameters, this model freezes 1")
    refused_untouched(_engine(case, lr_ratios={"lm_head.weight": 2.0}), folder, MegacompileError,
                       r"ran at learning rates 0\.01, whose ratios are not this engine's AdamW lr_ratios \(2 on 1 ")
    refused_untouched(_engine(case, weight_decay=0.05), folder, MegacompileError,
                       r"weight decay of 16 parameters.*strict=False")
    os.remove(os.path.join(folder, "global_step3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    refused_untouched(_engine(case), folder, WeightsFileError, r"ranks \[0\], the save was made by 2")


def test_an_fsdp_checkpoint_that_does_not_fit_is_refused_and_nothing_is_loaded(tmp_path):
    folder = _copy(tmp_path, "fsdp/checkpoint-3")
    case = "fsdp/checkpoint-3"
    other = LlamaForCausalLM(LlamaConfig(**make.CONFIG | {"intermediate_size": 24}))
    refused_untouched(_engine(case, other), folder, WeightsFileError, r"gate_proj.weight is \(22, 18\)")
    refused_untouched(_engine(case, betas=(0.9, 0.99)), folder, MegacompileError, r"betas: the checkpoint has")
    os.remove(os.path.join(folder, "optimizer_0", "__1_0.distcp"))
    refused_untouched(_engine(case), folder, WeightsFileError, r"cannot read optimizer\.\S+ from .*optimizer_0: "
                       r".*No such file.*__1_0\.distcp'; nothing was loaded")


def test_a_save_split_by_tensor_parallelism_too_is_refused(tmp_path):
    folder = _copy(tmp_path, "deepspeed/zero1")
    shutil.copy(os.path.join(folder, "global_step3", "mp_rank_00_model_states.pt"),
                os.path.join(folder, "global_step3", "mp_rank_01_model_states.pt"))
    refused_untouched(_engine("deepspeed/zero1"), folder, WeightsFileError,
                       "tensor, pipeline or expert parallelism")


def test_adam_with_l2_decay_is_not_taken_for_adamw():
    case = "deepspeed/adam_l2_zero2"
    refused_untouched(_engine(case), _folder(case), MegacompileError,
                       r"its optimizer is Adam with L2 weight decay .*; nothing was loaded")
    engine = _engine(case)
    with pytest.warns(RuntimeWarning, match=r"this engine's are kept: its optimizer is Adam with L2"):
        engine.load_trainer_checkpoint(_folder(case), strict=False)


def test_another_optimizers_state_is_refused():
    case = "deepspeed/sgd_zero2"
    refused_untouched(_engine(case), _folder(case), WeightsFileError,
                       r"its optimizer state is not AdamW's \(it holds momentum_buffer, not exp_avg and exp_avg_sq\)")


def test_other_adamw_settings_load_with_a_warning_when_not_strict():
    engine = _engine("deepspeed/zero2", weight_decay=0.05, betas=(0.9, 0.99))
    with pytest.warns(RuntimeWarning, match=r"betas: the checkpoint has \[0\.9, 0\.95\].*weight decay"):
        engine.load_trainer_checkpoint(_folder("deepspeed/zero2"), strict=False)
    assert engine.state.steps_done == make.SAVED_AT


@pytest.mark.parametrize("case", ["deepspeed/zero2", "deepspeed/zero3"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["whole pieces", "chunks of 7"])
def test_the_partitions_pages_are_given_back_as_each_parameter_is_gathered(monkeypatch, case, chunk):
    """The ranks' files are memory-mapped; every flat a parameter is gathered from has its pages
    given back (io/pages.py) a chunk at a time as it is copied, so neither the partitions nor one
    parameter's share of them are resident beside the host state (chunks of 7 elements cut every
    piece, the last chunk of a piece and of a parameter short)."""
    from megacompile.io import pages, zero_layout
    dropped, largest = set(), []

    def spy(t):
        dropped.add(t.untyped_storage().data_ptr())
        largest.append(t.numel())
        return True
    monkeypatch.setattr(pages, "drop_view", spy)
    if chunk is not None:
        monkeypatch.setattr(zero_layout, "CHUNK", chunk)
    source = zero_layout.Partitions(_folder(case))
    expected = _expected(case)
    for name in source.shapes:
        for table in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(source.tensor(table, name), expected[f"{table}/{name}"])
    flats = {t.untyped_storage().data_ptr() for rank in source.flats for t in rank}
    flats |= {entry[t].untyped_storage().data_ptr() for rank in source.states for entry in rank.values()
              for t in ("exp_avg", "exp_avg_sq")}
    assert flats and flats <= dropped
    assert max(largest) <= (chunk or zero_layout.CHUNK)


def test_the_gathered_fsdp_files_pages_are_given_back_as_each_tensor_is_copied(monkeypatch):
    from megacompile.io import dcp_layout, pages
    dropped = set()
    monkeypatch.setattr(pages, "drop", lambda t: dropped.add(t.untyped_storage().data_ptr()) or True)
    case = "fsdp/full_checkpoint-3"
    source = dcp_layout.Whole(_folder(case))
    expected = _expected(case)
    for name in source.shapes:
        for table in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(source.tensor(table, name), expected[f"{table}/{name}"])
    held = {source.model[n].untyped_storage().data_ptr() for n in source.shapes}
    held |= {source.state[n][t].untyped_storage().data_ptr() for n in source.shapes for t in ("exp_avg", "exp_avg_sq")}
    assert held and held <= dropped


def test_param_groups_at_other_learning_rates_are_named():
    """LoRA+ (or a user's own groups) under DeepSpeed runs its groups at other lrs; this engine runs
    one: refused under strict, never taken silently."""
    from megacompile.io import sharded_checkpoint, zero_layout
    from megacompile.state.training import TrainingState
    case = "deepspeed/zero2"
    source = zero_layout.Partitions(_folder(case))
    source.param_groups[1]["lr"] = 2 * make.LR
    state = TrainingState(_model(case), _adamw(), compute_dtype=torch.float32, grad_accum=1)
    with pytest.raises(MegacompileError, match=r"its param groups ran at 2 learning rates \(0\.01, 0\.02\)"):
        sharded_checkpoint.read(state, source, _folder(case))
    _, _, notes, _ = sharded_checkpoint.read(state, source, _folder(case), strict=False)
    assert "2 learning rates" in notes[0]


def test_loraplus_groups_go_on_at_this_engines_ratio_and_another_ratio_is_named():
    """LlamaFactory's LoRA+ groups under DeepSpeed (each B at lr x 4): taken in by an engine whose
    lr_ratios are the same (the going-on tests above train it on); refused by name under another
    ratio or none, never taken silently."""
    case = "deepspeed/lora_plus_zero2"
    folder = _folder(case)
    model = _model(case)
    other = {n: 2 * r for n, r in _plus(case, model).items()}
    refused_untouched(_engine(case, lr_ratios=other), folder, MegacompileError,
                       r"ran at learning rates 0\.01, 0\.04, whose ratios are not this engine's AdamW lr_ratios \(8 on")
    refused_untouched(_engine(case, lr_ratios={}), folder, MegacompileError,
                       r"its param groups ran at 2 learning rates \(0\.01, 0\.04\).*loraplus_lr_ratio")


@pytest.mark.parametrize("case, stage", [("zero1", 1), ("zero2", 2), ("zero3", 3)])
def test_the_stage_a_refusal_names_is_the_one_deepspeed_wrote(case, stage):
    """ZeRO 1 and 2 share one layout: the messages name the stage the files say, not the layout's."""
    from megacompile.io.zero_layout import Partitions
    assert Partitions(os.path.join(DATA, "deepspeed", case)).named == f"ZeRO stage {stage}"


def test_an_fsdp_folders_metadata_is_read_once_not_once_a_tensor(monkeypatch):
    """torch's loader reads a folder's .metadata again on every call, most of the cost of one tensor's
    read: the import's reader unpickles it once per folder, whatever the count of tensors."""
    from torch.distributed.checkpoint import FileSystemReader
    from megacompile.io import dcp_layout
    read = FileSystemReader.read_metadata
    calls = []
    monkeypatch.setattr(FileSystemReader, "read_metadata", lambda self, *a, **k: calls.append(1) or read(self, *a, **k))
    source = dcp_layout.Shards(_folder("fsdp/checkpoint-3"))
    expected = _expected("fsdp/checkpoint-3")
    for name in source.shapes:
        for table in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(source.tensor(table, name), expected[f"{table}/{name}"])
    assert len(source.shapes) > 10 and len(calls) == 2
