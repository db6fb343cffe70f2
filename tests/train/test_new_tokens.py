"""add_tokens, add_special_tokens (new_special_tokens) and resize_vocab: the tokens read as one id
each in the run's data and in the exported tokenizer, the model grown to the tokenizer's length
rounded up to 64 rows, the new tokens' rows at the mean of the others plus noise of std
1/sqrt(hidden) (LlamaFactory's noise_init), the rows the folder had untouched; the run trains as
eager transformers does from those rows (losses to 1e-5), full and LoRA (the embedding and output
trained whole, as LlamaFactory adds them), a vision-language model's text model too, its processor
given the tokens; what cannot train so is refused."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.train import files, finetune_runs

SEQ = 24
SPECIAL, PLAIN = ["<tool_call>", "</tool_call>"], ["zorblax"]


def _chats(path: str) -> str:
    with open(path, "w") as f:
        for i in range(8):
            answer = f"<tool_call> zorblax {files.SENTENCES[i]} </tool_call>"
            f.write(json.dumps({"messages": [{"role": "user", "content": files.SENTENCES[(i + 3) % 10]},
                                             {"role": "assistant", "content": answer}]}) + "\n")
    return path


def _settings(tmp_path, **extra) -> dict:
    chats = _chats(str(tmp_path / "chats.jsonl"))
    return dict(model=files.model_dir(str(tmp_path / "llama"), dim=32), data=[chats], eval=[chats], eval_batches=1,
                seq=SEQ, batch=2, steps=2, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu",
                run_dir=str(tmp_path / "run"), log_every=1, save_every=2,
                add_special_tokens=",".join(SPECIAL), add_tokens=PLAIN) | extra


def _eager(c):
    """The folder's model grown as the run grows it: transformers' resize, then the run's rows."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    model.resize_token_embeddings(c.grown.rows, mean_resizing=False)
    saved = load_file(os.path.join(c.model, "model.safetensors"))
    with torch.no_grad():
        for key in c.grown.keys:
            model.get_parameter(key).copy_(c.grown.grow(key, saved[key]))
    return model, saved


def test_the_tokens_are_added_the_rows_grown_and_the_run_trains_as_eager(tmp_path, capsys):
    from transformers import AutoTokenizer
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path)), [])
    run(c)
    out = capsys.readouterr().out
    before = len(files.tokenizer())
    assert "note           new tokens were added: resize_vocab is on" in out
    assert f"vocabulary     3 tokens added (zorblax, <tool_call>, </tool_call>); {before:,} -> 64 rows" in out
    assert c.grown.rows == 64 and set(c.grown.keys) == {"model.embed_tokens.weight", "lm_head.weight"}

    exported = AutoTokenizer.from_pretrained(c.run_dir)
    ids = exported("<tool_call> zorblax </tool_call>", add_special_tokens=False)["input_ids"]
    assert ids == [before + 1, before, before + 2] and list(c.grown.new_ids) == [before, before + 1, before + 2]
    with open(os.path.join(c.run_dir, "config.json")) as f:
        assert json.load(f)["vocab_size"] == 64
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    assert {before, before + 1, before + 2} <= set(rows.tokens.ids.tolist())     # the data reads them as one id each

    eager, saved = _eager(c)
    embedding = eager.get_input_embeddings().weight.detach()
    old = saved["model.embed_tokens.weight"]
    assert torch.equal(embedding[:before], old)                          # the folder's rows, untouched
    others = torch.ones(64, dtype=torch.bool)
    others[list(c.grown.new_ids)] = False
    noise = embedding[list(c.grown.new_ids)] - embedding[others].mean(dim=0)
    assert 0.5 < noise.std().item() * math.sqrt(32) < 2.0                # mean plus N(0, 1/sqrt(hidden))
    padding = embedding[before + 3:]
    assert 0.01 < padding.std().item() < 0.04                            # initializer_range 0.02, as resize draws them
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert ours == pytest.approx(finetune_runs.train(eager, c, rows, finetune_runs.trainer_groups(eager, 0.0))[0],
                                 rel=1e-5)


