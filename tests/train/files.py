"""A tiny Hugging Face model folder, tokenizer and data files, made on the spot (no downloads)."""
from __future__ import annotations

import json
import os

SENTENCES = ["the cat sat on the mat", "a dog ran in the park", "we like to read books at night",
             "rain fell on the old town", "she plays the piano well", "birds sing in the morning",
             "hello there how are you", "i am fine thank you", "what is the time now", "it is late"]
SPECIAL = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def tokenizer(words: list[str] = (), special: list[str] = (), template: str = TEMPLATE):
    """A word-level tokenizer of SENTENCES' words and `words`, SPECIAL and `special` first."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({w for s in SENTENCES for w in s.split()} | set(words))
    vocab = {t: i for i, t in enumerate(SPECIAL + list(special) + words)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = template
    return fast


def model_dir(path: str, seed: int = 0, layers: int = 2, dim: int = 64, tok=None) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tok if tok is not None else tokenizer()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=dim, intermediate_size=2 * dim, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, use_cache=False)
    LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def chats(path: str, n: int = 12) -> str:
    with open(path, "w") as f:
        for i in range(n):
            q, a = SENTENCES[i % len(SENTENCES)], SENTENCES[(i * 3 + 1) % len(SENTENCES)]
            messages = [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
            if i % 3 == 0:
                messages += [{"role": "user", "content": SENTENCES[(i + 5) % len(SENTENCES)]},
                             {"role": "assistant", "content": SENTENCES[(i + 7) % len(SENTENCES)]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


def text(path: str) -> str:
    with open(path, "w") as f:
        f.write(" ".join(SENTENCES * 3))
    return path


def run_yaml(path: str, **settings) -> str:
    import yaml
    with open(path, "w") as f:
        yaml.safe_dump(settings, f)
    return path


def workspace(tmp) -> dict:
    """model/, chats.jsonl, notes.txt under tmp."""
    tmp = str(tmp)
    return {"model": model_dir(os.path.join(tmp, "model")), "chats": chats(os.path.join(tmp, "chats.jsonl")),
            "notes": text(os.path.join(tmp, "notes.txt"))}


def board_scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
    """The TensorBoard events a run wrote: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(os.path.join(run_dir, "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


# The log columns a resumed run must repeat exactly from a run never broken.
LOG_COLUMNS = ("step", "loss", "lr", "grad_norm", "tokens", "device_peak_bytes", "predicted_device_peak_bytes",
               "skipped")


def log_rows(run_dir) -> list[dict]:
    """The run's log.csv rows, LOG_COLUMNS only."""
    from megacompile.train import log
    return [{k: r[k] for k in LOG_COLUMNS} for r in log.read(os.path.join(str(run_dir), "log.csv"))]


def unbroken_run(folder, **settings) -> list[dict]:
    """The log rows of a run of `settings` that nothing interrupts, in `folder`/whole."""
    from megacompile.train import load, run
    run(load(run_yaml(os.path.join(str(folder), "whole.yaml"), run_dir="whole", **settings), []))
    return log_rows(os.path.join(str(folder), "whole"))
