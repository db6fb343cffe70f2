"""Tiny model folders saved with each vision-language family's own processor class, made on the
spot (no downloads), and a record with two images of different sizes.

The tokenizer is a byte-level BPE trained here on a few lines (as GPT-2's, Llama 3's and Qwen's
are), so that the text around an image tokenises as a real tokenizer does: the newlines Gemma 3's
and Idefics3's processors write around an image merge with the template's own ("\\n" + "\\n\\n"
is not "\\n\\n" + "\\n"). The chat template writes string contents between role tags and newlines.

- llava: LlavaProcessor, CLIPImageProcessor at 16 x 16 pixels in 4 x 4 patches: 16 image tokens.
- gemma3: Gemma3Processor, 4 soft tokens per image between `<start_of_image>` and `<end_of_image>`,
  newlines around, token_type_ids marking the soft tokens.
- idefics3 / smolvlm: Idefics3Processor / SmolVLMProcessor, images resized to 32 pixels on their
  long side and cut into 16 x 16 crops (rows and columns tokens) plus the global image, each
  4 image tokens between `<fake_token_around_image>` tokens.
- qwen2_vl / qwen2_5_vl / qwen3_vl: qwen_files.py's processor files (Qwen2VLImageProcessor, 4 x 4 patches
  merged 2 x 2) over this tokenizer with Qwen's vision tokens.
"""
from __future__ import annotations

import json
import os

from tests.train import files, qwen_files, vlm_files

FAMILIES = ("llava", "gemma3", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN_PROCESSORS = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GEMMA3_TOKENS = 4
GEMMA3 = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
IDEFICS3 = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"] + \
    [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
SIZES = {"red": (32, 16), "green": (16, 16), "blue": (16, 8)}       # width, height
RECORD = {"messages": [{"role": "user", "content": "<image> what colour is this\n<image> and this?"},
                       {"role": "assistant", "content": "red, then blue"}],
          "images": ["images/red.png", "images/blue.png"]}
# RECORD in TRL's layout: the turns as lists of parts
PARTS = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " what colour is this\n"},
                                                   {"type": "image"}, {"type": "text", "text": " and this?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "red, then blue"}]}],
         "images": RECORD["images"]}


def parts_template(image: str) -> str:
    """TEMPLATE, reading list contents (TRL's parts) as the vision templates do: `image` for an
    image part."""
    return ("{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] is string %}{{ m['content'] }}{% else %}"
            "{% for p in m['content'] %}{% if p['type'] == 'image' %}" + image + "{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def tokenizer(special: list[str], attributes: dict | None = None):
    """A byte-level BPE of 320 tokens, with files.py's special tokens and `special`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    lines = [s + end for s in files.SENTENCES + vlm_files.WORDS + ["what colour is this", "and this?",
                                                                    "red, then blue"]
             for end in ("\n", "\n\n", " ")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines * 3, trainers.BpeTrainer(
        vocab_size=320, special_tokens=files.SPECIAL + special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", extra_special_tokens=attributes or {})


def processor(family: str):
    """The family's processor (llava, gemma3, idefics3; smolvlm needs torchvision and num2words)."""
    import transformers
    if family == "llava":
        images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
        return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer(["<image>"]), patch_size=4,
                                           vision_feature_select_strategy="default", num_additional_image_tokens=1,
                                           chat_template=TEMPLATE)
    if family == "gemma3":
        images = transformers.Gemma3ImageProcessorPil(size={"height": 16, "width": 16})
        return transformers.Gemma3Processor(image_processor=images, tokenizer=tokenizer(list(GEMMA3.values()), GEMMA3),
                                            image_seq_length=GEMMA3_TOKENS, chat_template=TEMPLATE)
    if family in ("idefics3", "smolvlm"):
        kind = "Idefics3" if family == "idefics3" else "SmolVLM"
        images = getattr(transformers, f"{kind}ImageProcessorPil")(
            size={"longest_edge": 32}, max_image_size={"longest_edge": 16}, do_image_splitting=True)
        tok = tokenizer(IDEFICS3)
        if family == "idefics3":
            return transformers.Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                                  chat_template=TEMPLATE)
        return transformers.SmolVLMProcessor(image_processor=images, tokenizer=tok, image_seq_len=4,
                                             video_processor=transformers.SmolVLMVideoProcessor(),
                                             chat_template=TEMPLATE)
    raise ValueError(family)


def folder(path: str, family: str) -> str:
    """A folder holding the family's processor as its own class saves it (no weights)."""
    os.makedirs(path, exist_ok=True)
    if family in QWEN_PROCESSORS:
        qwen_files._processor_files(path, tokenizer(qwen_files.VISION), QWEN_PROCESSORS[family])
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(TEMPLATE)
        return path
    if family == "smolvlm" and not smolvlm_builds():
        return smolvlm_files(path)
    processor(family).save_pretrained(path)
    return path


def smolvlm_builds() -> bool:
    import importlib.util
    return all(importlib.util.find_spec(m) is not None for m in ("torchvision", "num2words"))