@pytest.mark.slow
def test_a_lora_run_trains_the_embedding_and_output_whole(tmp_path, capsys):
    import peft
    settings = _settings(tmp_path, finetuning_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                         lora_target="q_proj,v_proj", new_special_tokens=SPECIAL)     # LlamaFactory's earlier name
    del settings["add_special_tokens"]
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    run(c)
    assert "embed_tokens, lm_head train whole beside the adapters (additional_target)" in capsys.readouterr().out
    assert c.additional_target == ["embed_tokens", "lm_head"]
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, _ = _eager(c)
    torch.manual_seed(c.seed)       # the adapters' draws, as the run draws them
    eager = peft.get_peft_model(eager, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                       target_modules=["q_proj", "v_proj"],
                                                       modules_to_save=["embed_tokens", "lm_head"]))
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert ours == pytest.approx(finetune_runs.train(eager, c, rows, finetune_runs.trainer_groups(eager, 0.0))[0],
                                 rel=1e-5)


def test_a_token_the_tokenizer_has_keeps_its_row_and_grows_nothing(tmp_path, capsys):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(
        tmp_path, add_special_tokens="<|end|>", add_tokens="cat")), [])
    from megacompile.train import vocab
    from megacompile.train.model import meta_model
    assert vocab.resolve(c, meta_model(c)) == [] and c.grown is None and not c.resize_vocab


@pytest.mark.parametrize("extra, says", [
    (dict(model="bundled"), "add_tokens: the bundled model reads bytes"),
    (dict(add_tokens=[1, 2]), "add_tokens takes tokens, a comma-separated string or a list of strings"),
    (dict(resize_vocab="yes"), "resize_vocab must be true or false"),
])
def test_tokens_that_cannot_be_added_are_refused(tmp_path, extra, says):
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, **extra)), [])
    assert says in str(e.value)


def test_a_lora_preference_run_and_a_tied_lora_model_are_refused(tmp_path):
    from tests.posttrain import stage_files
    work = {"model": str(tmp_path), "pairs": stage_files.pairs(str(tmp_path / "pairs.jsonl"))}
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "add_tokens": "zorblax", "finetuning_type": "lora"}
    with pytest.raises(ArgumentError, match="under LoRA the new tokens' rows train with the embedding and output "
                                            "projection trained whole .*under stage dpo"):
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    from transformers import LlamaConfig, LlamaForCausalLM
    from megacompile.train import vocab
    c = load(files.run_yaml(str(tmp_path / "r2.yaml"), **_settings(tmp_path, finetuning_type="lora")), [])
    with torch.device("meta"):
        tied = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, tie_word_embeddings=True))
    with pytest.raises(ArgumentError, match="ties its output projection to its embedding"):
        vocab.resolve(c, tied)


@pytest.mark.parametrize("extra, says", [(dict(rope_scaling="linear"), "rope_scaling: vLLM builds the policy"),
                                         (dict(add_tokens="zorblax"), "add_tokens: vLLM builds the policy")])
def test_vllm_sampling_from_the_folders_config_is_refused_for_a_changed_model(tmp_path, monkeypatch, extra, says):
    import sys
    import types
    from tests.posttrain import stage_files
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))      # installed, as far as the checks look
    work = stage_files.workspace(tmp_path)
    settings = stage_files.grpo(work, str(tmp_path / "run"), use_vllm=True, **extra)
    with pytest.raises(ArgumentError, match=says):
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])


def _vlm_chats(folder) -> str:
    """Qwen2.5-VL records whose answers hold the added tokens."""
    from tests.train import qwen_files
    qwen_files.images(str(folder))
    path = str(folder / "data.jsonl")
    with open(path, "w") as f:
        for i, colour in enumerate(["red", "green", "blue"] * 2):
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image> what colour is this"},
                                             {"role": "assistant", "content": f"<think> zorblax </think> {colour}"}],
                                "images": [f"images/{colour}.png"]}) + "\n")
    return path


