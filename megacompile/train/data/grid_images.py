"""Images whose size sets their token count: Qwen2.5-VL's processor (Qwen2-VL's, Qwen3-VL's), taken apart.

Qwen2.5-VL keeps each image's size (its image processor resizes it to multiples of patch x merge
pixels within a pixel budget) and cuts it into a grid of (t, h, w) patches: the image fills
t*h*w / merge_size**2 tokens, its patches go flattened into pixel_values, its grid into
image_grid_thw, and mm_token_type_ids marks the image tokens (1), from which the model builds its
3D positions. A record's `<image>` is written as the model's chat template writes an image
(`<|vision_start|><|image_pad|><|vision_end|>`, as LlamaFactory's Qwen2-VL plugin writes it), and
the pad token is then widened to the image's tokens (images.Media.widen).

transformers' Qwen2_5_VLProcessor (and Qwen2VLProcessor) cannot be built without torchvision: AutoProcessor hands
`backend="pil"` to its image processor (Qwen2VLImageProcessorPil) but to its video processor too,
which exists only for torchvision, and the processor's constructor checks the video processor's
class even when it is None. A record with images alone is written with the processor in its
parts: the folder's tokenizer, its image processor with the PIL backend (on every machine, so a
run's pixels do not depend on whether torchvision is installed), its chat template; what the
processor's __call__ does with them (the pad token widened per image, the token types) is done
here. The export gets the folder's processor files as they are (save_pretrained): with
torchvision, AutoProcessor loads them; without, AutoImageProcessor and AutoTokenizer do. A record
with videos is written by the whole processor, which needs torchvision (grid_videos.py).
"""
from __future__ import annotations

import os
import shutil

from ...errors import ArgumentError
from . import pixels, videos
from .grid_videos import GridVideos
from .images import Media, has_processor, images_of, processor_class, reason, targets_on, videos_of

GRID_PROCESSORS = ("Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor")
PAD, START, END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
# what a Qwen2.5-VL folder holds of its processor, besides the tokenizer's files
EXPORTED_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
                   "chat_template.json", "chat_template.jinja")


def is_grid_processor(folder: str) -> bool:
    return processor_class(folder) in GRID_PROCESSORS


def media(folder: str) -> Media:
    """The folder's processor: Qwen2.5-VL's in its parts, any other whole (images.Media)."""
    return GridMedia(folder) if is_grid_processor(folder) else Media(folder)


def for_run(c, tokenizer, folder: str | None) -> Media | None:
    """The run's processor where `folder` holds one (None where not): its images read within the
    run's image_max_pixels / image_min_pixels, as LlamaFactory scales them, its videos by the video_*
    keys, and one chat template for the tokenizer and the processor (a processor may hold the
    template alone; a run's own chat_template is written with the model it trained)."""
    if not has_processor(folder):
        return None
    check_template(c, folder)
    found = media(folder)
    from .. import vocab       # the run's added tokens, in the tokenizer the processor writes with too
    vocab.add(found.tokenizer if isinstance(found, GridMedia) else found.processor.tokenizer, c)
    pixels.attach(found, pixels.limits(c))
    found.videos_within(videos.Settings.of(c))
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = found.chat_template()
    elif c.chat_template is not None:
        found.use_template(tokenizer.chat_template)
    return found


