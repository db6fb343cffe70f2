"""A torchtune checkpoint read back by parameter: the weights its Hugging Face checkpointer wrote,
AdamW's moments from recipe_state.pt under torchtune's names, each turned into the Hugging Face
parameter it trains (torchtune_names.py).

    output_dir/epoch_N/ (or step_N/)      an intermediate save of FullModelHFCheckpointer
        config.json, model-*.safetensors (and their index) or model.safetensors
        adapter_model.pt, adapter_config.json, ...   a LoRA run's: its adapters under torchtune's
                                           names (and in PEFT's format, beside), the weights
                                           above merged
        recipe_state.pt                    torchtune after 0.6: {"optimizer": torch's state_dict,
                                           "steps_run", "epochs_run", "seed", ...}
    output_dir/recipe_state/recipe_state.pt     torchtune 0.6: the same without steps_run, one
                                           file for the run, overwritten at each save

The optimizer state is keyed by parameter name where torchtune gathered it with torch's
get_optimizer_state_dict (its distributed recipes; every recipe after 0.6), by index where a
single-device recipe saved optimizer.state_dict(): the index of each parameter in the order
torchtune's decoder registers them (torchtune_names.order), frozen ones included (a LoRA run gives
AdamW every parameter; those without a gradient have no state).

A full run's masters are the weights it wrote; a LoRA run's adapters come from adapter_model.pt,
torchtune's own tensors, rather than from its PEFT file: torchtune 0.6 permutes the PEFT file's
q and k lora_B rows for every family, Qwen2's too, whose weights it does not permute. torchtune's
recipes give AdamW every parameter in one group, every one decayed, and train in the model's dtype
(bf16 by default: no fp32 masters, the moments bf16 too); the masters then start from the bf16
parameters. The other families torchtune maps (Gemma 2's extra norms, Phi-3's fused projections, Llama 4,
the vision models) and DoRA are not read: the refusal names how to start from their weights.
"""
from __future__ import annotations

import os
import re

import torch

from ..errors import WeightsFileError
from . import pages
from .saved_dict import json_object, torch_dict
from . import torchtune_names as names
from .hf_layout import INDEX, SINGLE

RECIPE_STATE = "recipe_state.pt"
ADAPTER = "adapter_model.pt"       # a LoRA run's adapters as torchtune holds them (its names, its rows)
_MOMENTS = ("exp_avg", "exp_avg_sq")