def test_a_vision_language_run_adds_its_tokens_to_the_processor_and_trains_as_eager(tmp_path):
    """Qwen2.5-VL (a folder in the hub's older layout, `model.embed_tokens`): the tokens are one id
    each in the processor's rows, the text model grows to 128 rows (its text config's vocab_size),
    its embedding and output grown from the files' keys as a text model's are; the run's losses are
    eager transformers' from those rows (resize_token_embeddings, then the run's rows), and the
    export, its processor's tokenizer holding the tokens, loads."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from megacompile.train.data import grid_images, packing
    from megacompile.train.data.tokens import load_tokenizer, token_file
    from tests.train import qwen_files, vlm_files
    model = qwen_files.model_dir(str(tmp_path / "model"))
    data = _vlm_chats(tmp_path)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=model, data=[data], seq=32, batch=2, steps=3, lr=1e-2,
                            schedule="constant", max_grad_norm=1.0, device="cpu", compute_dtype="float32",
                            run_dir=str(tmp_path / "run"), log_every=1, add_special_tokens="<think>,</think>",
                            add_tokens=["zorblax"]), [])
    run(c)
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert c.grown.rows == 128 and set(c.grown.keys) <= stored and "model.embed_tokens.weight" in c.grown.keys
    before = len(qwen_files.tokenizer())
    new = [before, before + 1, before + 2]
    exported = AutoTokenizer.from_pretrained(c.run_dir)
    assert exported("<think> zorblax </think>", add_special_tokens=False)["input_ids"] == [new[1], new[0], new[2]]
    with open(os.path.join(c.run_dir, "config.json")) as f:
        assert json.load(f)["text_config"]["vocab_size"] == 128

    media = grid_images.media(model)
    tokenizer = load_tokenizer(model)
    from megacompile.train import vocab
    vocab.add(tokenizer, c)
    vocab.add(media.tokenizer, c)
    tokens = token_file(str(tmp_path / "tokens"), "train", [data], tokenizer, model, False, media)
    rows = packing.Rows(tokens, c.seq, c.packing, c.seed, pad_id=tokenizer.pad_token_id, pixels=media.inputs)
    assert set(new) <= set(rows.tokens.ids.tolist())
    eager = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    eager.resize_token_embeddings(c.grown.rows, mean_resizing=False)
    saved = load_file(os.path.join(model, "model.safetensors"))
    with torch.no_grad():
        eager.get_input_embeddings().weight.copy_(c.grown.grow("model.embed_tokens.weight",
                                                               saved["model.embed_tokens.weight"]))
        if "lm_head.weight" in c.grown.keys:
            eager.get_output_embeddings().weight.copy_(c.grown.grow("lm_head.weight", saved["lm_head.weight"]))
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    assert ours == pytest.approx(vlm_files.eager(c, eager, rows, "image_grid_thw"), rel=1e-5)
    assert AutoModelForImageTextToText.from_pretrained(c.run_dir).get_input_embeddings().weight.shape[0] == 128


def test_a_llava_processor_writes_the_added_tokens_as_one_id_and_exports_them(tmp_path, monkeypatch):
    """LLaVA's processor (built whole, its own tokenizer inside): the rows the run trains on hold each
    added token as one id, and the exported processor's tokenizer has them."""
    from transformers import AutoProcessor

    from tests.train import vlm_files
    monkeypatch.chdir(tmp_path)
    vlm_files.model_dir("model")
    pictures = vlm_files.images(".")
    with open("data.jsonl", "w") as f:
        for colour in sorted(pictures) * 2:
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image> what colour is this"},
                                             {"role": "assistant", "content": f"<think> {colour} </think> {colour}"}],
                                "images": [pictures[colour]]}) + "\n")
    c = load(files.run_yaml("r.yaml", model="model", data=["data.jsonl"], seq=48, batch=2, steps=1, device="cpu",
                            compute_dtype="float32", run_dir="run", add_special_tokens="<think>,</think>"), [])
    run(c)
    tokenizer = AutoProcessor.from_pretrained("run").tokenizer
    think, end = list(c.grown.new_ids)
    assert tokenizer("<think> red </think>", add_special_tokens=False)["input_ids"][::2] == [think, end]
    from megacompile.train import vocab
    from megacompile.train.data import grid_images
    from megacompile.train.data.tokens import load_tokenizer, token_file
    media, text = grid_images.media("model"), load_tokenizer("model")
    vocab.add(media.processor.tokenizer, c)
    vocab.add(text, c)
    rows = token_file(str(tmp_path / "tokens"), "train", c.data, text, "model", False, media)
    assert {think, end} <= set(rows.ids.tolist())
