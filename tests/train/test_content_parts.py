"""Turns whose content is a list of parts (TRL's and transformers' vision-language layout): for
every family with a processor, a record of image and text parts becomes, token for token, the
same document as the record written with `<image>` placeholders, when the chat template writes an
image part as the processor's image token; a text model reads text parts as their text; parts
that cannot be read are refused with the record's line."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.train.data import grid_images, tokens
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests.train import files, processor_files

@pytest.mark.parametrize("family", [f for f in processor_files.FAMILIES if f != "smolvlm"])  # smolvlm: idefics3's
def test_image_parts_make_the_document_placeholders_make(tmp_path, family):
    model = processor_files.folder(str(tmp_path / "model"), family)
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = processor_files.parts_template(media.written)
    made = {}
    for name, record in (("placeholders", processor_files.RECORD), ("parts", processor_files.PARTS)):
        data = processor_files.data(str(tmp_path / f"{name}.jsonl"), [record])
        found = token_file(str(tmp_path / name), "train", [data], tokenizer, model, False, media)
        made[name] = (np.asarray(found.ids).tolist(), np.asarray(found.targets).tolist())
    assert made["parts"] == made["placeholders"] and any(made["parts"][1])
    # one image part too many for the record's images
    extra = {**processor_files.PARTS, "messages": [{**processor_files.PARTS["messages"][0], "content": [{"type": "image"}] + processor_files.PARTS["messages"][0]["content"]},
                                   processor_files.PARTS["messages"][1]]}
    data = processor_files.data(str(tmp_path / "extra.jsonl"), [extra])
    with pytest.raises(ArgumentError, match=r"extra.jsonl:1: the turns hold 3 <image> placeholders \(image parts "
                                            r"counted\) and images lists 2 files"):
        token_file(str(tmp_path / "extra"), "train", [data], tokenizer, model, False, media)


def test_a_text_model_reads_text_parts_as_their_text():
    tok = files.tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "i am fine"}]}]
    plain = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}]
    assert tokens.encode(tok, {"messages": parts}, False, "x:1") == tokens.encode(tok, {"messages": plain}, False, "x:1")


@pytest.mark.parametrize("content, message", [
    ([{"type": "image"}, {"type": "text", "text": "hello there"}],
     "turn 0 holds image parts, which are read only with a vision-language model's processor"),
    ([{"type": "image", "path": "red.png"}], "turn 0 names its image inside the part \\(path\\); give the files"),
    ([{"type": "audio"}], "turn 0's content parts are \\{type: text, text: ...\\}, \\{type: image\\}"),
    ([{"type": "text"}], "turn 0 has a text part without its text"),
])
def test_parts_that_cannot_be_read_are_refused_with_the_line(content, message):
    record = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "i am fine"}]}
    with pytest.raises(ArgumentError, match="x:2: " + message):
        tokens.encode(files.tokenizer(), record, False, "x:2")


@pytest.mark.parametrize("decode", [True, False], ids=["pil", "bytes"])
def test_images_held_in_a_parquet_table_read_as_their_files_do(tmp_path, decode):
    """TRL's vision-language datasets: parts, and the images inside the table (an Image column,
    decoded to PIL images, or left as {bytes, path}): the same document and pixels as the files."""
    import datasets
    from PIL import Image
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = processor_files.parts_template(media.written)
    files_data = processor_files.data(str(tmp_path / "files.jsonl"), [processor_files.PARTS])
    pictures = [Image.open(tmp_path / p).copy() for p in processor_files.PARTS["images"]]     # no file name: the bytes go in
    features = datasets.Features({"messages": [{"role": datasets.Value("string"), "content": [
        {"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
        "images": datasets.Sequence(datasets.Image(decode=decode))})
    table = datasets.Dataset.from_list([{**processor_files.PARTS, "images": pictures}], features=features)
    table.to_parquet(str(tmp_path / "table.parquet"))
    made = {}
    for name, data in (("files", files_data), ("table", str(tmp_path / "table.parquet"))):
        found = token_file(str(tmp_path / name / "tokens"), "train", [data], tokenizer, model, False, media)
        paths = found.images[0][1]
        made[name] = (np.asarray(found.ids).tolist(), np.asarray(found.targets).tolist(), media.pixels(paths))
        if name == "table":         # written once into the run's image folder, under their bytes' sha256
            assert all(p.startswith(str(tmp_path / name / "images")) for p in paths) and len(set(paths)) == 2
    assert made["table"][:2] == made["files"][:2]
    assert torch.equal(made["table"][2], made["files"][2])


def test_an_image_held_in_a_record_needs_the_runs_folder_and_a_path_only_item_is_its_path(tmp_path):
    from PIL import Image

    from megacompile.train.data import embedded
    assert embedded.path({"bytes": None, "path": "images/red.png"}, None, "x:1") == "images/red.png"
    with pytest.raises(ArgumentError, match="x:1: the record holds its images inside it, which are written to the "
                                            "run's folder"):
        embedded.path(Image.new("RGB", (4, 4)), None, "x:1")
    kept = embedded.path(Image.new("RGB", (4, 4), (9, 8, 7)), str(tmp_path), "x:1")
    assert kept.endswith(".png") and Image.open(kept).getpixel((0, 0)) == (9, 8, 7)
    assert embedded.path({"bytes": open(kept, "rb").read()}, str(tmp_path), "x:1") == kept    # the same bytes, once
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    data = processor_files.data(str(tmp_path / "odd.jsonl"), [{**processor_files.RECORD, "images": [3, 4]}])
    with pytest.raises(ArgumentError, match="odd.jsonl:1: images must be a list of image file paths .*, or of "
                                            "images held in the table"):
        token_file(str(tmp_path / "tokens"), "train", [data], load_tokenizer(model), model, False,
                   grid_images.media(model))


def test_unmarked_images_go_first_in_the_first_user_turn_as_trl_lays_them_out(tmp_path):
    """TRL's string conversations with an images (or one image) column and no placeholder: the same
    document as the parts TRL's prepare_multimodal_messages makes of them."""
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    tokenizer.chat_template = processor_files.parts_template(media.written)
    red, blue = processor_files.RECORD["images"]
    strings = [{"role": "user", "content": " what colour is this"}, {"role": "assistant", "content": "red, then blue"}]

    def laid_out(n):
        return [{"role": "user", "content": [{"type": "image"}] * n + [{"type": "text", "text": " what colour is this"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "red, then blue"}]}]
    made = {}
    for name, record in (("trl", {"messages": strings, "images": [red, blue]}),
                         ("parts", {"messages": laid_out(2), "images": [red, blue]}),
                         ("one", {"messages": strings, "image": red}),
                         ("one-parts", {"messages": laid_out(1), "images": [red]})):
        data = processor_files.data(str(tmp_path / f"{name}.jsonl"), [record])
        found = token_file(str(tmp_path / name), "train", [data], tokenizer, model, False, media)
        made[name] = (np.asarray(found.ids).tolist(), np.asarray(found.targets).tolist(), found.images[0][1])
    assert made["trl"] == made["parts"] and made["one"] == made["one-parts"] and made["one"] != made["trl"]
    data = processor_files.data(str(tmp_path / "nouser.jsonl"), [{"messages": strings[1:], "images": [red]}])
    with pytest.raises(ArgumentError, match="nouser.jsonl:1: the record has images, no <image> placeholder marks "
                                            "where they go, and no user turn"):
        token_file(str(tmp_path / "nouser"), "train", [data], tokenizer, model, False, media)


def test_template_settings_and_tools_reach_the_rendering_of_a_record_with_images(tmp_path):
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    media = grid_images.media(model)
    asked = load_tokenizer(model)
    asked.chat_template = ("{% if brief %}brief {% endif %}{% for t in tools or [] %}{{ t.function.name }} "
                           "{% endfor %}" + processor_files.parts_template(media.written))
    fixed = load_tokenizer(model)
    fixed.chat_template = "brief get_time " + processor_files.parts_template(media.written)
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    made = []
    for name, tok, record in (("asked", asked, {**processor_files.PARTS, "chat_template_kwargs": {"brief": True},
                                                "tools": [tool]}),
                              ("fixed", fixed, processor_files.PARTS)):
        data = processor_files.data(str(tmp_path / f"{name}.jsonl"), [record])
        found = token_file(str(tmp_path / name), "train", [data], tok, model, False, media)
        made.append((np.asarray(found.ids).tolist(), np.asarray(found.targets).tolist()))
    assert made[0] == made[1]
