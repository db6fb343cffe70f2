"""Records with images, for a vision-language model folder that holds its processor.

    {"messages": [{"role": "user", "content": "<image> what is this"},
                  {"role": "assistant", "content": "a red square"}],
     "images": ["images/red.png"]}          # paths relative to the data file (its folder)

(ShareGPT's `conversations` too, as LLaVA and LlamaFactory write them.) Each `<image>` in a turn's
text stands for the next image of `images`, in order, and is written as the processor's image
token (LLaVA's and Idefics3's `<image>`, Gemma 3's `<start_of_image>`). The model's processor is
the source of truth for what a record becomes: the conversation is rendered with the chat template
(the tokenizer's, else the processor's) and masked as any chat record (masking.chat), then the
rendered text and the record's images go through the processor itself, whose input_ids are the
document's tokens: each image as the processor writes it, its wrapper tokens included (Gemma 3:
begin- and end-of-image around its soft tokens; Idefics3 / SmolVLM: `<fake_token_around_image>`,
`<global-img>` and the row/column tokens of its crops), and the text around it tokenised as the
processor tokenises it. The targets are carried over from the masked rendering by aligning the two
token sequences: a token the processor added or changed is never a target, and neither is an image
token; a record whose answer tokens the processor's tokens do not hold as rendered is refused.
Per-token inputs the processor writes beside input_ids (Gemma 3's token_type_ids) are 1 exactly on
its image tokens; that is checked per record, and they are made from the row's input_ids when a
micro-batch is read. (Qwen2.5-VL / Qwen3-VL: grid_images.py.)

The pixels are made by the processor's image processor when a micro-batch reads them (inputs:
pixel_values, and what else the image processor writes beside them: Idefics3's
pixel_attention_mask), not kept in the token file: the token file holds each document's image
paths. Images are processed one by one (kept while the last read fill at most 256 MiB: PixelCache)
and laid out as the processor lays out a batch:
one after another ([images, 3, H, W]), or padded per row ([rows, most images in a row, 3, H, W],
zeros and a zero pixel_attention_mask where a row has fewer, or an image is smaller).

Every record's images are opened, and counted against its placeholders, while the data is
tokenised: a missing file or a count that differs is an ArgumentError naming the record, before
anything is trained.
"""
from __future__ import annotations

import importlib.util
import json
import os
from collections import OrderedDict
from difflib import SequenceMatcher

from ...errors import ArgumentError
from . import embedded, list_contents, parts

PLACEHOLDER = "<image>"     # what LLaVA's and LlamaFactory's records write for an image
VIDEO = "<video>"           # and for a video (videos.py)
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
# processors transformers builds only with these packages (their video processors need torchvision)
NEEDS = {"SmolVLMProcessor": ("torchvision", "num2words")}
TEXT_KEYS = ("input_ids", "attention_mask")
ROWS = "processor/2"    # what a record with images becomes: a token file made otherwise is made again


def has_processor(folder: str | None) -> bool:
    return folder is not None and os.path.isdir(folder) and any(
        os.path.isfile(os.path.join(folder, f)) for f in PROCESSOR_FILES)


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def processor_class(folder: str) -> str | None:
    """The processor class a folder names (its processor files, else its config's model type)."""
    for name in ("processor_config.json", "preprocessor_config.json"):
        found = _read(os.path.join(folder, name)).get("processor_class")
        if isinstance(found, str):
            return found
    model_type = _read(os.path.join(folder, "config.json")).get("model_type")
    if not isinstance(model_type, str):
        return None
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
    return PROCESSOR_MAPPING_NAMES.get(model_type)


def reason(e: BaseException, limit: int = 300) -> str:
    """The first line of an exception that says something (transformers' ImportErrors open with a
    newline), at most `limit` characters; its class's name where it says nothing."""
    said = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return (said or type(e).__name__)[:limit]


def _install_hint(e: BaseException) -> str:
    """What to install where transformers could not build the processor for want of torchvision (an
    ImportError naming it) and this environment lacks it; nothing for any other failure."""
    if not isinstance(e, ImportError) or "torchvision" not in str(e).lower():
        return ""
    return "; pip install torchvision (the build that matches your torch)" \
        if importlib.util.find_spec("torchvision") is None else ""


def _missing(folder: str) -> list[str]:
    return [m for m in NEEDS.get(processor_class(folder) or "", ()) if importlib.util.find_spec(m) is None]


