"""Images whose size sets their token count: Qwen2.5-VL's processor, taken apart.

Qwen2.5-VL keeps each image's size (its image processor resizes it to multiples of patch x merge
pixels within a pixel budget) and cuts it into a grid of (t, h, w) patches: the image fills
t*h*w / merge_size**2 tokens, its patches go flattened into pixel_values, its grid into
image_grid_thw, and mm_token_type_ids marks the image tokens (1), from which the model builds its
3D positions. A record's `<image>` is written as the model's chat template writes an image
(`<|vision_start|><|image_pad|><|vision_end|>`, as LlamaFactory's Qwen2-VL plugin writes it), and
the pad token is then widened to the image's tokens (images.Media.widen).

transformers' Qwen2_5_VLProcessor cannot be built without torchvision: AutoProcessor hands
`backend="pil"` to its image processor (Qwen2VLImageProcessorPil) but to its video processor too,
which exists only for torchvision, and the processor's constructor checks the video processor's
class even when it is None. Records here carry images alone, so the processor is used in its
parts: the folder's tokenizer, its image processor with the PIL backend (on every machine, so a
run's pixels do not depend on whether torchvision is installed), its chat template; what the
processor's __call__ does with them (the pad token widened per image, the token types) is done
here. The export gets the folder's processor files as they are (save_pretrained): with
torchvision, AutoProcessor loads them; without, AutoImageProcessor and AutoTokenizer do.
"""
from __future__ import annotations

import os
import shutil

from ...errors import ArgumentError
from .images import Media, processor_class

GRID_PROCESSORS = ("Qwen2_5_VLProcessor", "Qwen3VLProcessor")
PAD, START, END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
# what a Qwen2.5-VL folder holds of its processor, besides the tokenizer's files
EXPORTED_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def is_grid_processor(folder: str) -> bool:
    return processor_class(folder) in GRID_PROCESSORS


def media(folder: str) -> Media:
    """The folder's processor: Qwen2.5-VL's in its parts, any other whole (images.Media)."""
    return GridMedia(folder) if is_grid_processor(folder) else Media(folder)


class GridMedia(Media):
    """images.Media for a Qwen2.5-VL folder: its tokenizer, image processor (PIL) and chat
    template; an image's width and pixels come from its grid."""

    def __init__(self, folder: str):
        try:
            from transformers import AutoImageProcessor, AutoTokenizer
            from transformers.processing_utils import ProcessorMixin
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.image_processor = AutoImageProcessor.from_pretrained(folder, backend="pil")
            self.template = ProcessorMixin.get_processor_dict(folder)[0].get("chat_template")
        except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
            raise ArgumentError(f"cannot load the processor from {folder}: {str(e).splitlines()[0][:300]}") from e
        self.merge = getattr(self.image_processor, "merge_size", None)
        if not isinstance(self.merge, int) or "image_grid_thw" not in self.image_processor.model_input_names:
            raise ArgumentError(f"the image processor in {folder} ({type(self.image_processor).__name__}) writes no "
                                f"image grids: {processor_class(folder)} needs Qwen2.5-VL's (Qwen2VLImageProcessor)")
        token = getattr(self.tokenizer, "image_token", None) or PAD
        vocab = self.tokenizer.get_vocab()
        if token not in vocab:
            raise ArgumentError(f"the tokenizer in {folder} has no {token} token: Qwen2.5-VL's image token")
        self._start(folder, token, self.tokenizer)
        self.image_ids = [self.token_id]
        self.written = START + token + END if START in vocab and END in vocab else token

    def save_pretrained(self, path: str) -> None:
        """The tokenizer and the folder's own processor files, beside an export."""
        self.tokenizer.save_pretrained(path)
        for name in EXPORTED_FILES:
            if os.path.isfile(os.path.join(self.folder, name)):
                shutil.copyfile(os.path.join(self.folder, name), os.path.join(path, name))

    def chat_template(self):
        return self.template

    def widen(self, ids: list[int], targets: list[bool], paths: list[str], where: str, tokenizer=None,
              messages: list | None = None) -> tuple[list, list]:
        """Each rendered pad token widened to the image's tokens, none of them a target: what
        Qwen2_5_VLProcessor does (the pad is a special token, so the text around it tokenises
        the same either way)."""
        at = self._rendered(ids, paths, where)
        out_ids, out_targets, last = [], [], 0
        for i, path in zip(at, paths):
            out_ids += ids[last:i] + [self.token_id] * self.width(path, where)
            out_targets += targets[last:i] + [False] * self.width(path, where)
            last = i + 1
        return out_ids + ids[last:], out_targets + targets[last:]

    def width(self, path: str, where: str) -> int:
        """The image's tokens: its grid's patches over merge_size**2."""
        if path not in self._widths:
            self._widths[path] = int(self._load(path, where)[1].prod()) // self.merge ** 2
        return self._widths[path]

    def _load(self, path: str, where: str):
        out = self.image_processor(images=[self._open(path, where)], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"][0]

    def _load_pixels(self, path: str):
        return self._load(path, path)

    def pixels(self, paths: list[str]):
        """pixel_values: the images' patches, flattened one after another."""
        import torch
        return torch.cat([self._pixels(p)[0] for p in paths])

    def inputs(self, rows: list[list[str]], input_ids) -> dict:
        """As Qwen2_5_VLProcessor writes them: pixel_values, image_grid_thw (one row per image, in
        order), mm_token_type_ids (1 on image tokens, 0 elsewhere)."""
        import torch
        paths = [p for row in rows for p in row]
        return {"pixel_values": self.pixels(paths),
                "image_grid_thw": torch.stack([self._pixels(p)[1] for p in paths]),
                "mm_token_type_ids": (input_ids == self.token_id).to(torch.int64)}

    def check_packing(self, packing: bool | str, tokens) -> None:
        """isolated packing gives every row position ids from 0 per document, which the model would
        take in place of the 3D positions it builds from the image grids."""
        if packing == "isolated" and tokens.images:
            where = next(iter(tokens.images.values()))[0]
            raise ArgumentError(f"packing: isolated gives each document 1D position ids, and {where} has images, "
                                "whose tokens Qwen2.5-VL places at 3D positions it builds from the image grids: "
                                "use packing: true or packing: false (documents with images fill rows of their own "
                                "either way)")
