"""torchtune's parameter names and row layout against Hugging Face's, as torchtune's checkpointer
converts them (its convert_weights; facts, rewritten here).

torchtune names a decoder's modules its own way (tok_embeddings, layers.N.attn.q_proj,
attn.output_proj, mlp.w1/w2/w3, sa_norm, mlp_norm, norm, output) and a norm's weight `scale`. A
LoRA module keeps its base weight and bias and adds lora_a and lora_b, which PEFT names lora_A and
lora_B under its model's prefix (`base_model.model.`) and the adapter's name (`default`).

Rows: for Llama, Mistral and Gemma, torchtune's rotary embedding pairs a head's features (0, 1), (2, 3),
... where Hugging Face's pairs feature i with i + head_dim / 2, so torchtune's checkpointer
permutes the output rows of q_proj and k_proj as it writes them (and of their lora_B, whose rows
are the projection's). Qwen2 and Qwen3 use Hugging Face's rotary layout in torchtune: nothing is
permuted. Every tensor of a parameter (its value, each AdamW moment) is permuted alike.
"""
from __future__ import annotations

import re

import torch

# Hugging Face's model_type -> whether torchtune's checkpointer permutes q_proj's and k_proj's rows
FAMILIES = {"llama": True, "mistral": True, "gemma": True, "qwen2": False, "qwen3": False}
PEFT_PREFIX = "base_model.model."
# a decoder layer's modules, torchtune's -> Hugging Face's, in the order torchtune's layer registers
# them (MultiHeadAttention's projections and norms, FeedForward's w1, w2, w3, the layer's norms)
_LAYER = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj", "attn.v_proj": "self_attn.v_proj",
          "attn.output_proj": "self_attn.o_proj", "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm",
          "mlp.w1": "mlp.gate_proj", "mlp.w2": "mlp.down_proj", "mlp.w3": "mlp.up_proj",
          "sa_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
_TOP = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
# a module's tensors, torchtune's -> Hugging Face's (PEFT's for the adapters), in registration order
_TENSORS = {"weight": "weight", "scale": "weight", "bias": "bias",
            "lora_a.weight": "lora_A.default.weight", "lora_b.weight": "lora_B.default.weight"}
_NORMS = {"attn.q_norm", "attn.k_norm", "sa_norm", "mlp_norm", "norm"}
_TUNE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _split(name: str, modules: dict[str, str]) -> tuple[str, str] | None:
    """(module, tensor) of `name` among `modules`' keys, or None."""
    return next(((m, name[len(m) + 1:]) for m in modules if name.startswith(m + ".")), None)


def to_hf(name: str) -> str | None:
    """The Hugging Face name of torchtune's parameter `name` (a LoRA adapter's: the PEFT model's),
    or None where it has none."""
    found = _TUNE_LAYER.fullmatch(name)
    prefix, modules, rest = (f"model.layers.{found.group(1)}.", _LAYER, found.group(2)) if found else ("", _TOP, name)
    split = _split(rest, modules)
    if split is None or split[1] not in _TENSORS:
        return None
    out = f"{prefix}{modules[split[0]]}.{_TENSORS[split[1]]}"
    return PEFT_PREFIX + out if split[1].startswith("lora_") else out


def from_hf(name: str) -> str | None:
    """torchtune's name of the Hugging Face weight `name` (a model's, not an adapter's), or None."""
    found = _HF_LAYER.fullmatch(name)
    prefix, modules, rest = (f"layers.{found.group(1)}.", _LAYER, found.group(2)) if found else ("", _TOP, name)
    module = next((m for m, hf in modules.items() if rest.startswith(hf + ".")), None)
    if module is None or rest[len(modules[module]) + 1:] not in ("weight", "bias"):
        return None
    tensor = rest[len(modules[module]) + 1:]
    return f"{prefix}{module}.{'scale' if module in _NORMS and tensor == 'weight' else tensor}"


def order(name: str) -> tuple:
    """Where torchtune's decoder registers the parameter `name` among its model.parameters(): the
    embedding, the layers in turn (each module in _LAYER's order, its tensors in _TENSORS'), the
    final norm, the output projection."""
    found = _TUNE_LAYER.fullmatch(name)
    modules, rest = (_LAYER, found.group(2)) if found else (_TOP, name)
    split = _split(rest, modules) or ("", "")
    where = (list(modules).index(split[0]) if split[0] else len(modules),
             list(_TENSORS).index(split[1]) if split[1] in _TENSORS else len(_TENSORS))
    if found:
        return (1, int(found.group(1))) + where
    return ({"tok_embeddings": 0, "norm": 2, "output": 3}.get(split[0], 4), 0) + where


def permute(name: str, t: torch.Tensor, family: str, heads: dict[str, int], head_dim: int) -> torch.Tensor:
    """A tensor of the parameter `name` (Hugging Face's) in torchtune's rows, in Hugging Face's:
    the rows of q_proj's and k_proj's weight and lora_B in a permuting family (module docstring).
    heads: q_proj's and k_proj's head counts."""
    parts = name.split(".")
    projection = next((p for p in ("q_proj", "k_proj") if p in parts), None)
    if not FAMILIES[family] or projection is None or parts[-1] != "weight" or "lora_A" in parts:
        return t
    half = head_dim // 2
    return t.view(heads[projection], half, 2, t.shape[-1]).transpose(1, 2).reshape(t.shape).contiguous()