class Media:
    """A model folder's processor, and what tokenising and batching need of it."""

    def __init__(self, folder: str):
        missing = _missing(folder)
        if missing:
            raise ArgumentError(f"the processor in {folder} ({processor_class(folder)}) is built by transformers only "
                                f"with {' and '.join(missing)}, which this environment lacks: pip install "
                                f"{' '.join(missing)}")
        try:
            from transformers import AutoProcessor
            self.processor = AutoProcessor.from_pretrained(folder)
        except Exception as e:  # noqa: BLE001 - transformers' own message, with the folder named
            raise ArgumentError(f"cannot load the processor from {folder} ({processor_class(folder)}): "
                                f"{reason(e)}{_install_hint(e)}") from e
        token = getattr(self.processor, "image_token", None)
        tokenizer = getattr(self.processor, "tokenizer", None)
        if token is None or getattr(self.processor, "image_processor", None) is None or tokenizer is None:
            raise ArgumentError(f"the processor in {folder} ({type(self.processor).__name__}) has no image token, "
                                "image processor or tokenizer: records with images need a vision-language "
                                "model's processor (e.g. LlavaProcessor)")
        self._start(folder, token, tokenizer)
        # the tokens that stand for image features in the processor's rows (Gemma 3: its soft
        # tokens, not the begin-of-image token its text writes)
        found = [i for i in (getattr(self.processor, "image_token_ids", None) or []) if isinstance(i, int)]
        self.image_ids = found or [self.token_id]
        self.token_id = self.image_ids[0]
        self.token_keys: set[str] = set(self._probe())

    def _start(self, folder: str, token: str, tokenizer) -> None:
        self.folder, self.token = folder, token
        self.token_id = tokenizer.convert_tokens_to_ids(token)
        self.written = token    # what each <image> of a turn becomes before the template renders it
        self.written_video = VIDEO      # and each <video> (a processor that takes videos: its own)
        self.video_settings = None      # how videos are read (videos.Settings), for a processor that takes them
        self.written_id = self.token_id
        self.base = "."         # the folder the current data entry's image paths are relative to
        self.media_dir = None   # run.yaml's media_dir, where given: that folder
        self.embedded = None    # where images held inside records are written (keep_embedded_in)
        self.limits = None      # pixels.Limits the images are read within (pixels.attach), or none
        self._widths: dict[str, int] = {}
        self._pixels = PixelCache(self._load_pixels)

    def _probe(self) -> list[str]:
        """The per-token inputs (beside input_ids) the processor writes for a text with an image."""
        from PIL import Image
        out = self.processor(text=[self.written], images=[[Image.new("RGB", (32, 32))]], add_special_tokens=False)
        n = len(out["input_ids"][0])
        return [k for k, v in out.items() if k not in TEXT_KEYS and isinstance(v, list) and v
                and isinstance(v[0], list) and len(v[0]) == n and all(isinstance(x, int) for x in v[0])]

    @property
    def pad_token_id(self) -> int | None:
        """The padding token of the tokenizer the processor writes with (an export reads it)."""
        return (self.tokenizer if hasattr(self, "tokenizer") else self.processor.tokenizer).pad_token_id

    @property
    def eos_token_id(self) -> int | None:
        return (self.tokenizer if hasattr(self, "tokenizer") else self.processor.tokenizer).eos_token_id

    def save_pretrained(self, path: str) -> None:
        """The processor's files (tokenizer, image processor, chat template) beside an export."""
        self.processor.save_pretrained(path)

    def chat_template(self):
        return getattr(self.processor, "chat_template", None)

    def use_template(self, template: str) -> None:
        """The run's chat template (run.yaml's chat_template) in place of the processor's own: what
        the processor writes, and what its export saves."""
        self.processor.chat_template = template

    def at(self, entry_path: str, media_dir: str | None = None) -> None:
        """Image paths of the next records are relative to this data entry (a file's folder, or
        the folder itself), or to `media_dir` (LlamaFactory's) where the run gives one."""
        self.media_dir = media_dir
        self.base = media_dir or (entry_path if os.path.isdir(entry_path) else os.path.dirname(entry_path))

    def paths(self, record: dict, where: str) -> list:
        """The record's media, checked: its image files (absolute paths that exist), then its videos
        ({"video": path}; a processor that takes videos only: videos_within)."""
        if "images" not in record and record.get("image") is not None:     # TRL's one-image column
            record = {**record, "images": [record["image"]]}
        images = self._files(record, "images", where)
        clips = self._files(record, "videos", where)
        if clips and self.video_settings is None:
            raise ArgumentError(f"{where}: the record has videos, and the processor in {self.folder} "
                                f"({processor_class(self.folder)}) takes none: records with videos train with "
                                "Qwen2.5-VL and Qwen3-VL; give the video's frames as images, or leave the record out")
        return images + [{"video": p} for p in clips]

    def keep_embedded_in(self, folder: str) -> None:
        """Images a record holds inside it (a table's Image column) are written to this folder
        (embedded.py), and read from there like any image file."""
        self.embedded = folder

    def _files(self, record: dict, key: str, where: str) -> list[str]:
        found = record.get(key)
        if found is None:
            return []
        kind = key[:-1]
        if key == "images" and isinstance(found, list):
            found = [embedded.path(p, self.embedded, where) for p in found]
        if not isinstance(found, list) or not all(isinstance(p, str) and p for p in found):
            raise ArgumentError(f"{where}: {key} must be a list of {kind} file paths (relative to the data file)"
                                + (", or of images held in the table (an Image column)" if kind == "image" else "")
                                + f"; got {str(found)[:200]}")
        out = []
        for p in found:
            path = os.path.abspath(os.path.join(self.base, p))
            if not os.path.isfile(path):
                raise ArgumentError(f"{where}: {kind} {p} is not there ({path}); {kind} paths are relative to "
                                    + (f"media_dir ({self.media_dir})" if self.media_dir else
                                       "the data file's folder (or to media_dir, where the run gives one)"))
            out.append(path)
        return out

    def videos_within(self, settings) -> None:
        """Records with videos are read with these settings (videos.Settings); only a processor that
        takes videos (grid_images.GridMedia) has any."""

    def messages(self, messages: list, paths: list, where: str, lists_only: bool = False) -> list:
        """The turns with each `<image>` (`<video>`) written as the processor's image (video) token,
        after checking that the placeholders number the images (videos); a conversation that marks
        none of its images is laid out as TRL lays it out (parts.images_first). `lists_only`: the
        chat template reads only list contents, and each string content is made the parts it stands
        for (list_contents.py)."""
        if not isinstance(messages, list):
            return messages         # masking.chat refuses it with the line
        messages = parts.images_first(messages, len(images_of(paths)), PLACEHOLDER, where)
        if lists_only:
            messages = list_contents.as_parts(messages, {PLACEHOLDER: "image", VIDEO: "video"})
        texts = [m.get("content") for m in messages if isinstance(m, dict)]
        written = {}
        for placeholder, kind, files, token in ((PLACEHOLDER, "image", images_of(paths), self.written),
                                                (VIDEO, "video", videos_of(paths), self.written_video)):
            count = sum(t.count(placeholder) if isinstance(t, str) else parts.count(t, kind) if parts.is_parts(t)
                        else 0 for t in texts)
            if count != len(files):
                raise ArgumentError(f"{where}: the turns hold {count} {placeholder} placeholder{'s' * (count != 1)} "
                                    f"({kind} parts counted) and {kind}s lists {len(files)} "
                                    f"file{'s' * (len(files) != 1)}: each {placeholder} (or {{type: {kind}}} part) "
                                    f"stands for one {kind}, in order; make them agree")
            if count and token != placeholder:
                written[placeholder] = token
        if not written:
            return messages
        return [{**m, "content": _written(m["content"], written)}
                if isinstance(m, dict) and isinstance(m.get("content"), str) else m for m in messages]

    def _rendered(self, ids: list[int], paths: list[str], where: str) -> list[int]:
        """Where the chat template rendered the images (their `written` tokens), checked."""
        at = [i for i, t in enumerate(ids) if t == self.written_id]
        if len(at) != len(paths):
            raise ArgumentError(f"{where}: the chat template rendered {len(at)} image token{'s' * (len(at) != 1)} "
                                f"({self.written}) for {len(paths)} image{'s' * (len(paths) != 1)}: the template "
                                "must write each turn's text as it is (string contents), and an image part as that "
                                "token")
        return at

    def widen(self, ids: list[int], targets: list[bool], paths: list[str], where: str, tokenizer=None,
              messages: list | None = None, options: dict | None = None,
              generation_prompt: bool = False) -> tuple[list, list]:
        """The document as the processor writes the rendered conversation with its images, and
        its targets carried over from the masked rendering (`ids`, `targets`), no image token
        among them. `options`: the template's arguments the masked rendering took (tools,
        chat_template_kwargs); `generation_prompt`: it was rendered with the generation prompt
        (a prompt to sample from)."""
        at = self._rendered(ids, paths, where)
        tokenizer = tokenizer if tokenizer is not None else self.processor.tokenizer
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **(options or {}))
        pictures = [self._open(p, where) for p in paths]
        try:
            out = self.processor(text=[text], images=[pictures], add_special_tokens=False)
        except Exception as e:  # noqa: BLE001 - transformers' own words, with the record named
            raise ArgumentError(f"{where}: the processor ({type(self.processor).__name__}) refused the record: "
                                f"{reason(e)}") from e
        row = [int(t) for t in out["input_ids"][0]]
        for key in self.token_keys:
            written = [int(x) for x in out[key][0]]
            if written != self.token_types(row):
                raise ArgumentError(f"{where}: the processor writes {key} that are not 1 exactly on its image tokens "
                                    f"(ids {self.image_ids}): megacompile makes them from input_ids when a "
                                    "micro-batch is read, and cannot make these")
        placed = list(targets)
        for i in at:
            placed[i] = False
        return row, targets_on(ids, placed, row, set(self.image_ids), where)

    def token_types(self, row: list[int]) -> list[int]:
        return [int(t in self.image_ids) for t in row]

    def pixels(self, paths: list[str]):
        """pixel_values for these images, in order (one batch dimension entry per image)."""
        import torch
        return torch.cat([self._pixels(p)["pixel_values"] for p in paths])

    def inputs(self, rows: list[list[str]], input_ids) -> dict:
        """The image inputs of a micro-batch whose rows hold these images (a list per row), laid out
        as the processor lays out a batch, and the per-token inputs it writes (token_type_ids)."""
        import torch
        paths = [p for row in rows for p in row]
        loaded = [self._pixels(p) for p in paths]
        if loaded[0]["pixel_values"].dim() == 5:        # padded per row (Idefics3, SmolVLM)
            out = _padded(rows, self._pixels)
        else:
            out = {k: torch.cat([x[k] for x in loaded]) for k in loaded[0]}
        for key in self.token_keys:
            out[key] = torch.isin(input_ids, torch.tensor(self.image_ids)).to(torch.int64)
        return out

    def check_packing(self, packing: bool | str, tokens) -> None:
        """Whether documents with images can train under this packing (they fill rows of their own)."""

    def pixel_elements(self, item) -> int:
        """The elements of an image's (a video's) pixel values, as a batch holding it carries them."""
        import torch
        made = self.inputs([[item]], torch.zeros(1, 1, dtype=torch.long))
        return sum(v.numel() for k, v in made.items() if k.startswith("pixel_values"))

    def _load_pixels(self, path: str) -> dict:
        """The image processor's tensors for this image alone, batch dimension first."""
        import torch
        out = self.processor.image_processor(images=[self._open(path, path)], return_tensors="pt")
        unused = set(getattr(self.processor, "unused_input_names", None) or ())
        names = set(getattr(self.processor.image_processor, "model_input_names", None) or ("pixel_values",))
        return {k: v.float() if k == "pixel_values" else v for k, v in out.items()
                if isinstance(v, torch.Tensor) and k in names | {"pixel_values"} and k not in unused}

    def _open(self, path: str, where: str):
        """The image, in RGB, scaled within the run's pixel limits when given (`limits`, set by
        pixels.attach)."""
        from PIL import Image
        try:
            with Image.open(path) as image:
                image = image.convert("RGB")
        except Exception as e:  # noqa: BLE001 - PIL's own words, with the file named
            raise ArgumentError(f"{where}: cannot read image {path}: {reason(e, 200)}") from e
        if self.limits is None:
            return image
        from .pixels import fit
        return fit(image, self.limits)