def smolvlm_files(path: str) -> str:
    """SmolVLM's processor files as its hub folders lay them out, written without building it
    (transformers builds SmolVLMProcessor only with torchvision and num2words)."""
    import transformers
    tokenizer(IDEFICS3).save_pretrained(path)
    images = transformers.SmolVLMImageProcessorPil(size={"longest_edge": 32}, max_image_size={"longest_edge": 16})
    images.save_pretrained(path)
    with open(os.path.join(path, "processor_config.json"), "w") as f:
        json.dump({"processor_class": "SmolVLMProcessor", "image_seq_len": 4}, f)
    return path


def qwen_processor(path: str, family: str):
    """Qwen2VLProcessor / Qwen2_5_VLProcessor / Qwen3VLProcessor over the folder's tokenizer and image processor.
    transformers builds them only with a video processor (torchvision): without it, the
    constructor's class check is let pass for the absent video processor, the rest as it is."""
    import transformers
    from transformers.processing_utils import ProcessorMixin
    tok = transformers.AutoTokenizer.from_pretrained(path)
    images = transformers.AutoImageProcessor.from_pretrained(path, backend="pil")
    cls = getattr(transformers, QWEN_PROCESSORS[family])
    check = ProcessorMixin.check_argument_for_proper_class

    def lenient(self, name, argument):
        return None if argument is None and name == "video_processor" else check(self, name, argument)
    ProcessorMixin.check_argument_for_proper_class = lenient
    try:
        return cls(image_processor=images, tokenizer=tok, video_processor=None, chat_template=TEMPLATE)
    finally:
        ProcessorMixin.check_argument_for_proper_class = check


def images(where: str) -> dict[str, str]:
    """vlm_files.images at this file's SIZES."""
    return vlm_files.images(where, SIZES)


def data(path: str, records: list[dict] | None = None) -> str:
    """RECORD (or `records`) in a jsonl file, the images beside it."""
    images(os.path.dirname(path))
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in (records or [RECORD]))
    return path


# the towers' and language models' sizes of the tiny folders (tests/vlm_families.py's)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
             patch_size=4)


def _text(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, use_cache=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id)


def gemma3_dir(path: str, seed: int = 0) -> str:
    """A tiny Gemma 3 (tests/vlm_families.py's sizes) saved with its processor: the tower's 16
    patches of 4 x 4 pixels pooled 2 x 2 into GEMMA3_TOKENS image tokens."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    proc = processor("gemma3")
    tok = proc.tokenizer
    torch.manual_seed(seed)
    vision = SiglipVisionConfig(**TOWER)
    text = Gemma3TextConfig(**_text(tok), head_dim=8, max_position_embeddings=128, sliding_window=8,
                            layer_types=["sliding_attention", "full_attention"])
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS,
                          image_token_index=tok.image_token_id, boi_token_index=tok.boi_token_id,
                          eoi_token_index=tok.convert_tokens_to_ids(GEMMA3["eoi_token"]))
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():   # zero-initialised in transformers: random, so that the features carry gradient
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=1.0)
    model.save_pretrained(path)
    proc.save_pretrained(path)
    return path


def gemma3_records(path: str, n: int = 6) -> str:
    """Chat records showing one or two of the images (every third record two), answers naming
    their colours."""
    names = sorted(SIZES)
    records = []
    for i in range(n):
        shown = [names[i % 3]] + ([names[(i + 1) % 3]] if i % 3 == 2 else [])
        records.append({"messages": [{"role": "user", "content": " ".join("<image>" for _ in shown)
                                      + " what colour is this?"},
                                     {"role": "assistant", "content": ", then ".join(shown)}],
                        "images": [f"images/{c}.png" for c in shown]})
    return data(path, records)


def idefics3_dir(path: str, seed: int = 0, family: str = "idefics3") -> str:
    """A tiny Idefics3 (tests/vlm_families.py's sizes) saved with its processor: 16 x 16 crops of
    4 x 4 patches shuffled 2 x 2 into 4 image tokens each. `family` "smolvlm": SmolVLM's classes
    (its processor needs torchvision and num2words)."""
    import torch
    import transformers
    kind = "Idefics3" if family == "idefics3" else "SmolVLM"
    proc = processor(family)
    tok = proc.tokenizer
    torch.manual_seed(seed)
    vision = getattr(transformers, f"{kind}VisionConfig")(**TOWER)
    text = transformers.LlamaConfig(**_text(tok), max_position_embeddings=256)
    config = getattr(transformers, f"{kind}Config")(
        text_config=text.to_dict(), vision_config=vision.to_dict(), scale_factor=2,
        image_token_id=tok.convert_tokens_to_ids("<image>"), use_cache=False, pad_token_id=tok.pad_token_id)
    getattr(transformers, f"{kind}ForConditionalGeneration")(config).save_pretrained(path)
    proc.save_pretrained(path)
    return path


def model_dir(path: str, family: str, seed: int = 0) -> str:
    """A tiny folder of the family with weights and its processor's files, as a download lays it out."""
    if family == "llava":
        return vlm_files.model_dir(path, seed)
    if family == "gemma3":
        return gemma3_dir(path, seed)
    if family in ("idefics3", "smolvlm"):
        return idefics3_dir(path, seed, family)
    if family in ("qwen2_5_vl", "qwen3_vl", "qwen3_5"):
        return qwen_files.model_dir(path, seed, family)
    raise ValueError(f"no tiny folder of {family}")