def recipe_file(path: str) -> str | None:
    """The recipe_state.pt of the torchtune save `path` (module docstring), or None."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "config.json"))
            and any(os.path.isfile(os.path.join(path, f)) for f in (INDEX, SINGLE))):
        return None
    for file in (os.path.join(path, RECIPE_STATE),
                 os.path.join(os.path.dirname(os.path.abspath(path)), "recipe_state", RECIPE_STATE)):
        if os.path.isfile(file):
            return file
    return None


def holds(path: str) -> bool:
    """Whether `path` is a torchtune save this module reads (module docstring)."""
    return recipe_file(path) is not None


class Recipe:
    """The torchtune save `path` as sharded_checkpoint.py's source: its trained parameters under
    their Hugging Face names (a LoRA run's adapters under the PEFT model's), each master read from
    the weights (adapter_model.pt), each moment from recipe_state.pt."""

    def __init__(self, path: str):
        self.path, self.describe = path, f"the torchtune checkpoint {path}"
        self.file = recipe_file(path)
        if self.file is None:
            raise WeightsFileError(f"{path} holds no torchtune checkpoint (config.json, the model's safetensors and "
                                   f"{RECIPE_STATE}); nothing was loaded")
        self._config = config = json_object(os.path.join(path, "config.json"))
        self.family = config.get("model_type")
        if self.family not in names.FAMILIES:
            raise WeightsFileError(f"cannot take in {self.describe}: its model is {self.family!r}; torchtune's names "
                                   f"are read for {', '.join(names.FAMILIES)}; start a new run from its weights "
                                   "(run.yaml `model:` the folder); nothing was loaded")
        heads = config["num_attention_heads"]
        self._heads = {"q_proj": heads, "k_proj": config.get("num_key_value_heads") or heads}
        self._head_dim = config.get("head_dim") or config["hidden_size"] // heads
        self._weights = _weight_files(path)
        adapter = os.path.join(path, ADAPTER)
        self._adapters = torch_dict(adapter) if os.path.isfile(adapter) else {}
        recipe = torch_dict(self.file, "torchtune's recipe state")
        optimizer = recipe.get("optimizer")
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) \
                or not isinstance(optimizer.get("param_groups"), list) or not optimizer["param_groups"]:
            raise WeightsFileError(f"cannot take in {self.describe}: {self.file} holds no optimizer state_dict (a "
                                   "run with optimizer_in_bwd saves one per parameter, which is not read); start a "
                                   "new run from its weights; nothing was loaded")
        self._check_epoch(recipe)
        by_key = self._tune_names(optimizer)
        self.state = {by_key[key]: entry for key, entry in optimizer["state"].items()}
        odd = sorted(n for n, entry in self.state.items() if not set(_MOMENTS) <= set(entry))
        if odd:
            raise WeightsFileError(f"cannot take in {self.describe}: the optimizer state of {odd[0]} is not AdamW's "
                                   "(exp_avg and exp_avg_sq); start a new run from its weights; nothing was loaded")
        if any(g.get("amsgrad") for g in optimizer["param_groups"]):
            raise WeightsFileError(f"{self.describe} was written by AdamW with amsgrad=True, which megacompile's "
                                   "AdamW does not run; nothing was loaded")
        self._tune = {}         # a trained parameter's Hugging Face name -> torchtune's
        self.shapes = {}
        for name in self.state:
            hf = names.to_hf(name, self.family)
            if hf is None or (name not in self._adapters and hf not in self._weights):
                raise WeightsFileError(f"cannot take in {self.describe}: its trained parameter {name} is none of the "
                                       f"weights it wrote ({'a DoRA magnitude, ' if 'magnitude' in name else ''}or a "
                                       "model torchtune names otherwise); start a new run from its weights; nothing "
                                       "was loaded")
            self._tune[hf] = name
            self.shapes[hf] = tuple(self._adapters[name].shape) if name in self._adapters else self._weights[hf][1]
            for table in _MOMENTS:
                if tuple(self.state[name][table].shape) != self.shapes[hf]:
                    raise WeightsFileError(f"cannot take in {self.describe}: the {table} of {name} is "
                                           f"{tuple(self.state[name][table].shape)}, its weight {hf} is "
                                           f"{self.shapes[hf]}; nothing was loaded")
        # the frozen parameters are not named here: a LoRA run's base is this model's own (its `model` folder)
        self.frozen = None if self._adapters else {}
        self.param_groups = [g | {"params": [names.to_hf(by_key[k], self.family) for k in g["params"]]}
                             for g in optimizer["param_groups"]]
        self.first_group = self.param_groups[0]
        steps = recipe.get("steps_run")
        taken = max((int(entry.get("step", 0)) for entry in self.state.values()), default=0)
        self.global_steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else taken

    def _tune_names(self, optimizer: dict) -> dict:
        """Each key of the optimizer state (and of its param groups) -> torchtune's parameter name."""
        keys = [k for g in optimizer["param_groups"] for k in g.get("params", ())]
        if all(isinstance(k, str) for k in keys):
            return {k: k for k in keys}
        if sorted(keys) != list(range(len(keys))):
            raise WeightsFileError(f"cannot take in {self.describe}: its optimizer numbers the parameters "
                                   f"{keys[:6]}..., not 0 to {len(keys) - 1}; nothing was loaded")
        order = sorted(self._tune_parameters(), key=lambda n: names.order(n, self.family))
        if len(order) != len(keys):
            raise WeightsFileError(f"cannot take in {self.describe}: its optimizer holds {len(keys)} parameters, the "
                                   f"model it wrote has {len(order)} (a model torchtune builds otherwise, or adapters "
                                   "it did not write); start a new run from its weights; nothing was loaded")
        return dict(enumerate(order))

    def _tune_parameters(self) -> list[str]:
        """torchtune's names of its model's parameters: the weights it wrote (an lm_head it wrote
        beside tied embeddings, as for Qwen3, is none of them) and a LoRA run's adapters."""
        tied = bool(self._config.get("tie_word_embeddings"))
        model = [names.from_hf(hf, self.family) or hf for hf in self._weights if not (tied and hf == "lm_head.weight")]
        return model + [n for n in self._adapters if ".lora_a." in n or ".lora_b." in n]

    def _check_epoch(self, recipe: dict) -> None:
        """torchtune 0.6's recipe_state.pt, beside the epoch folders, is the last save's: it goes on
        from epoch_N only where that save was N's (its epochs_run N + 1)."""
        if os.path.dirname(self.file) == os.path.abspath(self.path):
            return
        found = re.fullmatch(r"epoch_(\d+)", os.path.basename(os.path.abspath(self.path)))
        ran = recipe.get("epochs_run")
        if found is None or ran != int(found.group(1)) + 1:
            raise WeightsFileError(f"cannot take in {self.describe}: {self.file} is the state of the save after "
                                   f"{ran} epochs, not of this folder's: torchtune keeps the last save's alone; go on "
                                   f"from epoch_{(ran or 1) - 1}, or start a new run from these weights; nothing "
                                   "was loaded")

    def step(self, name: str) -> int | None:
        entry = self.state.get(self._tune[name])
        return None if entry is None or "step" not in entry else int(entry["step"])

    def weight_decay(self, name: str) -> float:
        return self._group(name)["weight_decay"]

    def lr(self, name: str) -> float | None:
        return self._group(name).get("lr")

    def _group(self, name: str) -> dict:
        group = next((g for g in self.param_groups if name in g["params"]), None)
        if group is None:
            raise WeightsFileError(f"{self.describe}: no param group of its optimizer names {name}; nothing was loaded")
        return group

    def tensor(self, table: str, name: str) -> torch.Tensor:
        """The fp32 `table` of the parameter `name` (a Hugging Face name), in Hugging Face's rows."""
        tune = self._tune[name]
        if table == "master" and tune not in self._adapters:
            from safetensors import safe_open
            with safe_open(self._weights[name][0], framework="pt") as f:
                return f.get_tensor(name).float()
        source = self._adapters[tune] if table == "master" else self.state[tune][table]
        out = names.permute(name, source.float().clone(), self.family, self._heads, self._head_dim)
        pages.drop(source)
        return out


def _weight_files(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each weight the folder's safetensors hold -> (its file, its shape), from the headers."""
    from safetensors import safe_open
    index = os.path.join(path, INDEX)
    files = sorted(set(json_object(index)["weight_map"].values())) if os.path.isfile(index) else [SINGLE]
    out = {}
    for file in files:
        full = os.path.join(path, file)
        try:
            with safe_open(full, framework="pt") as f:
                for key in f.keys():
                    out[key] = (full, tuple(f.get_slice(key).get_shape()))
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it
            raise WeightsFileError(f"cannot read {full}: {e}; nothing was loaded") from e
    return out