class PixelCache:
    """Each image's processed pixels, read once and kept while the images last read fill at most
    LIMIT bytes: a step reads a micro-batch's images in each of its passes (the reference's, the
    policy's, the step's), and a dataset of large images must not pile up in host memory beside the
    run's planned state (a 768 x 768 image is 14 MiB of Qwen patches in float32). LIMIT is a bound
    the run counts beside that state (train/beside.py), so an image past it alone is not kept: it is
    processed at each read."""
    LIMIT = 256 * 2 ** 20

    def __init__(self, load):
        self.load, self.kept, self.held = load, OrderedDict(), 0

    def __call__(self, path):
        if path in self.kept:
            self.kept.move_to_end(path)
            return self.kept[path][0]
        made = self.load(path)
        size = sum(t.numel() * t.element_size() for t in (made.values() if isinstance(made, dict) else made)
                   if hasattr(t, "element_size"))
        self.kept[path] = (made, size)
        self.held += size
        while self.held > self.LIMIT:
            _, (_, dropped) = self.kept.popitem(last=False)
            self.held -= dropped
        return made


def targets_on(ids: list[int], targets: list[bool], row: list[int], image_ids: set, where: str) -> list[bool]:
    """`row`'s targets: those of the tokens it shares with `ids` (matched in order), none elsewhere."""
    out = [False] * len(row)
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, ids, row, autojunk=False).get_opcodes():
        if tag == "equal":
            out[j1:j2] = targets[i1:i2]
        elif any(targets[i1:i2]):
            raise ArgumentError(f"{where}: the processor tokenises the answer differently from the chat template's "
                                "rendering (around an image?), so its tokens cannot be told apart; put the images "
                                "in the user's turns, away from the answer")
    return [t and r not in image_ids for t, r in zip(out, row)]