def check_template(c, folder: str | None) -> None:
    """LlamaFactory's `template` names a text layout, which a vision-language model's processor does
    not write: refused before its tokenizer is loaded with it."""
    if c.template is not None and has_processor(folder):
        raise ArgumentError(f"template {c.template!r} writes text chats, and {folder} is a vision-language "
                            "model, whose chats its processor's own chat template writes: leave template out")


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
            self.own_template = False       # the run's chat_template in place of the folder's (use_template)
        except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
            raise ArgumentError(f"cannot load the processor from {folder} ({processor_class(folder)}): "
                                f"{reason(e)}") from e
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
        wrapped = START in vocab and END in vocab
        self.written = START + token + END if wrapped else token
        video = getattr(self.tokenizer, "video_token", None) or VIDEO_PAD
        self.video_id = vocab.get(video)
        self.written_video = START + video + END if wrapped else video     # as the chat template writes a video
        self.videos_within(videos.Settings())

    def videos_within(self, settings: videos.Settings) -> None:
        self.video_settings = settings
        self.videos = GridVideos(self.folder, self.image_processor, settings)

    def use_template(self, template: str) -> None:
        self.template = self.tokenizer.chat_template = template
        self.own_template = True

    def save_pretrained(self, path: str) -> None:
        """The tokenizer and the folder's own processor files, beside an export (its chat template
        the run's, where the run gave one: the tokenizer writes it)."""
        self.tokenizer.save_pretrained(path)
        for name in EXPORTED_FILES:
            if self.own_template and name.startswith("chat_template"):
                continue
            if os.path.isfile(os.path.join(self.folder, name)):
                shutil.copyfile(os.path.join(self.folder, name), os.path.join(path, name))

    def chat_template(self):
        return self.template

    def widen(self, ids: list[int], targets: list[bool], paths: list, where: str, tokenizer=None,
              messages: list | None = None, options: dict | None = None,
              generation_prompt: bool = False) -> tuple[list, list]:
        """Each rendered pad token widened to the image's tokens, none of them a target: what
        Qwen2_5_VLProcessor does (the pad is a special token, so the text around it tokenises
        the same either way). A record with videos is written by the processor itself
        (grid_videos.py)."""
        images, clips = images_of(paths), videos_of(paths)
        if clips:
            return self._with_videos(ids, targets, images, clips, where, tokenizer, messages, options,
                                     generation_prompt)
        at = self._rendered(ids, images, where)
        out_ids, out_targets, last = [], [], 0
        for i, path in zip(at, images):
            out_ids += ids[last:i] + [self.token_id] * self.width(path, where)
            out_targets += targets[last:i] + [False] * self.width(path, where)
            last = i + 1
        return out_ids + ids[last:], out_targets + targets[last:]

    def _with_videos(self, ids, targets, images, clips, where, tokenizer, messages, options,
                     generation_prompt: bool = False) -> tuple[list, list]:
        if self.video_id is None:
            raise ArgumentError(f"{where}: the record has videos, and the tokenizer in {self.folder} has no "
                                f"{VIDEO_PAD} token: Qwen's video token")
        rendered = [i for i, t in enumerate(ids) if t == self.video_id]
        if len(rendered) != len(clips):
            raise ArgumentError(f"{where}: the chat template rendered {len(rendered)} video token"
                                f"{'s' * (len(rendered) != 1)} for {len(clips)} video{'s' * (len(clips) != 1)}: "
                                "the template must write each turn's text as it is (string contents), and a video "
                                "part as that token")
        text = (tokenizer or self.tokenizer).apply_chat_template(messages, tokenize=False,
                                                                 add_generation_prompt=generation_prompt,
                                                                 **(options or {}))
        row = self.videos.row(text, [self._open(p, where) for p in images], clips, where)
        media = set(rendered) | {i for i, t in enumerate(ids) if t == self.token_id}
        placed = [t and i not in media for i, t in enumerate(targets)]
        return row, targets_on(ids, placed, row, {self.token_id, self.video_id}, where)

    def width(self, path, where: str) -> int:
        """The image's (video's) tokens: its grid's patches over merge_size**2."""
        if isinstance(path, dict):
            return self.videos.tokens(path["video"], self.merge)
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

    def inputs(self, rows: list[list], input_ids) -> dict:
        """As Qwen2_5_VLProcessor writes them: pixel_values, image_grid_thw (one row per image, in
        order), the videos' inputs likewise (grid_videos.py), mm_token_type_ids (1 on image tokens,
        2 on video tokens, 0 elsewhere)."""
        import torch
        media = [p for row in rows for p in row]
        paths, clips = images_of(media), videos_of(media)
        out = {}
        if paths:
            out = {"pixel_values": self.pixels(paths),
                   "image_grid_thw": torch.stack([self._pixels(p)[1] for p in paths])}
        if clips:
            out.update(self.videos.inputs(clips))
        types = (input_ids == self.token_id).to(torch.int64)
        if self.video_id is not None:
            types += 2 * (input_ids == self.video_id).to(torch.int64)
        return {**out, "mm_token_type_ids": types}

    def check_packing(self, packing: bool | str, tokens) -> None:
        """isolated packing gives every row position ids from 0 per document, which the model would
        take in place of the 3D positions it builds from the image grids."""
        if packing == "isolated" and tokens.images:
            where = next(iter(tokens.images.values()))[0]
            raise ArgumentError(f"packing: isolated gives each document 1D position ids, and {where} has images, "
                                "whose tokens Qwen2.5-VL places at 3D positions it builds from the image grids: "
                                "use packing: true or packing: false (documents with images fill rows of their own "
                                "either way)")
