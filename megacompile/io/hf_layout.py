"""Names and cuts of tensors on disk that differ from the model's own, as transformers maps them.

transformers 5 holds a mixture-of-experts layer's experts as fused 3D weights (`experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]), while its save_pretrained, like the Hub's checkpoints,
stores one 2D tensor per expert and projection (`experts.3.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.3.w1.weight`), converting on load and back on save with its conversion
mapping (transformers.conversion_mapping). Both layouts load here; exports use transformers'
save-side mapping, so a folder reads as one transformers itself wrote.

Loading streams each stored tensor into its slice of the fused master, so it is read once and never
assembled: a converter that stacks experts (MergeModulelist(dim=0)) places expert e's tensor at
[e], and one that also concatenates projections (Concatenate(dim=1)) places the j-th of J at
[e, j*r:(j+1)*r]. Other conversions (transposes, permutations) are refused by name.
"""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from ..errors import WeightsFileError

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"   # a sharded folder's index; one file

# A stored tensor's place inside a model tensor: (expert, first row, end row) of dims 0 and 1;
# rows None: the whole expert.
Part = tuple[int, int | None, int | None]


def inner_model(model: nn.Module) -> nn.Module:
    """The transformers model a trained module holds, whose names the files use: a PEFT model's base,
    a stage objective's `policy` (its keys are the files' without `policy.`), or `model` itself."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "policy", None), nn.Module):
            model = model.policy
        elif callable(getattr(model, "files_like", None)):     # a reward model: its causal LM's files
            return model.files_like()
        else:
            return model


class DiskLayout:
    def __init__(self, model: nn.Module):
        self.model = model
        self.renamings, self.converters = [], []
        self._saves_converted = False       # transformers' save_pretrained converts this model's names
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming
        except ImportError:
            return
        if not isinstance(model, PreTrainedModel):
            return
        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._saves_converted = bool(get_model_conversion_mapping(model, add_legacy=False))

    def place(self, key: str, shapes: dict[str, tuple]) -> tuple[str, Part | None] | None:
        """The model tensor a stored `key` belongs to and where in it, or None if it has none.
        `shapes`: the model's tensor shapes by name."""
        if not self.renamings and not self.converters:
            return None
        from transformers.core_model_loading import rename_source_key
        name, pattern = rename_source_key(key, self.renamings, self.converters)
        if name not in shapes:
            return None
        if pattern is None:
            return name, None
        converter = next(c for c in self.converters if pattern in c.source_patterns)
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
        sources = converter.source_patterns
        if ops not in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) \
                or (len(ops) == 1 and len(sources) != 1):
            raise WeightsFileError(f"{key} is stored in a layout transformers converts with {ops} on load; megacompile "
                                   "streams only stacked experts (MergeModulelist(dim=0), then Concatenate(dim=1))")
        before, _, after = pattern.partition("*")
        found = re.search(re.escape(before) + r"(\d+)" + re.escape(after), key)
        if found is None:
            raise WeightsFileError(f"{key}: cannot tell which expert it holds (transformers' pattern {pattern})")
        expert = int(found.group(1))
        if len(ops) == 1:
            return name, (expert, None, None)
        rows = shapes[name][1] // len(sources)
        j = sources.index(pattern)
        return name, (expert, j * rows, (j + 1) * rows)

    def parts_of(self, name: str, shape: tuple) -> int:
        """How many stored tensors a complete fused tensor is made of (1 when stored whole)."""
        for converter in self.converters:
            target = converter.target_patterns[0]
            if name.endswith(target.lstrip(".")) and len(shape) >= 2:
                return shape[0] * len(converter.source_patterns)
        return 1

    def on_disk(self, key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The stored tensors (views of `tensor`, no copies) and names transformers' save_pretrained
        writes for the model tensor `key`."""
        if not self._saves_converted:
            return [(key, tensor)]
        from transformers.core_model_loading import revert_weight_conversion
        return list(revert_weight_conversion(self.model, {key: tensor}).items())


def part_shape(shape: tuple, part: Part) -> tuple:
    expert, start, end = part
    inner = shape[1:] if start is None else (end - start,) + tuple(shape[2:])
    return tuple(inner)


def part_of(t: torch.Tensor, part: Part) -> torch.Tensor:
    expert, start, end = part
    return t[expert] if start is None else t[expert, start:end]