def _padded(rows: list[list[str]], load) -> dict:
    """Idefics3's layout: [rows, most images in a row, 3, H, W], each image's crops in turn, padded
    with zeros to the batch's most crops and its largest height and width; pixel_attention_mask
    marks the real pixels."""
    import torch
    crops = [[(x["pixel_values"][0], x.get("pixel_attention_mask")) for x in map(load, row)] for row in rows]
    shapes = [pv.shape for row in crops for pv, _ in row]
    most = max(sum(pv.shape[0] for pv, _ in row) for row in crops)
    h, w = max(s[-2] for s in shapes), max(s[-1] for s in shapes)
    masks = [m for row in crops for _, m in row if m is not None]
    pixels = torch.zeros(len(rows), most, shapes[0][1], h, w)
    mask = torch.zeros(len(rows), most, h, w, dtype=masks[0].dtype if masks else torch.int64)
    for r, row in enumerate(crops):
        k = 0
        for pv, m in row:
            n, _, ph, pw = pv.shape
            pixels[r, k:k + n, :, :ph, :pw] = pv
            mask[r, k:k + n, :ph, :pw] = m[0] if m is not None else 1
            k += n
    return {"pixel_values": pixels, "pixel_attention_mask": mask}


def held(record: dict) -> bool:
    """Whether a record brings images or videos (`images`, TRL's `image`, `videos`)."""
    return bool(record.get("images") or record.get("videos") or record.get("image") is not None)


