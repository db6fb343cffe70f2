"""Records with images, for a vision-language model folder that holds its processor.

    {"messages": [{"role": "user", "content": "<image> what is this"},
                  {"role": "assistant", "content": "a red square"}],
     "images": ["images/red.png"]}          # paths relative to the data file (its folder)

(ShareGPT's `conversations` too, as LLaVA and LlamaFactory write them.) Each `<image>` in a turn's
text stands for the next image of `images`, in order. The conversation is rendered and masked as
any chat record (masking.chat, with the processor's chat template when the tokenizer has none);
each image token it renders is then widened to the tokens the model's processor writes for that
image (LLaVA: one per vision feature; Qwen2.5-VL: one per merged patch of its grid, so per image
size, grid_images.py), and none of them is a target. The pixels are made by the processor's image
processor when a micro-batch reads them (inputs: pixel_values, and what else the family's
processor writes beside them), not kept in the token file: the token file holds each document's
image paths.

Every record's images are opened, and counted against its placeholders, while the data is
tokenised: a missing file or a count that differs is an ArgumentError naming the record, before
anything is trained.
"""
from __future__ import annotations

import os
from functools import lru_cache

from ...errors import ArgumentError

PLACEHOLDER = "<image>"     # what LLaVA's and LlamaFactory's records write for an image
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def has_processor(folder: str | None) -> bool:
    return folder is not None and os.path.isdir(folder) and any(
        os.path.isfile(os.path.join(folder, f)) for f in PROCESSOR_FILES)


class Media:
    """A model folder's processor, and what tokenising and batching need of it."""

    def __init__(self, folder: str):
        try:
            from transformers import AutoProcessor
            self.processor = AutoProcessor.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
            raise ArgumentError(f"cannot load the processor from {folder}: {str(e).splitlines()[0][:300]}") from e
        token = getattr(self.processor, "image_token", None)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if token is None or getattr(self.processor, "image_processor", None) is None or tokenizer is None:
            raise ArgumentError(f"the processor in {folder} ({type(self.processor).__name__}) has no image token, "
                                "image processor or tokenizer: records with images need a vision-language "
                                "model's processor (e.g. LlavaProcessor)")
        self._start(folder, token, tokenizer)

    def _start(self, folder: str, token: str, tokenizer) -> None:
        self.folder, self.token = folder, token
        self.token_id = tokenizer.convert_tokens_to_ids(token)
        self.written = token    # what each <image> of a turn becomes before the template renders it
        self.base = "."         # the folder the current data entry's image paths are relative to
        self._widths: dict[str, int] = {}
        self._pixels = lru_cache(maxsize=4096)(self._load_pixels)

    def save_pretrained(self, path: str) -> None:
        """The processor's files (tokenizer, image processor, chat template) beside an export."""
        self.processor.save_pretrained(path)

    def chat_template(self):
        return getattr(self.processor, "chat_template", None)

    def at(self, entry_path: str) -> None:
        """Image paths of the next records are relative to this data entry (a file's folder, or
        the folder itself)."""
        self.base = entry_path if os.path.isdir(entry_path) else os.path.dirname(entry_path)

    def paths(self, record: dict, where: str) -> list[str]:
        """The record's image files, checked: a list of paths that exist (absolute here)."""
        found = record.get("images")
        if found is None:
            return []
        if not isinstance(found, list) or not all(isinstance(p, str) and p for p in found):
            raise ArgumentError(f"{where}: images must be a list of image file paths (relative to the data file); "
                                f"got {found!r}")
        out = []
        for p in found:
            path = os.path.abspath(os.path.join(self.base, p))
            if not os.path.isfile(path):
                raise ArgumentError(f"{where}: image {p} is not there ({path}); image paths are relative to the "
                                    "data file's folder")
            out.append(path)
        return out

    def messages(self, messages: list, paths: list[str], where: str) -> list:
        """The turns with each `<image>` written as the processor's image token, after checking
        that the placeholders number the images."""
        if not isinstance(messages, list):
            return messages         # masking.chat refuses it with the line
        texts = [m.get("content") for m in messages if isinstance(m, dict)]
        count = sum(t.count(PLACEHOLDER) for t in texts if isinstance(t, str))
        if count != len(paths):
            raise ArgumentError(f"{where}: the turns hold {count} {PLACEHOLDER} placeholder{'s' * (count != 1)} "
                                f"and images lists {len(paths)} file{'s' * (len(paths) != 1)}: each {PLACEHOLDER} "
                                "stands for one image, in order; make them agree")
        if self.written == PLACEHOLDER:
            return messages
        return [{**m, "content": m["content"].replace(PLACEHOLDER, self.written)}
                if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]

    def widen(self, ids: list[int], targets: list[bool], paths: list[str], where: str) -> tuple[list, list]:
        """Each rendered image token widened to the image's tokens, none of them a target."""
        at = [i for i, t in enumerate(ids) if t == self.token_id]
        if len(at) != len(paths):
            raise ArgumentError(f"{where}: the chat template rendered {len(at)} image token{'s' * (len(at) != 1)} "
                                f"({self.token}) for {len(paths)} image{'s' * (len(paths) != 1)}: the template "
                                "must write each turn's text as it is (string contents)")
        out_ids, out_targets, last = [], [], 0
        for i, path in zip(at, paths):
            out_ids += ids[last:i] + [self.token_id] * self.width(path, where)
            out_targets += targets[last:i] + [False] * self.width(path, where)
            last = i + 1
        return out_ids + ids[last:], out_targets + targets[last:]

    def width(self, path: str, where: str) -> int:
        """The image tokens the processor writes for this image."""
        if path not in self._widths:
            out = self.processor(text=self.token, images=[self._open(path, where)])
            self._widths[path] = sum(1 for t in out["input_ids"][0] if t == self.token_id)
        return self._widths[path]

    def pixels(self, paths: list[str]):
        """pixel_values for these images, in order (one batch dimension entry per image)."""
        import torch
        return torch.cat([self._pixels(p) for p in paths])

    def inputs(self, paths: list[str], input_ids) -> dict:
        """The image inputs of a micro-batch whose rows hold these images, in row order."""
        return {"pixel_values": self.pixels(paths)}

    def check_packing(self, packing: bool | str, tokens) -> None:
        """Whether documents with images can train under this packing (they fill rows of their own)."""

    def _load_pixels(self, path: str):
        out = self.processor.image_processor(images=[self._open(path, path)], return_tensors="pt")
        return out["pixel_values"].float()

    @staticmethod
    def _open(path: str, where: str):
        from PIL import Image
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except Exception as e:  # noqa: BLE001 - PIL's own words, with the file named
            raise ArgumentError(f"{where}: cannot read image {path}: {str(e).splitlines()[0][:200]}") from e
