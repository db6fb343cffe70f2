"""A token file whose sources match is reused, unless its files are not whole: ids or targets cut
short (a copy of the run folder interrupted, a disk that filled), or an image its documents name
gone (the run folder's images/ cleared). It is then made again from the data, said in one line,
and comes back the same: a resumed run finds the token file its checkpoint was trained on."""
from __future__ import annotations

import os

import numpy as np

from megacompile.train.data import grid_images, tokens
from megacompile.train.data.tokens import load_tokenizer, token_file
from tests.train import files, processor_files


def _made(folder, data, tok, **kw):
    made = token_file(folder, "train", [data], tok, None, False, **kw)
    tokens.commit(made, folder)
    return made.fingerprint, np.asarray(made.ids).tolist(), np.asarray(made.targets).tolist()


def test_a_token_file_cut_short_is_made_again_the_same(tmp_path, capsys):
    data = files.chats(str(tmp_path / "chats.jsonl"))
    folder = str(tmp_path / "tokens")
    first = _made(folder, data, files.tokenizer())
    capsys.readouterr()
    assert _made(folder, data, files.tokenizer()) == first and "made again" not in capsys.readouterr().out
    for ext, keep in (("ids", 10), ("targets", 3)):
        with open(os.path.join(folder, f"train.{ext}"), "r+b") as f:
            f.truncate(keep)
        assert _made(folder, data, files.tokenizer()) == first
        assert "train token file's sizes disagree with its document offsets" in capsys.readouterr().out


def test_a_token_file_whose_images_are_gone_is_made_again(tmp_path, capsys):
    import datasets
    from PIL import Image
    model = processor_files.folder(str(tmp_path / "model"), "llava")
    media = grid_images.media(model)
    tok = load_tokenizer(model)
    tok.chat_template = processor_files.parts_template(media.written)
    processor_files.data(str(tmp_path / "files.jsonl"), [processor_files.PARTS])        # the images, beside it
    table = str(tmp_path / "table.parquet")
    datasets.Dataset.from_list([{**processor_files.PARTS, "images": [Image.open(tmp_path / p).copy() for p in processor_files.PARTS["images"]]}],
                               features=datasets.Features({
                                   "messages": [{"role": datasets.Value("string"), "content": [
                                       {"type": datasets.Value("string"), "text": datasets.Value("string")}]}],
                                   "images": datasets.Sequence(datasets.Image())})).to_parquet(table)
    folder = str(tmp_path / "run" / "tokens")
    first = _made(folder, table, tok, media=media)
    kept = tmp_path / "run" / "images"
    for name in os.listdir(kept):
        os.remove(kept / name)
    capsys.readouterr()
    assert _made(folder, table, tok, media=media) == first
    assert "train token file names 2 image file(s) that are gone" in capsys.readouterr().out
    assert len(os.listdir(kept)) == 2
