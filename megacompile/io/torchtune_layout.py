"""A torchtune checkpoint read back by parameter: the weights its Hugging Face checkpointer wrote,
AdamW's moments from recipe_state.pt under torchtune's names, each turned into the Hugging Face
parameter it trains.

    output_dir/epoch_N/ (or step_N/)      an intermediate save of FullModelHFCheckpointer
        config.json, model-*.safetensors (and their index) or model.safetensors
        recipe_state.pt                    torchtune after 0.6: {"optimizer": torch's state_dict,
                                           "steps_run", "epochs_run", "seed", ...}
    output_dir/recipe_state/recipe_state.pt     torchtune 0.6: the same without steps_run, one
                                           file for the run, overwritten at each save

The optimizer state is keyed by parameter name where torchtune gathered it with torch's
get_optimizer_state_dict (its distributed recipes; every recipe after 0.6), by index where a
single-device recipe saved optimizer.state_dict(): the index of each parameter in the order
torchtune's decoder registers them (_ORDER). torchtune's names are its modules' (tok_embeddings,
layers.N.attn.q_proj, mlp.w1, sa_norm.scale, ...): _LAYER maps them to the Hugging Face names its
checkpointer writes, as its convert_weights does. For Llama and Mistral, torchtune's
rotary embedding pairs a head's features (0, 1), (2, 3), ... where Hugging Face's pairs the
halves, so its checkpointer permutes the rows of q_proj and k_proj as it writes them (_permute);
a moment is elementwise, so each q_proj and k_proj moment is permuted the same way. Qwen2 and
Qwen3 use Hugging Face's rotary layout in torchtune too: nothing is permuted.

torchtune's recipes give AdamW every parameter in one group, every one decayed, and train in the
model's dtype (bf16 by default: no fp32 masters, the moments bf16 too); the weights written are
then the parameters themselves, and the masters start from them. The other families torchtune
maps (Gemma's norms, Phi-3's fused projections, Llama 4, the vision models) and a LoRA run's
adapters are not read: the refusal names how to start from their weights.
"""
from __future__ import annotations

import json
import os
import re

import torch

from ..errors import WeightsFileError
from . import pages
from .hf_layout import INDEX, SINGLE

RECIPE_STATE = "recipe_state.pt"
_MOMENTS = ("exp_avg", "exp_avg_sq")
# Hugging Face's model_type -> whether torchtune's checkpointer permutes q_proj's and k_proj's rows
_FAMILIES = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False}
# torchtune's names in a decoder layer -> Hugging Face's, in the order torchtune's layer registers
# its parameters (MultiHeadAttention's projections and norms, FeedForward's w1, w2, w3, the norms)
_LAYER = {"attn.q_proj.weight": "self_attn.q_proj.weight", "attn.q_proj.bias": "self_attn.q_proj.bias",
          "attn.k_proj.weight": "self_attn.k_proj.weight", "attn.k_proj.bias": "self_attn.k_proj.bias",
          "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.v_proj.bias": "self_attn.v_proj.bias",
          "attn.output_proj.weight": "self_attn.o_proj.weight",
          "attn.q_norm.scale": "self_attn.q_norm.weight", "attn.k_norm.scale": "self_attn.k_norm.weight",
          "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w2.weight": "mlp.down_proj.weight",
          "mlp.w3.weight": "mlp.up_proj.weight",
          "sa_norm.scale": "input_layernorm.weight", "mlp_norm.scale": "post_attention_layernorm.weight"}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.scale": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_FROM_HF = {hf: tune for tune, hf in _LAYER.items()}
_IN_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


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


def to_hf(name: str) -> str | None:
    """The Hugging Face name of torchtune's parameter `name`, or None where it has none."""
    if name in _TOP:
        return _TOP[name]
    found = _IN_LAYER.fullmatch(name)
    inner = _LAYER.get(found.group(2)) if found is not None else None
    return None if inner is None else f"model.layers.{found.group(1)}.{inner}"


def from_hf(name: str) -> str:
    """torchtune's name of the Hugging Face weight `name` (itself where torchtune has none)."""
    found = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
    if found is not None and found.group(2) in _FROM_HF:
        return f"layers.{found.group(1)}.{_FROM_HF[found.group(2)]}"
    return next((tune for tune, hf in _TOP.items() if hf == name), name)


def _order(name: str) -> tuple:
    """Where torchtune's decoder registers the parameter `name`: the embedding, the layers in
    turn (each in _LAYER's order), the final norm, the output projection."""
    if name == "tok_embeddings.weight":
        return (0,)
    found = _IN_LAYER.fullmatch(name)
    if found is not None:
        return (1, int(found.group(1)), list(_LAYER).index(found.group(2)))
    return (2,) if name.startswith("norm.") else (3,)


