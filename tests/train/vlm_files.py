"""A tiny LLaVA model folder with its processor, PNG images and chat records that show them, made
on the spot (no downloads): files.py's word-level tokenizer with an `<image>` token, a
CLIPImageProcessor at 16 x 16 pixels, a LlavaProcessor carrying files.py's chat template.

Images are 16 x 16 pixels in 4 x 4 patches: each fills 16 image tokens (the class token dropped)."""
from __future__ import annotations

import json
import os

from tests.train import files

IMAGE = 16
PATCH = 4
IMAGE_TOKENS = (IMAGE // PATCH) ** 2
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220)}
WORDS = ["what", "colour", "is", "this", "red", "green", "blue", "describe", "picture", "image"]


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for s in files.SENTENCES for w in s.split()} | set(WORDS))
    vocab = {t: i for i, t in enumerate(files.SPECIAL + ["<image>"] + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return fast


def processor():
    from transformers import CLIPImageProcessor, LlavaProcessor
    images = CLIPImageProcessor(size={"shortest_edge": IMAGE}, crop_size={"height": IMAGE, "width": IMAGE})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer(), patch_size=PATCH,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          chat_template=files.TEMPLATE)


def model_dir(path: str, seed: int = 0) -> str:
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    proc = processor()
    tok = proc.tokenizer
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE, patch_size=PATCH, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                       use_cache=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_layer=-1, vision_feature_select_strategy="default")
    LlavaForConditionalGeneration(config).save_pretrained(path)
    proc.save_pretrained(path)
    return path


def images(folder: str, sizes: dict[str, tuple[int, int]] | None = None) -> dict[str, str]:
    """One flat-coloured PNG per colour in folder/images, each of sizes[colour] (width, height;
    default one size for all); colour -> path relative to `folder`."""
    from PIL import Image
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    out = {}
    for name, rgb in COLOURS.items():
        out[name] = os.path.join("images", f"{name}.png")
        size = sizes[name] if sizes is not None else (IMAGE + 8, IMAGE)
        Image.new("RGB", size, rgb).save(os.path.join(folder, out[name]))
    return out


def records(path: str, n: int = 12, text_every: int = 4) -> str:
    """LLaVA's layout: `messages` whose user turn holds `<image>`, and `images`; every
    text_every-th record has no image (a files.py sentence pair instead)."""
    pictures = images(os.path.dirname(path))
    names = sorted(pictures)
    with open(path, "w") as f:
        for i in range(n):
            if text_every and i % text_every == text_every - 1:
                s = files.SENTENCES
                record = {"messages": [{"role": "user", "content": s[i % len(s)]},
                                       {"role": "assistant", "content": s[(i + 3) % len(s)]}]}
            else:
                colour = names[i % len(names)]
                record = {"messages": [{"role": "user", "content": "<image> what colour is this"},
                                       {"role": "assistant", "content": f"this is {colour}"}],
                          "images": [pictures[colour]]}
            f.write(json.dumps(record) + "\n")
    return path


SAME = ("step", "loss", "lr", "grad_norm", "tokens", "eval_loss", "eval_perplexity")


def resumes_as_whole(tmp_path, monkeypatch, settings: dict, stop_after: int, steps: int) -> dict:
    """The run of `settings` (run_dir and export named after it) stopped by an interrupt after step
    `stop_after`, then resumed with resume: auto: its log and exported weights are the run named
    `whole`'s, already made under tmp_path, and they moved from model/'s. The export's tensors."""
    import pytest
    import safetensors.torch
    import torch
    from megacompile.train import load, log, run
    config = files.run_yaml(str(tmp_path / "cut.yaml"), **settings)
    write = log.RunLog.write

    def write_then_stop(self, row, **more):
        write(self, row, **more)
        if row["step"] == stop_after:
            raise KeyboardInterrupt
    monkeypatch.setattr(log.RunLog, "write", write_then_stop)
    with pytest.raises(KeyboardInterrupt):
        run(load(config, []))
    monkeypatch.setattr(log.RunLog, "write", write)
    assert not os.path.exists(settings["export"])
    assert run(load(config, []))["steps"] == steps
    whole, cut = (log.read(str(tmp_path / name / "log.csv")) for name in ("whole", settings["run_dir"]))
    assert len(whole) == steps and [{k: r[k] for k in SAME} for r in cut] == [{k: r[k] for k in SAME} for r in whole]
    ours = safetensors.torch.load_file(str(tmp_path / "whole-export" / "model.safetensors"))
    theirs = safetensors.torch.load_file(str(tmp_path / settings["export"] / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    before = safetensors.torch.load_file(str(tmp_path / "model" / "model.safetensors"))
    assert not all(torch.equal(before[k], ours[k]) for k in ours)        # it trained
    return theirs


def settings(name: str, seq: int, steps: int, **over) -> dict:
    """A run file's settings over model/, data.jsonl and eval.jsonl, run_dir and export named after
    `name`: seed 3, batch 2, an evaluation and a checkpoint every 2 steps, resumed by resume: auto."""
    return {"model": "model", "data": "data.jsonl", "eval": "eval.jsonl", "seq": seq, "batch": 2, "steps": steps,
            "seed": 3, "lr": 1e-2, "schedule": "constant", "eval_every": 2, "save_every": 2, "device": "cpu",
            "compute_dtype": "float32", "resume": "auto", "run_dir": name, "export": f"{name}-export",
            "log_every": 1, **over}


def eager(c, model, rows, image_key: str) -> list[float]:
    """The run's micro-batches (`rows`, as it reads them) through `model` (transformers') and
    torch.optim.AdamW, each micro-batch holding images (its `image_key` input): the losses."""
    import torch
    from megacompile.train.data import packing
    opt = torch.optim.AdamW(model.parameters(), lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=c.weight_decay)
    losses = []
    for step in range(c.steps):
        opt.zero_grad(set_to_none=True)
        inputs = packing.batch(rows, step * c.batch, c.batch, shifted=False)
        assert image_key in inputs
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.max_grad_norm)
        opt.step()
        losses.append(loss.item())
    return losses
