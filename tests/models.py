"""Models the end-to-end tests train: a nanoGPT-style GPT written here, and Hugging Face
Llama, Qwen2 and GPT-2 from small configs with random init (nothing is downloaded)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The Hugging Face parity models and batches live in the package: `python -m megacompile.acceptance` trains them too.
from megacompile.acceptance.models import batch, hf_gpt2, hf_llama, hf_qwen2  # noqa: F401


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.heads, self.dropout = heads, dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x):                                     # x: (B, T, d)
        B, T, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (t.view(B, T, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, h, T, d/h)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, d)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d),
                                 nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """GPT-2 in the nanoGPT layout: tied embedding and lm head, returns (logits, loss)."""

    def __init__(self, vocab: int = 96, d: int = 64, layers: int = 4, heads: int = 4, block: int = 32,
                 dropout: float = 0.0):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, d), wpe=nn.Embedding(block, d), drop=nn.Dropout(dropout),
            h=nn.ModuleList([Block(d, heads, dropout) for _ in range(layers)]), ln_f=nn.LayerNorm(d)))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx, targets=None):                     # idx: (B, T) token ids
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, d)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))       # (B, T, vocab)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss



def captured_llama(layers: int, d: int, rows: int, seq: int):
    """A seeded hf_llama of `layers` blocks of width `d`, captured for training on the cpu in float32
    on (rows, seq) token ids: what the planner's unit tests plan."""
    from megacompile.capture import capture
    torch.manual_seed(0)
    model = hf_llama(layers=layers, d=d)
    ids = batch(96, rows, seq)
    return capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)
