"""A record with images becomes, token for token, what the model's own processor writes for it:
for each family with a processor (processor_files.py), a folder saved with its own processor
class, a record with two images of different sizes tokenised through megacompile's token file,
and the same conversation rendered with the chat template and run through the processor. The
row, its per-token inputs (token_type_ids), the micro-batch's image inputs (pixel_values,
pixel_attention_mask, image_grid_thw) are the processor's; the loss counts the answer alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train.data import grid_images, packing
from megacompile.train.data.images import Media
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests import torchvision_env
from tests.train import processor_files

QWEN = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"     # what Qwen's chat templates write for an image
# the tokens a family's processor writes for an image, besides the text's (none may be a target)
IMAGE_TOKENS = {"llava": ["<image>"], "gemma3": list(processor_files.GEMMA3.values()),
                "idefics3": processor_files.IDEFICS3, "smolvlm": processor_files.IDEFICS3,
                "qwen2_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                "qwen2_5_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"],
                "qwen3_vl": ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]}


def _theirs(model: str, family: str):
    if family in QWEN:
        return processor_files.qwen_processor(model, family)
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model)


def _ours(tmp_path, family: str, records: list[dict] | None = None):
    model = processor_files.folder(str(tmp_path / "model"), family)
    data = processor_files.data(str(tmp_path / "data.jsonl"), records)
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    if not tokenizer.chat_template:
        tokenizer.chat_template = media.chat_template()     # as megacompile train does
    return model, media, tokenizer, token_file(str(tmp_path / "tokens"), "train", [data], tokenizer, model, False,
                                               media)


def _processed(processor, family: str, records: list[dict], where) -> dict:
    """What the processor writes for these records: the chat template's text, images in order."""
    from PIL import Image
    written = QWEN_IMAGE if family in QWEN else processor.image_token
    texts = [processor.apply_chat_template([{**m, "content": m["content"].replace("<image>", written)}
                                            for m in r["messages"]], tokenize=False) for r in records]
    pictures = [[Image.open(where / p).convert("RGB") for p in r["images"]] for r in records]
    return processor(text=texts, images=pictures, add_special_tokens=False, return_tensors="pt",
                     padding=len(records) > 1)


@pytest.mark.parametrize("family", processor_files.FAMILIES)
def test_a_record_with_images_is_the_processors_row_and_its_answer_alone_is_counted(tmp_path, family):
    if family == "smolvlm" and not processor_files.smolvlm_builds():     # SmolVLMProcessor needs torchvision
        torchvision_env.call(_row_is_the_processors, str(tmp_path), family)
    else:
        _row_is_the_processors(str(tmp_path), family)


