"""torchtune's parameter names and row layout against Hugging Face's, as torchtune's checkpointer
converts them (its convert_weights; facts, rewritten here).

torchtune names a decoder's modules its own way (tok_embeddings, layers.N.attn.q_proj,
attn.output_proj, mlp.w1/w2/w3, sa_norm, mlp_norm, norm, output) and a norm's weight `scale`. A
LoRA module keeps its base weight and bias and adds lora_a and lora_b, which PEFT names lora_A and
lora_B under its model's prefix (`base_model.model.`) and the adapter's name (`default`).

Rows: for Llama, Mistral, Gemma and Gemma 2, torchtune's rotary embedding pairs a head's features (0, 1), (2, 3),
... where Hugging Face's pairs feature i with i + head_dim / 2, so torchtune's checkpointer
permutes the output rows of q_proj and k_proj as it writes them (and of their lora_B, whose rows
are the projection's). Qwen2 and Qwen3 use Hugging Face's rotary layout in torchtune: nothing is
permuted. Every tensor of a parameter (its value, each AdamW moment) is permuted alike.
"""
from __future__ import annotations

import re

import torch

# Hugging Face's model_type -> whether torchtune's checkpointer permutes q_proj's and k_proj's rows
FAMILIES = {"llama": True, "mistral": True, "gemma": True, "gemma2": True, "qwen2": False, "qwen3": False}
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
# Gemma 2's layer has four norms, which torchtune names crosswise to Hugging Face's (its
# gemma2 convert_weights): sa_scale after the attention, mlp_scale before the MLP, mlp_norm after
# it; its final norm sits inside a module that caps the logits.
_GEMMA2_LAYER = {**{k: v for k, v in _LAYER.items() if k.startswith(("attn.", "mlp."))},
                 "sa_norm": "input_layernorm", "mlp_norm": "post_feedforward_layernorm",
                 "sa_scale": "post_attention_layernorm", "mlp_scale": "pre_feedforward_layernorm"}
_GEMMA2_TOP = {"tok_embeddings": "model.embed_tokens", "norm.rms_norm": "model.norm", "output": "lm_head"}
_GEMMA2_NORMS = {"sa_norm", "mlp_norm", "sa_scale", "mlp_scale", "norm.rms_norm"}


def _tables(family: str) -> tuple[dict, dict, set]:
    """The family's (layer modules, top modules, norms): torchtune's names -> Hugging Face's."""
    return (_GEMMA2_LAYER, _GEMMA2_TOP, _GEMMA2_NORMS) if family == "gemma2" else (_LAYER, _TOP, _NORMS)
_TUNE_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _split(name: str, modules: dict[str, str]) -> tuple[str, str] | None:
    """(module, tensor) of `name` among `modules`' keys, or None."""
    return next(((m, name[len(m) + 1:]) for m in modules if name.startswith(m + ".")), None)


def to_hf(name: str, family: str = "llama") -> str | None:
    """The Hugging Face name of torchtune's parameter `name` (a LoRA adapter's: the PEFT model's),
    or None where it has none."""
    layer, top, _ = _tables(family)
    found = _TUNE_LAYER.fullmatch(name)
    prefix, modules, rest = (f"model.layers.{found.group(1)}.", layer, found.group(2)) if found else ("", top, name)
    split = _split(rest, modules)
    if split is None or split[1] not in _TENSORS:
        return None
    out = f"{prefix}{modules[split[0]]}.{_TENSORS[split[1]]}"
    return PEFT_PREFIX + out if split[1].startswith("lora_") else out


def from_hf(name: str, family: str = "llama") -> str | None:
    """torchtune's name of the Hugging Face weight `name` (a model's, not an adapter's), or None."""
    layer, top, norms = _tables(family)
    found = _HF_LAYER.fullmatch(name)
    prefix, modules, rest = (f"layers.{found.group(1)}.", layer, found.group(2)) if found else ("", top, name)
    module = next((m for m, hf in modules.items() if rest.startswith(hf + ".")), None)
    if module is None or rest[len(modules[module]) + 1:] not in ("weight", "bias"):
        return None
    tensor = rest[len(modules[module]) + 1:]
    return f"{prefix}{module}.{'scale' if module in norms and tensor == 'weight' else tensor}"


def order(name: str, family: str = "llama") -> tuple:
    """Where torchtune's decoder registers the parameter `name` among its model.parameters(): the
    embedding, the layers in turn (each module in the family's layer table's order, its tensors in
    _TENSORS'), the final norm, the output projection."""
    layer, top, _ = _tables(family)
    found = _TUNE_LAYER.fullmatch(name)
    modules, rest = (layer, found.group(2)) if found else (top, name)
    split = _split(rest, modules) or ("", "")
    where = (list(modules).index(split[0]) if split[0] else len(modules),
             list(_TENSORS).index(split[1]) if split[1] in _TENSORS else len(_TENSORS))
    if found:
        return (1, int(found.group(1))) + where
    return ({"tok_embeddings": 0, "norm": 2, "norm.rms_norm": 2, "output": 3}.get(split[0], 4), 0) + where


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
