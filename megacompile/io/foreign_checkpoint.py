"""What another trainer's checkpoint folder is, when one is given where megacompile's is asked for.

A LlamaFactory or TRL user resumes with `resume_from_checkpoint: saves/run/checkpoint-500`: a
folder transformers' Trainer wrote, not one megacompile saved. A Trainer's own layout (weights,
optimizer.pt), DeepSpeed's ZeRO partitions and FSDP's shards (as Accelerate saves them) are taken
in by engine.load_trainer_checkpoint (io/trainer_checkpoint.py, io/sharded_checkpoint.py), and the
refusal of load_checkpoint names it; so is a torchtune save (io/torchtune_layout.py). A layout
that is not taken in (one whose files are not all there) is named with how its weights start a
new run, the AdamW moments and the learning-rate schedule afresh. Without this, the
folder is refused as a megacompile checkpoint "whose save did not finish", which sends the user
looking for a broken save.
"""
from __future__ import annotations

import glob
import os

from . import dcp_layout, torchtune_layout, zero_layout

# What starting from a folder's weights means, said once for every layout.
_START = ("start a new run from its weights instead (run.yaml `model: {weights}`, or "
          "megacompile.from_pretrained('{weights}', hbm_budget)): the AdamW moments and the learning-rate "
          "schedule then start afresh, and the data from its first row")


def describe(path: str) -> str | None:
    """Why `path` is another trainer's checkpoint and what to do with it, or None when it is not one."""
    if not os.path.isdir(path):
        return None
    has = lambda *names: any(os.path.exists(os.path.join(path, n)) for n in names)   # noqa: E731
    deepspeed = sorted(glob.glob(os.path.join(path, "global_step*")))
    weights_here = has("model.safetensors", "model.safetensors.index.json")   # what from_pretrained reads
    if zero_layout.holds(path):
        return (f"a DeepSpeed checkpoint (its ZeRO partitions are in {os.path.basename(zero_layout.tag_folder(path))}/), "
                f"not one megacompile saved: engine.load_trainer_checkpoint({path!r}) takes in its fp32 masters, AdamW "
                "moments and steps into the same model (run.yaml: `resume` takes it so)"
                + ("; or " + _START.format(weights=path) if weights_here and has("config.json") else ""))
    if deepspeed:
        what = (f"a DeepSpeed checkpoint (its ZeRO partitions are in {os.path.basename(deepspeed[-1])}/), "
                "not one megacompile saved")
        if weights_here and has("config.json"):
            return f"{what}; its optimizer files are not all there: " + _START.format(weights=path)
        return (f"{what}; its optimizer files are not all there: write its fp32 weights with the zero_to_fp32.py "
                f"DeepSpeed leaves in it (python zero_to_fp32.py {path} OUT --safe_serialization), put the "
                "model's config.json beside them, and " + _START.format(weights="OUT"))
    if dcp_layout.holds_whole(path) and not has("optimizer.pt"):
        return ("an FSDP checkpoint gathered whole (FULL_STATE_DICT), not one megacompile saved: "
                f"engine.load_trainer_checkpoint({path!r}) takes in its fp32 masters, AdamW moments and steps into the "
                "same model (run.yaml: `resume` takes it so)")
    if dcp_layout.holds(path):
        return ("an FSDP checkpoint in torch.distributed.checkpoint's sharded layout, not one megacompile saved: "
                f"engine.load_trainer_checkpoint({path!r}) takes in its fp32 masters, AdamW moments and steps into the "
                "same model (run.yaml: `resume` takes it so)")
    if has("pytorch_model_fsdp_0", "optimizer_0"):
        return ("an FSDP checkpoint in torch.distributed.checkpoint's sharded layout, not one megacompile saved; "
                "its optimizer state cannot be taken in: gather its weights into one file (torch's "
                "torch.distributed.checkpoint.format_utils.dcp_to_torch_save), save them as a Hugging Face folder, "
                "and " + _START.format(weights="that folder"))
    if has("trainer_state.json"):
        what = ("a Hugging Face Trainer checkpoint (LlamaFactory's and TRL's checkpoint-N), not one megacompile "
                "saved")
        if weights_here and has("config.json") and has("optimizer.pt"):
            return (f"{what}: engine.load_trainer_checkpoint({path!r}) takes in its weights, AdamW moments and "
                    "steps (run.yaml: `resume` takes it so); or " + _START.format(weights=path))
        if has("adapter_model.safetensors", "adapter_config.json") and has("optimizer.pt"):
            return (f"{what}, of a LoRA run: engine.load_trainer_checkpoint({path!r}) takes in its adapter, AdamW "
                    "moments and steps into a model with the same adapters on its base (run.yaml: `resume` with "
                    "finetuning_type: lora and the adapter's lora_rank, lora_alpha and lora_target takes it so)")
        what += "; its AdamW state (optimizer.pt) cannot be taken in"
        if weights_here and has("config.json"):
            return f"{what}: " + _START.format(weights=path)
        if has("adapter_model.safetensors", "adapter_model.bin"):
            return (f"{what}, and it holds a LoRA adapter only: merge it into its base model (PEFT's "
                    "merge_and_unload, then save_pretrained), and " + _START.format(weights="the merged folder"))
        return f"{what}, nor does it hold the model's weights and config.json to start from"
    if torchtune_layout.holds(path):
        what = (f"a torchtune checkpoint (its optimizer state in {torchtune_layout.recipe_file(path)}), not one "
                "megacompile saved")
        if has(torchtune_layout.ADAPTER):
            return (f"{what}, of a LoRA run: engine.load_trainer_checkpoint({path!r}) takes in its adapters, AdamW "
                    "moments and steps into a model with the same adapters on its base (run.yaml: `resume` with "
                    "finetuning_type: lora and the adapter's lora_rank, lora_alpha and lora_target takes it so); "
                    "or " + _START.format(weights=path) + " (its weights are merged with the adapters)")
        return (f"{what}: engine.load_trainer_checkpoint({path!r}) takes in its weights, AdamW moments and "
                "steps into the same model (run.yaml: `resume` takes it so); or " + _START.format(weights=path))
    if has("recipe_state.pt"):
        return ("a torchtune checkpoint, not one megacompile saved, without the weights of its save (torchtune's "
                "Hugging Face checkpointer writes them beside recipe_state.pt, in epoch_N/); its optimizer state "
                "cannot be taken in without them: " + _START.format(weights="the folder of its model files (with "
                                                                            "their config.json)"))
    return None