def _row_is_the_processors(folder: str, family: str) -> None:
    from pathlib import Path
    tmp_path = Path(folder)
    model, media, tokenizer, tokens = _ours(tmp_path, family)
    record = processor_files.RECORD
    theirs = _processed(_theirs(model, family), family, [record], tmp_path)
    row = np.asarray(tokens.ids[tokens.docs[0]:tokens.docs[1]]).tolist()
    targets = np.asarray(tokens.targets[tokens.docs[0]:tokens.docs[1]]).astype(bool)
    # the document: the processor's tokens, then the EOS that closes every document
    assert row == theirs["input_ids"][0].tolist() + [tokenizer.eos_token_id]
    image = tokenizer.convert_tokens_to_ids(IMAGE_TOKENS[family])
    assert sum(t in image for t in row) > 2 * len(record["images"])     # the images' tokens and their wrappers
    # the loss counts the answer, its end and the EOS: no image token, no prompt token
    answer = tokenizer(record["messages"][1]["content"] + "<|end|>\n", add_special_tokens=False)["input_ids"]
    assert [t for t, on in zip(row, targets) if on] == answer + [tokenizer.eos_token_id]
    assert not any(on for t, on in zip(row, targets) if t in image)
    assert targets[len(row) - len(answer) - 1:].all() and not targets[:len(row) - len(answer) - 1].any()

    # the micro-batch that holds the document: the processor's image inputs and per-token inputs
    rows = packing.Rows(tokens, len(row) + 3, False, 0, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    inputs = packing.batch(rows, 0, 1, shifted=False)
    assert inputs["input_ids"][0, :len(row)].tolist() == row
    expected = {k: v for k, v in theirs.items() if k not in ("input_ids", "attention_mask")}
    assert set(inputs) - {"input_ids", "labels"} == set(expected) != set()
    for key, value in expected.items():
        got = inputs[key][:, :len(row) - 1] if value.shape[-1] == len(row) - 1 and value.dim() == 2 else inputs[key]
        assert got.dtype == value.dtype or key == "pixel_values", key
        torch.testing.assert_close(got.to(value.dtype), value, rtol=0, atol=0, msg=key)
    if family == "gemma3":     # token_type_ids: 1 exactly on the soft tokens, as HF builds them
        soft = tokenizer.convert_tokens_to_ids(processor_files.GEMMA3["image_token"])
        assert torch.equal(inputs["token_type_ids"], (inputs["input_ids"] == soft).long())
        assert int(inputs["token_type_ids"].sum()) == 2 * processor_files.GEMMA3_TOKENS


def test_idefics3_rows_of_a_micro_batch_pad_their_crops_as_the_processor_pads_a_batch(tmp_path):
    """Two documents, one with two images (1 x 2 crops and a global image each) and one with one
    image of another size (2 x 2 crops and its global image): pixel_values [2, 6, 3, 16, 16], the
    second row's missing crop zeros, pixel_attention_mask as the processor writes them for the two
    texts together."""
    one = {"messages": [{"role": "user", "content": "<image> what colour is this"},
                        {"role": "assistant", "content": "green"}], "images": ["images/green.png"]}
    model, media, tokenizer, tokens = _ours(tmp_path, "idefics3", [processor_files.RECORD, one])
    rows = packing.Rows(tokens, 96, False, 0, shuffle=False, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    inputs = packing.batch(rows, 0, 2, shifted=False)
    theirs = _processed(_theirs(model, "idefics3"), "idefics3", [processor_files.RECORD, one], tmp_path)
    assert inputs["pixel_values"].shape == theirs["pixel_values"].shape == (2, 6, 3, 16, 16)
    torch.testing.assert_close(inputs["pixel_values"], theirs["pixel_values"], rtol=0, atol=0)
    assert torch.equal(inputs["pixel_attention_mask"], theirs["pixel_attention_mask"])
    assert inputs["pixel_attention_mask"].flatten(2).any(2).sum(1).tolist() == [6, 5]


def test_smolvlm_without_torchvision_is_refused_with_what_to_install(tmp_path, monkeypatch):
    """transformers builds SmolVLMProcessor only with torchvision (its video processor) and
    num2words: a SmolVLM folder laid out as on the hub names what to install."""
    import importlib.util
    model = processor_files.smolvlm_files(str(tmp_path / "model"))
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchvision" else find(name, *a))
    with pytest.raises(ArgumentError, match=r"\(SmolVLMProcessor\) is built by transformers only with torchvision"
                                            r".*: pip install torchvision"):
        grid_images.media(model)


@pytest.mark.parametrize("torchvision", [False, True])
def test_a_processor_that_fails_to_load_is_refused_with_transformers_reason(tmp_path, monkeypatch, torchvision):
    """transformers' ImportErrors open with a newline: the reason given is their first line that says
    something, and torchvision is named only where it is missing and transformers failed for want of it."""
    import importlib.util

    import transformers
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        (find("torch") if torchvision else None) if name == "torchvision" else find(name, *a)))
    wants = ImportError("\nLlavaVideoProcessor requires the Torchvision library but it was not found in your "
                        "environment.\nPlease note that you may need to restart your runtime.")
    other = ValueError("\n\nUnrecognized image processor: its torchvision backend holds no size")
    for failure, advised in ((wants, not torchvision), (other, False)):
        def fail(*args, failure=failure, **kwargs):
            raise failure
        monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", fail)
        with pytest.raises(ArgumentError) as refused:
            Media(model)
        said, first = str(refused.value), str(failure).strip().splitlines()[0]
        assert said.startswith(f"cannot load the processor from {model} (LlavaProcessor): {first}"), said
        assert ("pip install torchvision" in said) == advised, said


def test_a_template_that_drops_an_image_is_refused_naming_the_record(tmp_path):
    model = processor_files.folder(str(tmp_path / "model"), "gemma3")
    media = Media(model)
    tokenizer = load_tokenizer(model)
    # a template that writes a string turn without its image token: the turn's text is not written
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | "
                               "replace('<start_of_image>', '') }}<|end|>\n{% endfor %}")
    data = processor_files.data(str(tmp_path / "data.jsonl"))
    with pytest.raises(ArgumentError, match=r"data.jsonl:1: the chat template does not write turn 0 \(role 'user'\)"):
        token_file(str(tmp_path / "tokens"), "train", [data], tokenizer, model, False, media)
    # one that writes a turn's text parts and leaves its image parts out
    tokenizer.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{% for p in m['content'] %}"
                               "{% if p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}<|end|>\n{% endfor %}")
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " what colour is this"},
                                          {"type": "image"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "red, then blue"}]}]
    data = processor_files.data(str(tmp_path / "parts.jsonl"), [{**processor_files.RECORD, "messages": parts}])
    with pytest.raises(ArgumentError, match=r"parts.jsonl:1: the chat template rendered 0 image tokens "
                                            r"\(<start_of_image>\) for 2 images"):
        token_file(str(tmp_path / "tokens"), "train", [data], tokenizer, model, False, media)


