"""Another trainer's checkpoint folder, given where megacompile's is asked for, is named for what it
is, with the way to go on from its weights (io/foreign_checkpoint.py); megacompile's own folders
and model folders are left to the checks that read them."""
import os

import pytest

from megacompile.errors import WeightsFileError
from megacompile.io import checkpoint_path
from megacompile.io.checkpoint import verified_manifest
from megacompile.io.foreign_checkpoint import describe


def _folder(tmp_path, name, *files):
    folder = tmp_path / name
    for f in files:
        (folder / f).parent.mkdir(parents=True, exist_ok=True)
        (folder / f).write_text("{}")
    return str(folder)


@pytest.mark.parametrize("files, says", [
    (("trainer_state.json", "config.json", "model.safetensors", "optimizer.pt", "scheduler.pt"),
     ["Hugging Face Trainer checkpoint", "engine.load_trainer_checkpoint('{path}') takes in its weights, AdamW",
      "`model: {path}`", "from_pretrained('{path}'"]),
    (("trainer_state.json", "config.json", "model.safetensors.index.json", "optimizer.pt"),
     ["Hugging Face Trainer checkpoint", "load_trainer_checkpoint", "`model: {path}`"]),
    (("trainer_state.json", "config.json", "model.safetensors"),
     ["Hugging Face Trainer checkpoint", "its AdamW state (optimizer.pt) cannot be taken in", "`model: {path}`"]),
    (("trainer_state.json", "adapter_model.safetensors", "adapter_config.json", "optimizer.pt"),
     ["of a LoRA run: engine.load_trainer_checkpoint('{path}') takes in its adapter", "finetuning_type: lora"]),
    (("trainer_state.json", "adapter_model.safetensors", "adapter_config.json"),
     ["LoRA adapter only", "merge_and_unload", "the merged folder"]),
    (("trainer_state.json", "optimizer.pt"), ["nor does it hold the model's weights"]),
    (("trainer_state.json", "config.json", "global_step80/mp_rank_00_model_states.pt", "zero_to_fp32.py"),
     ["DeepSpeed checkpoint", "global_step80/", "optimizer files are not all there", "zero_to_fp32.py {path} OUT",
      "`model: OUT`"]),
    (("config.json", "model.safetensors", "global_step80/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
     ["DeepSpeed checkpoint", "engine.load_trainer_checkpoint('{path}') takes in its fp32 masters", "`model: {path}`"]),
    (("trainer_state.json", "global_step80/zero_pp_rank_0_mp_rank_00_optim_states.pt"),
     ["DeepSpeed checkpoint", "engine.load_trainer_checkpoint('{path}') takes in its fp32 masters", "`resume`"]),
    (("trainer_state.json", "pytorch_model_fsdp_0/__0_0.distcp", "optimizer_0/__0_0.distcp"),
     ["FSDP checkpoint", "dcp_to_torch_save"]),
    (("trainer_state.json", "pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata"),
     ["FSDP checkpoint", "engine.load_trainer_checkpoint('{path}') takes in its fp32 masters", "`resume`"]),
    (("trainer_state.json", "pytorch_model_fsdp.bin", "optimizer.bin"),
     ["FSDP checkpoint gathered whole", "engine.load_trainer_checkpoint('{path}') takes in its fp32 masters"]),
    (("recipe_state.pt", "model-00001-of-00001.safetensors"), ["torchtune checkpoint", "without the weights of its save",
                                                              "recipe_state.pt"]),
    (("recipe_state.pt", "config.json", "model.safetensors"),
     ["a torchtune checkpoint (its optimizer state in {path}/recipe_state.pt)",
      "engine.load_trainer_checkpoint('{path}') takes in its weights, AdamW moments and steps", "`model: {path}`"]),
    (("recipe_state.pt", "config.json", "model.safetensors", "adapter_model.pt", "adapter_config.json"),
     ["a torchtune checkpoint", "of a LoRA run: engine.load_trainer_checkpoint('{path}') takes in its adapters",
      "finetuning_type: lora", "its weights are merged with the adapters"]),
])
def test_each_layout_is_named_with_the_way_to_its_weights(tmp_path, files, says):
    path = _folder(tmp_path, "checkpoint-80", *files)
    why = describe(path)
    assert why is not None
    for words in says:
        assert words.format(path=path) in why, why
    error = checkpoint_path.refusal(path)          # engine.load_checkpoint reads the path through this one
    assert isinstance(error, WeightsFileError) and why in str(error) and "nothing was loaded" in str(error)
    with pytest.raises(WeightsFileError) as info:
        verified_manifest(path)          # the run's `resume:` reads the folder through this one
    assert why in str(info.value)


def test_a_model_folder_an_empty_one_and_a_file_are_no_other_trainers_checkpoints(tmp_path):
    model = _folder(tmp_path, "model", "config.json", "model.safetensors", "tokenizer.json")
    assert describe(model) is None
    assert "Hugging Face model folder" in str(checkpoint_path.refusal(model))
    assert describe(_folder(tmp_path, "empty", "notes.txt")) is None
    assert describe(os.path.join(tmp_path, "nothing-here")) is None
    assert describe(_folder(tmp_path, "f", "a_file") + "/a_file") is None


def test_a_committed_megacompile_checkpoint_is_read_as_one_whatever_else_lies_in_it(tmp_path):
    """A checkpoint of ours saved into a folder that also holds a trainer_state.json is still ours."""
    path = _folder(tmp_path, "ours", "trainer_state.json", "COMMITTED", "manifest.json")
    assert checkpoint_path.refusal(path) is None
    with pytest.raises(WeightsFileError) as info:
        verified_manifest(path)
    assert "Trainer" not in str(info.value)
