"""One eager PyTorch reference per kernel, shared by the tests, `--check` and the benchmarks.

Each computes in fp32 from the same inputs and returns the kernel's output dtype, so a bf16
comparison measures the kernel, not a different order of bf16 roundings. The one exception is the
lm-head: its logits are made in the input dtype before the fp32 loss, as HF models do, and as the
fused kernel does per chunk.
"""
import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def layer_norm_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    return F.layer_norm(x.float(), (x.shape[-1],), w.float(), b.float(), eps).to(x.dtype)


def swiglu_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (F.silu(a.float()) * b.float()).to(a.dtype)


def gelu_ref(a: torch.Tensor, b: torch.Tensor | None = None, approximate: str = "none") -> torch.Tensor:
    c = F.gelu(a.float(), approximate=approximate)
    return (c * b.float() if b is not None else c).to(a.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """HF's apply_rotary_pos_emb (unsqueeze_dim=1) in fp32."""
    if cos.dim() == 2:  # [S, D] -> [1, 1, S, D]
        cos, sin = cos[None, None], sin[None, None]
    elif cos.dim() == 3:  # [B, S, D] -> [B, 1, S, D]
        cos, sin = cos[:, None], sin[:, None]
    cos, sin = cos.float(), sin.float()
    qf, kf = q.float(), k.float()
    return (qf * cos + _rotate_half(qf) * sin).to(q.dtype), (kf * cos + _rotate_half(kf) * sin).to(k.dtype)


def softmax_ref(x: torch.Tensor, scale: float = 1.0, causal: bool = False) -> torch.Tensor:
    z = x.float() * scale
    if causal:
        q, k = x.shape[-2], x.shape[-1]
        z = z.masked_fill(torch.ones(q, k, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    return torch.softmax(z, dim=-1).to(x.dtype)


def window_mask(seq: int, window: int, device=None) -> torch.Tensor:
    """[S, S] bool: query i sees key j when i - window < j <= i (transformers' sliding window)."""
    i = torch.arange(seq, device=device)
    lag = i[:, None] - i[None, :]
    return (lag >= 0) & (lag < window)


def document_starts(lengths: list[list[int]], device=None) -> torch.Tensor:
    """[B, S] int32: the first position of each token's document, documents of `lengths` laid
    end to end in each row."""
    rows = [[start for start, n in zip([0, *torch.tensor(row).cumsum(0).tolist()], row) for _ in range(n)]
            for row in lengths]
    return torch.tensor(rows, dtype=torch.int32, device=device)


def eager_attention_ref(q, k, v, mask: torch.Tensor, scale: float | None, sinks: torch.Tensor | None = None,
                        softcap: float = 0.0) -> torch.Tensor:
    """Eager attention in fp32 (k, v already one head per query head): the scaled scores, capped to
    softcap * tanh(s / softcap) if `softcap` (Gemma 2), where the boolean `mask` sees a key, each
    head's sink logit as one more column of the softmax, dropped before the values, if `sinks`
    (GPT-OSS)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = q.float() @ k.transpose(-1, -2) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return (torch.softmax(scores, dim=-1) @ v).to(q.dtype)
    batch, heads, seq, _ = scores.shape
    logits = torch.cat([scores, sinks.float().reshape(1, heads, 1, 1).expand(batch, heads, seq, 1)], dim=-1)
    return (torch.softmax(logits, dim=-1)[..., :-1] @ v).to(q.dtype)


def attention_ref(q, k, v, causal: bool = True, scale: float | None = None, window: int | None = None,
                  starts: torch.Tensor | None = None, kept: torch.Tensor | None = None,
                  sinks: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """scaled_dot_product_attention's math in fp32, key/value heads repeated for each query group;
    with a window, the causal band of window_mask as the mask; with documents' `starts`, no key
    before a query's document's first; with `kept` ([B, S] bool), no key it does not keep; with
    `sinks` ([Hq]) or `softcap`, eager_attention_ref over that mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(groups, dim=1), v.float().repeat_interleave(groups, dim=1)
    if sinks is not None or softcap:
        seq = q.shape[2]
        mask = window_mask(seq, window or seq, q.device)[None, None]
        if kept is not None:
            mask = mask & kept[:, None, None, :]
        return eager_attention_ref(q, k, v, mask, scale, sinks, softcap)
    if window or starts is not None or kept is not None:
        seq = q.shape[2]
        mask = window_mask(seq, window or seq, q.device)[None, None]
        if starts is not None:
            mask = mask & (torch.arange(seq, device=q.device)[None, None, None, :] >= starts[:, None, :, None])
        if kept is not None:
            mask = mask & kept[:, None, None, :]
        return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask, scale=scale).to(q.dtype)
    return F.scaled_dot_product_attention(q.float(), k, v, is_causal=causal, scale=scale).to(q.dtype)


def fused_linear_cross_entropy_ref(h, w, labels, bias=None, ignore_index: int = -100, softcap: float = 0.0
                                   ) -> torch.Tensor:
    logits = h @ w.T if bias is None else h @ w.T + bias  # in h.dtype, as an HF lm_head makes them
    if softcap:                                           # Gemma 2's final logit softcapping, in fp32
        logits = torch.tanh(logits.float() / softcap) * softcap
    return F.cross_entropy(logits.float().reshape(-1, w.shape[0]), labels.reshape(-1), ignore_index=ignore_index)


def linear_logprobs_ref(h, w, labels, temperature: float = 0.0) -> torch.Tensor:
    """log softmax(h @ w.T)[label] per row in fp32, as the post-training losses take it from the logits
    (divided by GRPO's temperature first, in h.dtype, when given)."""
    logits = h @ w.T
    logits = (logits / temperature if temperature else logits).float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def grouped_mm_ref(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x [S, K] grouped by expert, w [E, K, N], offs [E] (ends) -> [S, N]: each row times its expert's
    weight, one row at a time (no grouping), in float32, cast back to x's dtype."""
    counts = torch.diff(offs.long(), prepend=offs.new_zeros(1).long())
    expert_of_row = torch.repeat_interleave(torch.arange(w.size(0), device=x.device), counts)
    y = torch.bmm(x.float().unsqueeze(1), w.float()[expert_of_row]).squeeze(1)
    return y.to(x.dtype)


def adamw_ref(p, g, m, v, *, step: int, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2):
    """(p, m, v) after one torch.optim.AdamW step from the given state (step counts from 1)."""
    param = torch.nn.Parameter(p.detach().clone())
    param.grad = g.detach().float().clone()
    opt = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
    opt.state[param] = {
        "step": torch.tensor(float(step - 1)),
        "exp_avg": m.detach().clone(),
        "exp_avg_sq": v.detach().clone(),
    }
    opt.step()
    state = opt.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def cast_ref(x: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return x.to(dtype)


def accumulate_ref(acc: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return acc + g.float()
