"""A fine-tuning run from a run file and the same training done eagerly: the run's batches and
held-out rows as it reads them, the model as apply() shapes it, torch.optim.AdamW over Hugging
Face Trainer's param groups, and the host tables a checkpoint holds."""
from __future__ import annotations

import os

import safetensors.torch
import torch

from megacompile.train.data import packing
from megacompile.train.methods import apply as apply_finetuning


def eager(c, rows) -> tuple[torch.nn.Module, list[float], dict]:
    """The run's model as eager PEFT builds it (the run's seed, weights read by transformers),
    trained on the run's batches with torch.optim.AdamW."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(c.seed)
    base = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    base.config.use_cache = False
    model = apply_finetuning(c, base)
    return model, *train(model, c, rows, trainer_groups(model, c.weight_decay))


def train(model: torch.nn.Module, c, rows, groups: list[dict]) -> tuple[list[float], dict]:
    """`model` trained on the run's batches with torch.optim.AdamW over `groups` (a group without its
    own lr takes c.lr): the losses, and each trainable parameter's exp_avg after the first step."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(groups, lr=c.lr, betas=tuple(c.betas), eps=c.eps)
    losses, first = [], {}
    for step in range(c.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**packing.batch(rows, step * c.batch, c.batch, shifted=False)).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            first = {n: opt.state[p]["exp_avg"].clone() for n, p in trainable.items()}
    return losses, first


def trainer_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """The trainable parameters in Hugging Face Trainer's two param groups: weight_decay for those
    Trainer.get_decay_parameter_names gives, 0 for the rest (biases and norm weights)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not weight_decay:     # one group means the same, without importing Trainer (seconds)
        return [{"params": list(trainable.values()), "weight_decay": 0.0}]
    from transformers import Trainer
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in trainable.items() if n in decayed], "weight_decay": weight_decay},
              {"params": [p for n, p in trainable.items() if n not in decayed], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def loraplus_groups(model: torch.nn.Module, lr: float, weight_decay: float, ratio: float) -> list[dict]:
    """LlamaFactory's LoRA+ param groups (its _create_loraplus_optimizer): the A matrices at lr; each
    B and every trained 1-D parameter at lr x ratio, decayed as the Trainer decays them or not; and
    the adapters on embeddings (none here: an empty group, as LlamaFactory keeps it)."""
    from transformers import Trainer
    decayed = set(Trainer.get_decay_parameter_names(None, model))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    plus = {n for n, p in trainable.items() if "lora_B" in n or p.ndim == 1}
    return [{"params": [p for n, p in trainable.items() if n not in plus], "lr": lr, "weight_decay": weight_decay},
            {"params": [p for n, p in trainable.items() if n in plus and n in decayed], "lr": lr * ratio,
             "weight_decay": weight_decay},
            {"params": [p for n, p in trainable.items() if n in plus and n not in decayed], "lr": lr * ratio,
             "weight_decay": 0.0},
            {"params": [], "lr": 1e-6, "weight_decay": weight_decay}]


def tables(checkpoint: str, table: str) -> dict:
    out = {}
    for f in sorted(os.listdir(checkpoint)):
        if f.startswith("owner-"):
            out.update({k.split("/", 1)[1]: v for k, v in safetensors.torch.load_file(os.path.join(checkpoint, f)).items()
                        if k.startswith(table + "/")})
    return out


def rows(c, tmp, seq: int) -> tuple[packing.Rows, packing.Rows]:
    """The run's training rows and held-out rows, as the run reads them."""
    from megacompile.train import vocab
    from megacompile.train.data.tokens import load_tokenizer, token_file
    tok = load_tokenizer(c.model)
    vocab.add(tok, c)       # the tokens the run adds (add_tokens, add_special_tokens)
    train = token_file(str(tmp / "tokens"), "train", c.data, tok, c.model, c.train_on_prompt)
    held = token_file(str(tmp / "tokens"), "eval", c.eval, tok, c.model, c.train_on_prompt)
    return (packing.Rows(train, seq, c.packing, c.seed, pad_id=tok.pad_token_id),
            packing.Rows(held, seq, c.packing, c.seed, shuffle=False, pad_id=tok.pad_token_id))
