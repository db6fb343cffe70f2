"""A small Llama-style decoder (RMSNorm, rotary attention with grouped KV heads, SwiGLU), built
from a config with random init: the model `megacompile train` trains on the bundled corpus."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256            # byte-level tokens
    dim: int = 256
    layers: int = 6
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 704
    rope_theta: float = 10000.0
    eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate(x, cos, sin):                       # x: (B, h, T, hd); cos, sin: (T, hd)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.q = nn.Linear(c.dim, c.heads * c.head_dim, bias=False)
        self.k = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.v = nn.Linear(c.dim, c.kv_heads * c.head_dim, bias=False)
        self.o = nn.Linear(c.heads * c.head_dim, c.dim, bias=False)

    def forward(self, x, cos, sin):            # x: (B, T, dim)
        B, T, _ = x.shape
        c = self.c
        q = self.q(x).view(B, T, c.heads, c.head_dim).transpose(1, 2)       # (B, h, T, hd)
        k = self.k(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)    # (B, kv, T, hd)
        v = self.v(x).view(B, T, c.kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        groups = c.heads // c.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, h, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, c.dim))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim, c.eps), RMSNorm(c.dim, c.eps)
        self.attn = Attention(c)
        self.gate = nn.Linear(c.dim, c.ffn, bias=False)
        self.up = nn.Linear(c.dim, c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    """forward(input_ids, labels) -> mean next-token loss; labels are already shifted targets."""

    def __init__(self, c: LlamaConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("o.weight", "down.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def rotary(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        hd = self.c.head_dim
        inv_freq = 1.0 / (self.c.rope_theta ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        angles = torch.outer(torch.arange(T, device=device, dtype=torch.float32), inv_freq)   # (T, hd/2)
        angles = torch.cat((angles, angles), dim=-1)                                           # (T, hd)
        dtype = self.embed.weight.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, input_ids, labels=None):  # input_ids: (B, T) bytes
        x = self.embed(input_ids)               # (B, T, dim)
        cos, sin = self.rotary(input_ids.shape[1], input_ids.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))     # (B, T, vocab)
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