def text_only(record: dict, where: str, stage: str) -> None:
    """Refuse a record with images or videos under a post-training stage (dpo, kto, grpo, rm) of a
    model without a processor: trained without its pixels, its placeholders would be plain tokens."""
    if not held(record):
        return
    kind = "videos" if record.get("videos") else "images"
    raise ArgumentError(f"{where}: the record has {kind}, which stage {stage} reads only through a vision-language "
                        f"model's processor ({' or '.join(PROCESSOR_FILES)} in the model folder): give such a "
                        "model, or text records")


def images_of(items: list) -> list[str]:
    """The image files of a document's media (paths), in order."""
    return [p for p in items if isinstance(p, str)]


def videos_of(items: list) -> list[str]:
    """The video files of a document's media ({"video": path}), in order."""
    return [p["video"] for p in items if isinstance(p, dict)]


def counted(media: list) -> str:
    """", N with images" (or videos, or images or videos) of documents' media lists, for a stage's
    line; "" where none shows any."""
    shown = sum(bool(m) for m in media)
    if not shown:
        return ""
    kinds = [k for k, found in (("images", any(images_of(m) for m in media)),
                                ("videos", any(videos_of(m) for m in media))) if found]
    return f", {shown} with {' or '.join(kinds)}"


def _written(text: str, written: dict) -> str:
    for placeholder, token in written.items():
        text = text.replace(placeholder, token)
    return text