def test_an_image_inside_the_answer_is_never_a_target(tmp_path):
    """An image in the assistant's turn: its tokens and wrappers are not targets, the answer's
    words around it are."""
    inside = {"messages": [{"role": "user", "content": "describe the picture"},
                           {"role": "assistant", "content": "this <image> is red"}], "images": ["images/red.png"]}
    model, media, tokenizer, tokens = _ours(tmp_path, "gemma3", [inside])
    row = np.asarray(tokens.ids[tokens.docs[0]:tokens.docs[1]]).tolist()
    targets = np.asarray(tokens.targets[tokens.docs[0]:tokens.docs[1]]).astype(bool)
    theirs = _processed(_theirs(model, "gemma3"), "gemma3", [inside], tmp_path)
    assert row == theirs["input_ids"][0].tolist() + [tokenizer.eos_token_id]
    image = set(tokenizer.convert_tokens_to_ids(list(processor_files.GEMMA3.values())))
    counted = [t for t, on in zip(row, targets) if on]
    assert counted and not image & set(counted)
    words = tokenizer.decode(counted)
    assert "this" in words and "red" in words and "describe" not in words


def test_a_token_file_with_images_is_reused_with_its_images(tmp_path):
    """The token file made for a processor's rows is read back, not made again, its documents'
    image files with it."""
    from megacompile.train.data.tokens import commit
    model, media, tokenizer, made = _ours(tmp_path, "gemma3")
    commit(made, str(tmp_path / "tokens"))
    again = token_file(str(tmp_path / "tokens"), "train", [str(tmp_path / "data.jsonl")], tokenizer, model, False,
                       media)
    assert again.staged is None and again.fingerprint == made.fingerprint
    assert again.images == made.images and len(again.images[0][1]) == 2


# llava-hf's chat template: it reads only list contents, and writes nothing of a string
LLAVA_HF = ("{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
            "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
            "{{ '<image>\n' }}{% endfor %}{% if message['role'] != 'assistant' %}{% for content in message['content'] "
            "| selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}{% endfor %}{% else %}"
            "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{% generation %}"
            "{{ content['text'] + ' '}}{% endgeneration %}{% endfor %}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}")


def test_placeholder_strings_for_a_template_that_reads_only_lists_are_its_parts_row(tmp_path):
    """LlamaFactory's strings with <image> placeholders, for llava-hf's template: the row is what
    the processor writes for the same turns as parts (text parts between image parts), and the
    targets are the parts record's: the answer, no image token."""
    from PIL import Image
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = LLAVA_HF
    rows = {}
    for name, record in (("strings", processor_files.RECORD), ("parts", processor_files.PARTS)):
        data = processor_files.data(str(tmp_path / f"{name}.jsonl"), [record])
        tokens = token_file(str(tmp_path / f"tokens_{name}"), "train", [data], tokenizer, model, False, media)
        rows[name] = (np.asarray(tokens.ids[tokens.docs[0]:tokens.docs[1]]).tolist(),
                      np.asarray(tokens.targets[tokens.docs[0]:tokens.docs[1]]).astype(bool).tolist())
    theirs = _theirs(model, "llava")
    text = theirs.apply_chat_template(processor_files.PARTS["messages"], chat_template=LLAVA_HF, tokenize=False)
    pictures = [Image.open(tmp_path / p).convert("RGB") for p in processor_files.RECORD["images"]]
    written = theirs(text=[text], images=[pictures], add_special_tokens=False)["input_ids"][0]
    row, targets = rows["strings"]
    assert rows["strings"] == rows["parts"]
    assert row == list(written) + [tokenizer.eos_token_id]
    image = tokenizer.convert_tokens_to_ids("<image>")
    assert row.count(image) > 2 and not any(on for t, on in zip(row, targets) if t == image)
    assert tokenizer.decode([t for t, on in zip(row, targets) if on]).startswith("red, then blue")
    assert "colour" not in tokenizer.decode([t for t, on in zip(row, targets) if on])