class Recipe:
    """The torchtune save `path` as sharded_checkpoint.py's source: its trained parameters under
    their Hugging Face names, each master read from the weights, each moment from recipe_state.pt."""

    def __init__(self, path: str):
        self.path, self.describe = path, f"the torchtune checkpoint {path}"
        self.file = recipe_file(path)
        if self.file is None:
            raise WeightsFileError(f"{path} holds no torchtune checkpoint (config.json, the model's safetensors and "
                                   f"{RECIPE_STATE}); nothing was loaded")
        self._config = config = _json(os.path.join(path, "config.json"))
        self.family = config.get("model_type")
        if self.family not in _FAMILIES:
            raise WeightsFileError(f"cannot take in {self.describe}: its model is {self.family!r}; torchtune's names "
                                   f"are read for {', '.join(sorted(_FAMILIES))}; start a new run from its weights "
                                   "(run.yaml `model:` the folder); nothing was loaded")
        heads = config["num_attention_heads"]
        self._heads = {"q_proj": heads, "k_proj": config.get("num_key_value_heads", heads)}
        self._head_dim = config.get("head_dim") or config["hidden_size"] // heads
        self._weights = _weight_files(path)
        recipe = _load(self.file)
        optimizer = recipe.get("optimizer")
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("state"), dict) \
                or not isinstance(optimizer.get("param_groups"), list) or not optimizer["param_groups"]:
            raise WeightsFileError(f"cannot take in {self.describe}: {self.file} holds no optimizer state_dict (a "
                                   "run with optimizer_in_bwd saves one per parameter, which is not read); start a "
                                   "new run from its weights; nothing was loaded")
        self._check_epoch(recipe)
        names = self._tune_names(optimizer)
        self.state = {names[key]: entry for key, entry in optimizer["state"].items()}
        odd = sorted(n for n, entry in self.state.items() if not set(_MOMENTS) <= set(entry))
        if odd:
            raise WeightsFileError(f"cannot take in {self.describe}: the optimizer state of {odd[0]} is not AdamW's "
                                   "(exp_avg and exp_avg_sq); start a new run from its weights; nothing was loaded")
        if any(g.get("amsgrad") for g in optimizer["param_groups"]):
            raise WeightsFileError(f"{self.describe} was written by AdamW with amsgrad=True, which megacompile's "
                                   "AdamW does not run; nothing was loaded")
        self._hf = {}
        for name in names.values():
            hf = to_hf(name)
            if hf is None or hf not in self._weights:
                raise WeightsFileError(f"cannot take in {self.describe}: its parameter {name} is none of the weights "
                                       "it wrote (a LoRA run's adapter, or a model torchtune names otherwise); start "
                                       "a new run from its weights; nothing was loaded")
            self._hf[hf] = name
        shapes = {hf: self._weights[hf][1] for hf in self._hf}
        self.shapes = {hf: shape for hf, shape in shapes.items() if self._hf[hf] in self.state}
        self.frozen = {hf: shape for hf, shape in shapes.items() if self._hf[hf] not in self.state}
        for hf, name in self._hf.items():
            for table in _MOMENTS if name in self.state else ():
                if tuple(self.state[name][table].shape) != self.shapes[hf]:
                    raise WeightsFileError(f"cannot take in {self.describe}: the {table} of {name} is "
                                           f"{tuple(self.state[name][table].shape)}, its weight {hf} is "
                                           f"{self.shapes[hf]}; nothing was loaded")
        self.param_groups = [g | {"params": [to_hf(names[k]) for k in g["params"]]}
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
        order = sorted(self._tune_parameters(), key=_order)
        if len(order) != len(keys):
            raise WeightsFileError(f"cannot take in {self.describe}: its optimizer holds {len(keys)} parameters, the "
                                   f"model it wrote has {len(order)} (a LoRA run's adapters, or a model torchtune "
                                   "builds otherwise); start a new run from its weights; nothing was loaded")
        return dict(zip(range(len(order)), order))

    def _tune_parameters(self) -> list[str]:
        """torchtune's names of the weights it wrote, the model's parameters (an lm_head it wrote
        beside tied embeddings, as for Qwen3, is no parameter of torchtune's model)."""
        tied = bool(self._config.get("tie_word_embeddings"))
        return [from_hf(hf) for hf in self._weights if not (tied and hf == "lm_head.weight")]

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
        entry = self.state.get(self._hf[name])
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
        """The fp32 `table` of the parameter `name` (a Hugging Face name), in Hugging Face's layout."""
        if table == "master":
            from safetensors import safe_open
            file = self._weights[name][0]
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name).float()
        source = self.state[self._hf[name]][table]
        out = self._permute(name, source.float().clone())
        pages.drop(source)
        return out

    def _permute(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """torchtune's q_proj or k_proj rows in Hugging Face's order (module docstring)."""
        projection = name.split(".")[-2]
        if not _FAMILIES[self.family] or projection not in self._heads or not name.endswith(".weight"):
            return t
        heads, half = self._heads[projection], self._head_dim // 2
        return t.view(heads, half, 2, t.shape[-1]).transpose(1, 2).reshape(t.shape).contiguous()


def _weight_files(path: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each weight the folder's safetensors hold -> (its file, its shape), from the headers."""
    from safetensors import safe_open
    index = os.path.join(path, INDEX)
    files = sorted(set(_json(index)["weight_map"].values())) if os.path.isfile(index) else [SINGLE]
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


def _json(file: str) -> dict:
    try:
        with open(file) as f:
            value = json.load(f)
    except (OSError, ValueError) as e:
        raise WeightsFileError(f"cannot read {file}: {e}; nothing was loaded") from e
    if not isinstance(value, dict):
        raise WeightsFileError(f"{file} holds {type(value).__name__}, not a JSON object; nothing was loaded")
    return value


def _load(file: str) -> dict:
    try:     # weights_only: tensors, numbers and containers, nothing a pickle could run
        saved = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - any unreadable file: name it
        raise WeightsFileError(f"cannot read {file}: {e}; nothing was loaded") from e
    if not isinstance(saved, dict):
        raise WeightsFileError(f"{file} holds {type(saved).__name__}, not torchtune's recipe state; nothing was loaded")
    return saved
