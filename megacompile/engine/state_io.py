"""The engine's training state in and out of files and tensors: state_dict, its own checkpoints,
transformers' Trainer checkpoints, PEFT adapters, and the Hugging Face export.

Each method hands the TrainingState (never the engine) to io/ or distributed/, which do the work;
Engine takes these methods from StateIO.
"""
from __future__ import annotations

import warnings
from collections import OrderedDict
from typing import Any

import torch

from ..errors import MegacompileError
from ..io import hf_save, lora_adapter, lora_save, state_dict, trainer_checkpoint, trainer_export, unbuilt
from ..state import TrainingState


class StateIO:
    """Reading and writing an engine's training state (`self.state`), through its checkpoint
    writer (`self._checkpoints`: one process's, or each rank's share) and, under data parallelism,
    `self.data_parallel`."""
    state: TrainingState
    data_parallel: Any
    _checkpoints: Any

    def state_dict(self) -> "OrderedDict[str, torch.Tensor]":
        """float32 masters (and buffers) under the model's own names, tied names included: the
        trained ones, or before the first step the ones it will start from (a checkpoint or weights
        loaded, else the model's own). Refused after a step that left part of itself applied."""
        self.state.refuse_partial("state_dict()")
        return OrderedDict((key, t.clone()) for key, t in self._state_tensors())

    def _state_tensors(self):
        """(state_dict key, tensor), one at a time and not copied (io/unbuilt.py)."""
        return unbuilt.state_tensors(self.state)

    def load_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True):
        """Load weights into the masters, whole (strict=True: the dict holds every trainable weight
        and no key that names nothing of the model) or one part (a shard) at a time with
        strict=False, which skips keys that name nothing of the model. Every name, shape, dtype and
        value of a call is checked before it writes anything. Returns torch's
        `_IncompatibleKeys(missing_keys, unexpected_keys)` (io/state_dict.py). A model built on meta
        trains once its parts are complete (its first step names what is missing)."""
        return state_dict.load(self.state, state, strict=strict)

    def save_checkpoint(self, path: str, *, extra: Any = None, keep_last: int | None = None,
                        keep: tuple[str, ...] = (), side_files: dict[str, str] | None = None) -> None:
        """Write a checkpoint folder at `path`: masters, AdamW moments, counters, optimizer settings,
        LR-schedule state (attached torch schedulers too), random states and `extra` (JSON: e.g.
        the data loader's position). Returns once it is durable; a checkpoint already at `path` is
        replaced only then (until the new one is committed, the old one stays loadable). keep_last=N
        keeps this run's N latest committed checkpoints in the same parent folder (the one just
        written always among them) and removes its older ones; checkpoints of other runs there are
        never touched (a run is this engine, or the run it resumed with load_checkpoint). `keep`:
        checkpoints that stay whatever their age (a run's best), counted among the keep_last.
        `side_files`: name -> text of small files written into the folder before it is committed
        (a run's trainer_state.json), which no load reads. With data parallelism each rank writes
        its share (distributed/checkpoint.py)."""
        self.state.refuse_partial("save_checkpoint()")
        self._checkpoints.save(self.state, path, extra=extra, keep_last=keep_last, keep=tuple(keep),
                               side_files=side_files)

    def load_checkpoint(self, path: str, *, strict: bool = True) -> Any:
        """Resume from a checkpoint folder (no prepare() needed): training continues exactly where
        the saved run left off. Every file, name, shape, checksum and manifest field is checked
        before any state changes. strict=True (the default): a checkpoint whose optimizer settings
        or grad_accum differ from this engine's, or whose buffers differ from those the model built
        itself (rotary inv_freq from another rope_theta), is refused, naming each difference.
        strict=False loads it keeping this engine's settings and the model's own buffers, with a
        warning naming them. Returns the `extra` state it was saved with."""
        extra = self._checkpoints.load(self.state, path, strict=strict)
        return extra

    def load_trainer_checkpoint(self, path: str, *, strict: bool = True, file_key=None) -> dict:
        """Go on from a checkpoint transformers' Trainer saved (LlamaFactory's and TRL's `checkpoint-N`:
        its weights, optimizer.pt's AdamW moments and step counts, trainer_state.json's global_step as
        this engine's steps done, so a schedule of the step goes on where the Trainer's was). Every
        index of the optimizer's state is matched to its parameter by the Trainer's param groups and
        checked by shape before any state changes (io/trainer_checkpoint.py). strict=True refuses
        other AdamW betas, eps or weight decays than this engine's; strict=False keeps this engine's,
        with a warning. file_key: a state_dict key's name in the checkpoint's files, where the module
        wraps the Trainer's model (as compile_folder's). A folder with DeepSpeed ZeRO's partitions in
        place of optimizer.pt (a Trainer's under DeepSpeed, or DeepSpeed's own save) is taken in the
        same way, its fp32 masters gathered from them (io/deepspeed_checkpoint.py). Returns
        trainer_state.json ({"global_step": ...} for DeepSpeed's own save)."""
        if self.data_parallel is not None:
            raise MegacompileError("load_trainer_checkpoint runs in one process: take the checkpoint in there, "
                                   "save_checkpoint, and load that one on every rank")
        load, counters, notes, trainer_state = trainer_checkpoint.read(self.state, str(path), strict, file_key)
        self.state.restore(load, counters)
        for note in notes:
            warnings.warn(note, RuntimeWarning, stacklevel=2)
        return trainer_state

    def load_adapter(self, path: str) -> None:
        """Start the model's LoRA adapters from the PEFT adapter folder `path` (adapter_config.json,
        adapter_model.safetensors; LlamaFactory's adapter_name_or_path): its tensors into the
        adapters' masters, its config held to the model's adapters (rank, alpha, targets), the AdamW
        state untouched (io/lora_adapter.py)."""
        lora_adapter.load(self.state, str(path))

    def save_trainer_checkpoint(self, path: str, *, batch_size: int, logging_steps: int = 500, eval_steps: int = 500,
                                save_steps: int = 500) -> None:
        """Write a checkpoint transformers' Trainer resumes from (`checkpoint-N`:
        Trainer.train(resume_from_checkpoint=path), LlamaFactory's and TRL's resume_from_checkpoint):
        the fp32 masters as a Hugging Face model folder, optimizer.pt with the AdamW moments and step
        counts in the Trainer's param groups, scheduler.pt and trainer_state.json at this engine's steps
        (io/trainer_export.py); batch_size: the rows of each micro-batch the Trainer runs (its
        per_device_train_batch_size); logging_steps, eval_steps, save_steps: the intervals the Trainer
        goes on with (it reads them from the checkpoint, not its arguments; its defaults here). Needs
        AdamW(no_decay=megacompile.hf_no_decay), the Trainer's groups."""
        self.state.refuse_partial("save_trainer_checkpoint()")
        if self.data_parallel is not None:
            raise MegacompileError("save_trainer_checkpoint runs in one process: save_checkpoint, load it in one "
                                   "process, and write the Trainer checkpoint there")
        trainer_export.save(self.state, path, batch_size,
                            {"logging_steps": logging_steps, "eval_steps": eval_steps, "save_steps": save_steps})

    def save_pretrained(self, path: str, *, dtype: torch.dtype = torch.float32,
                        max_shard_size: int | str = "5GB", overwrite: bool = False,
                        merge_adapter: bool = False) -> None:
        """Export the masters as a Hugging Face model folder (sharded safetensors, index, config,
        and the tokenizer and generation files of the folder from_pretrained read), streamed one
        tensor at a time in `dtype`; AutoModelForCausalLM.from_pretrained loads it.

        A PEFT model (get_peft_model's, with one LoRA adapter) is written as PEFT writes it: the
        adapter (adapter_config.json, adapter_model.safetensors, the trained fp32 masters in float32
        whatever `dtype`, and the tokenizer files of the folder it came from), which
        PeftModel.from_pretrained(base, path) loads on the base model; with merge_adapter=True,
        the base model with the adapter merged in `dtype`, which AutoModelForCausalLM.from_pretrained
        loads (io/lora_save.py). Neither changes the engine's state or the model. merge_adapter on
        a model without adapters is refused, and so is a PEFT model under data parallelism.

        Only the export's own files are written; anything else in the folder (README.md, LICENSE,
        .gitattributes, .git/, your files) is never touched, with or without overwrite. A folder
        holding files this export would replace (weights, index, config, the tokenizer and
        generation files it writes, an adapter) or weights of another export is refused, naming
        them, unless overwrite=True: then they are replaced, and the previous export's weights that
        the new one does not have (shards of another count, a single file) are removed. The new
        files are staged in the folder and swapped in once complete: a failed or killed export
        leaves the previous one as it was (io/hf_save.py)."""
        self.state.refuse_partial("save_pretrained()")
        carries = lora_save.carries_adapters(self.state)
        lora_save.check_merge_adapter(merge_adapter, carries)
        if carries:
            if self.data_parallel is not None:
                raise MegacompileError(
                    "save_pretrained of a PEFT model runs in one process: save_checkpoint on every rank, "
                    "load_checkpoint into an engine of the same PEFT model in one process, and save_pretrained there")
            return lora_save.save(self.state, path, merge=merge_adapter, dtype=dtype, overwrite=overwrite,
                                  max_shard_size=max_shard_size)
        if self.data_parallel is not None:    # rank 0 writes, the masters gathered
            return self.data_parallel.on_rank_zero(self.state.host_or_error(), lambda: hf_save.save_pretrained(
                self.state, path, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite))
        hf_save.save_pretrained(self.state, path, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
