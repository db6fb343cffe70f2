"""Attention, forward and backward, writing every result where its caller laid it out.

    o = softmax(scale * q @ k^T) @ v       q [B, Hq, S, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv],
                                           Hq a multiple of Hkv (Dv = D but for latent attention)

The same work as FlashAttention-2 (tiles of queries against tiles of keys with an online softmax;
the backward recomputes the probabilities from the saved log-sum-exp), written for the device
arena: torch's flash ops allocate their results themselves (copied into the arena afterwards) and
their backward holds a float32 dq accumulator and, under grouped-query attention, dk and dv for
every query head. Here the backward is two passes with no atomics: one program per key tile sums
dk and dv over every query head of its group, one program per query tile makes dq. Its only
temporary is delta = rowsum(do * o) per query row, a result of its own so the plan places it.

Results and saved values keep the layouts of torch's flash ops, so either can stand for the other:
o, dq, dk, dv as [B, S, H, D] memory viewed [B, H, S, D] (or the strides the caller asks for),
lse float32 [B, Hq, S] in natural log. Causal is the top-left aligned mask of torch's
scaled_dot_product_attention(is_causal=True): key j sees query i when j <= i. A sliding window of
w (causal only) keeps the last w of those, i - w < j <= i, as transformers' sliding-window layers
do; the tiles wholly outside it are skipped, so its work grows with S * w, not S^2. Documents
packed in a row (causal only) are given as `starts` [B, S], the first key of each query's
document (non-decreasing along a row): query i then sees keys starts[i] <= j <= i, so no document
sees another, as transformers' packed-sequence mask does. Padding is given as `kept` [B, S] (bool,
a 2D attention_mask): a key of a row is seen only where it is kept; a query that then sees no key
(left padding) gets o = 0 and no gradient, as torch's SDPA gives it. Attention sinks (GPT-OSS)
are given as `sinks` [Hq]: a logit per query head that joins every row's softmax with no value
behind it, so it only takes a share of the probability (o shrinks, lse grows by it; a row that sees
no key gets o = 0). The forward starts each row's online softmax from it; the backward needs
nothing more than that lse, and the sinks' own gradient is attention_sinks.py's. Logit
softcapping (Gemma 2) replaces each scaled score s by softcap * tanh(s / softcap) before the mask
and the softmax; the backward multiplies each score's gradient by 1 - tanh^2.

Bytes, b per element, n = B*S*Hq*D, causal halving the tile pairs: the forward reads q once and
k, v once per query tile, writes o; the backward reads k, v once, q, do, lse, delta once per key
tile and per query tile. Accumulation is float32; float32 inputs multiply in IEEE float32 (no tf32).
Under the interpreter a bf16 tl.dot returns garbage, so there the tiles are widened to float32.
"""
import torch
import triton
import triton.language as tl

from .cast import round_to
from .softcap import tanh as _tanh
from .attention_sinks import attention_sinks_backward
from . import outputs


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _tile(ptr, base, rows, cols, stride_s, n_rows, n_cols):
    """rows x cols of one head ([S, D] at `base`, rows `stride_s` apart, d contiguous or not: stride 1 asked)."""
    return tl.load(ptr + base + rows.to(tl.int64)[:, None] * stride_s + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)


@triton.jit
def _query_tile(HQ, GROUPS, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's batch row, query head and its key/value head (int64, for offsets), the
    tile's query rows and the head dims."""
    bh = tl.program_id(1)
    b, h = (bh // HQ).to(tl.int64), (bh % HQ).to(tl.int64)
    return b, h, h // GROUPS, tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_D)


@triton.jit
def _keys_start(WINDOW, starts_ptr, b, S, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr,
                DOCUMENTS: tl.constexpr):
    """Where a query tile's keys start: the first key tile its first row sees (in a window, in a
    document: starts do not decrease along a row, so the first row's is the tile's least)."""
    first = 0
    if WINDOWED:
        first = tl.maximum(0, tl.program_id(0) * BLOCK_M - WINDOW + 1)
    if DOCUMENTS:
        row = tl.minimum(tl.program_id(0) * BLOCK_M, S - 1)
        first = tl.maximum(first, tl.load(starts_ptr + b * S + row).to(tl.int32))
    return first // BLOCK_N * BLOCK_N


@triton.jit
def _row_starts(starts_ptr, b, rows, S, DOCUMENTS: tl.constexpr):
    """The first key of each row's document (0 without documents; padding rows past S read 0)."""
    if DOCUMENTS:
        return tl.load(starts_ptr + b * S + rows, mask=rows < S, other=0).to(tl.int32)
    else:
        return tl.zeros_like(rows)


@triton.jit
def _keys_end(S, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """Where a query tile's keys end: causal, past its last row none is seen."""
    end = S
    if CAUSAL:
        end = tl.minimum(S, (tl.program_id(0) + 1) * BLOCK_M)
    return end


@triton.jit
def _kept(kept_ptr, b, keys, S, PADDED: tl.constexpr):
    """Which of `keys` the batch row keeps (all without padding)."""
    if PADDED:
        return tl.load(kept_ptr + b * S + keys, mask=keys < S, other=0) != 0
    else:
        return keys < S


@triton.jit
def _seen(rows, keys, S, CAUSAL: tl.constexpr, WINDOW, WINDOWED: tl.constexpr, first, DOCUMENTS: tl.constexpr,
          kept):
    """[rows, keys]: the keys each query row sees, those in the sequence and kept and, causal, none
    after it; in a window, none WINDOW or more before it; in documents, none before `first` (its
    document's first key). Padding rows past S are never stored."""
    keep = (keys[None, :] < S) & kept[None, :]
    if CAUSAL:
        keep = keep & (keys[None, :] <= rows[:, None])
    if WINDOWED:
        keep = keep & (keys[None, :] > rows[:, None] - WINDOW)
    if DOCUMENTS:
        keep = keep & (keys[None, :] >= first[:, None])
    return keep


@triton.jit
def attention_forward_kernel(
    o_ptr, lse_ptr, q_ptr, k_ptr, v_ptr, starts_ptr, kept_ptr, sinks_ptr,
    S, D, DV, HQ, GROUPS, scale, WINDOW, softcap,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos, slb, slh, sls,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, PADDED: tl.constexpr,
    SINKS: tl.constexpr, SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    b, h, kvh, rows, dims = _query_tile(HQ, GROUPS, BLOCK_M, BLOCK_D)
    q = _tile(q_ptr, b * sqb + h * sqh, rows, dims, sqs, S, D)
    k_base, v_base = b * skb + kvh * skh, b * svb + kvh * svh
    if SINKS:
        # The sink as a key seen first, with no value: exp(sink - m) = 1 of the denominator.
        m = tl.zeros((BLOCK_M,), tl.float32) + tl.load(sinks_ptr + h).to(tl.float32)
        denom = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        denom = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    dims_v = tl.arange(0, BLOCK_DV)
    first = _row_starts(starts_ptr, b, rows, S, DOCUMENTS)
    for n0 in range(_keys_start(WINDOW, starts_ptr, b, S, BLOCK_M, BLOCK_N, WINDOWED, DOCUMENTS),
                    _keys_end(S, BLOCK_M, CAUSAL), BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        k = _tile(k_ptr, k_base, keys, dims, sks, S, D)
        v = _tile(v_ptr, v_base, keys, dims_v, svs, S, DV)
        seen = _seen(rows, keys, S, CAUSAL, WINDOW, WINDOWED, first, DOCUMENTS, _kept(kept_ptr, b, keys, S, PADDED))
        s = _dot(q, tl.trans(k), UPCAST, IEEE) * scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen no key yet (in a window, a tile wholly before it) keeps m = -inf:
        # shift by 0 there, so its terms are exp(-inf) = 0, not exp(-inf + inf).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        p = tl.exp(s - shift[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST, IEEE)
        m = m_new
    # A row that saw no key (past S, or all its keys padding) has denom 0: o = 0 there, lse -inf.
    denom = tl.where(denom > 0.0, denom, 1.0)
    o = acc / denom[:, None]
    tl.store(o_ptr + b * sob + h * soh + rows.to(tl.int64)[:, None] * sos + dims_v[None, :],
             round_to(o, o_ptr.dtype.element_ty), mask=(rows[:, None] < S) & (dims_v[None, :] < DV))
    tl.store(lse_ptr + b * slb + h * slh + rows.to(tl.int64) * sls, m + tl.log(denom), mask=rows < S)


@triton.jit
def attention_delta_kernel(
    delta_ptr, o_ptr, do_ptr, S, D, HQ,
    sob, soh, sos, sdb, sdh, sds,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """delta [B, Hq, S] float32 (contiguous) = rowsum(do * o); D, BLOCK_D: the value head dims."""
    b, h, _, rows, dims = _query_tile(HQ, 1, BLOCK_M, BLOCK_D)
    o = _tile(o_ptr, b * sob + h * soh, rows, dims, sos, S, D).to(tl.float32)
    do = _tile(do_ptr, b * sdb + h * sdh, rows, dims, sds, S, D).to(tl.float32)
    tl.store(delta_ptr + (b * HQ + h) * S + rows, tl.sum(o * do, axis=1), mask=rows < S)


@triton.jit
def attention_backward_kv_kernel(
    dk_ptr, dv_ptr, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, starts_ptr, kept_ptr,
    S, D, DV, HQ, HKV, GROUPS, scale, WINDOW, softcap,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, slb, slh, sls,
    sdkb, sdkh, sdks, sdvb, sdvh, sdvs,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, PADDED: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dk, dv of one key tile of one key/value head, summed over the query heads of its group."""
    bkv = tl.program_id(1)
    b, kvh = bkv // HKV, bkv % HKV
    keys = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dims, dims_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    k = _tile(k_ptr, b.to(tl.int64) * skb + kvh.to(tl.int64) * skh, keys, dims, sks, S, D)
    v = _tile(v_ptr, b.to(tl.int64) * svb + kvh.to(tl.int64) * svh, keys, dims_v, svs, S, DV)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    kept = _kept(kept_ptr, b.to(tl.int64), keys, S, PADDED)
    start, end = 0, S
    if CAUSAL:
        start = (tl.program_id(0) * BLOCK_N // BLOCK_M) * BLOCK_M    # query tiles below the diagonal
    if WINDOWED:
        end = tl.minimum(S, (tl.program_id(0) + 1) * BLOCK_N + WINDOW - 1)   # ... and within the window
    for g in range(0, GROUPS):
        h = kvh * GROUPS + g
        q_base = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
        do_base = b.to(tl.int64) * sdb + h.to(tl.int64) * sdh
        row_base = b.to(tl.int64) * slb + h.to(tl.int64) * slh
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            first = _row_starts(starts_ptr, b.to(tl.int64), rows, S, DOCUMENTS)
            q = _tile(q_ptr, q_base, rows, dims, sqs, S, D)
            do = _tile(do_ptr, do_base, rows, dims_v, sds, S, DV)
            lse = tl.load(lse_ptr + row_base + rows.to(tl.int64) * sls, mask=rows < S, other=0.0)
            delta = tl.load(delta_ptr + (b * HQ + h).to(tl.int64) * S + rows, mask=rows < S, other=0.0)
            st = _dot(k, tl.trans(q), UPCAST, IEEE) * scale                      # [keys, rows]
            if SOFTCAP:
                capped = _tanh(st / softcap)
                st = softcap * capped
            seen = _seen(rows, keys, S, CAUSAL, WINDOW, WINDOWED, first, DOCUMENTS, kept)
            pt = tl.where(tl.trans(seen), tl.exp(st - lse[None, :]), 0.0)
            dv += _dot(pt.to(do.dtype), do, UPCAST, IEEE)
            dpt = _dot(v, tl.trans(do), UPCAST, IEEE)
            dst = pt * (dpt - delta[None, :])
            if SOFTCAP:
                dst = dst * (1.0 - capped * capped)                              # through the cap
            dk += _dot(dst.to(q.dtype), q, UPCAST, IEEE)
    dk = dk * scale
    tl.store(dk_ptr + b.to(tl.int64) * sdkb + kvh.to(tl.int64) * sdkh + keys.to(tl.int64)[:, None] * sdks + dims[None, :],
             round_to(dk, dk_ptr.dtype.element_ty), mask=(keys[:, None] < S) & (dims[None, :] < D))
    tl.store(dv_ptr + b.to(tl.int64) * sdvb + kvh.to(tl.int64) * sdvh + keys.to(tl.int64)[:, None] * sdvs
             + dims_v[None, :], round_to(dv, dv_ptr.dtype.element_ty), mask=(keys[:, None] < S) & (dims_v[None, :] < DV))


@triton.jit
def attention_backward_q_kernel(
    dq_ptr, q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, starts_ptr, kept_ptr,
    S, D, DV, HQ, GROUPS, scale, WINDOW, softcap,
    sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sdb, sdh, sds, slb, slh, sls, sdqb, sdqh, sdqs,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, DOCUMENTS: tl.constexpr, PADDED: tl.constexpr,
    SOFTCAP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dq of one query tile of one head."""
    b, h, kvh, rows, dims = _query_tile(HQ, GROUPS, BLOCK_M, BLOCK_D)
    dims_v = tl.arange(0, BLOCK_DV)
    q = _tile(q_ptr, b * sqb + h * sqh, rows, dims, sqs, S, D)
    do = _tile(do_ptr, b * sdb + h * sdh, rows, dims_v, sds, S, DV)
    lse = tl.load(lse_ptr + b * slb + h * slh + rows.to(tl.int64) * sls, mask=rows < S, other=0.0)
    delta = tl.load(delta_ptr + (b * HQ + h) * S + rows, mask=rows < S, other=0.0)
    k_base, v_base = b * skb + kvh * skh, b * svb + kvh * svh
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    first = _row_starts(starts_ptr, b, rows, S, DOCUMENTS)
    for n0 in range(_keys_start(WINDOW, starts_ptr, b, S, BLOCK_M, BLOCK_N, WINDOWED, DOCUMENTS),
                    _keys_end(S, BLOCK_M, CAUSAL), BLOCK_N):
        keys = n0 + tl.arange(0, BLOCK_N)
        k = _tile(k_ptr, k_base, keys, dims, sks, S, D)
        v = _tile(v_ptr, v_base, keys, dims_v, svs, S, DV)
        s = _dot(q, tl.trans(k), UPCAST, IEEE) * scale
        if SOFTCAP:
            capped = _tanh(s / softcap)
            s = softcap * capped
        seen = _seen(rows, keys, S, CAUSAL, WINDOW, WINDOWED, first, DOCUMENTS, _kept(kept_ptr, b, keys, S, PADDED))
        p = tl.where(seen, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), UPCAST, IEEE)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - capped * capped)
        dq += _dot(ds.to(k.dtype), k, UPCAST, IEEE)
    dq = dq * scale
    tl.store(dq_ptr + b * sdqb + h * sdqh + rows.to(tl.int64)[:, None] * sdqs + dims[None, :],
             round_to(dq, dq_ptr.dtype.element_ty), mask=(rows[:, None] < S) & (dims[None, :] < D))


def _modes(dtype: torch.dtype) -> tuple[bool, bool]:
    interpret = bool(triton.knobs.runtime.interpret)
    return interpret or dtype == torch.float32, dtype == torch.float32


# Shared memory a block may opt into, per target: the data-centre parts hold three stages of
# key/value tiles in flight, the others two.
_LARGE_SHARED = {80, 90, 100}


def tiles(head_dim: int, dtype: torch.dtype, arch: int | None = None, value_dim: int | None = None
          ) -> tuple[dict, dict]:
    """(forward, backward) launch settings for a head dim (of q and k; `value_dim` of v, the same if
    None: latent attention's differ), dtype and target (sm_XY as XY; None under the interpreter).
    The forward: query tiles of BLOCK_M against key steps of BLOCK_N. The backward: tiles of BLOCK_N
    keys (the key pass) or queries (the dq pass) against steps of BLOCK_M of the other; the fp32
    dk and dv, or dq, of a tile are its accumulators."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    dims = dict(BLOCK_D=block_d, BLOCK_DV=max(16, triton.next_power_of_2(value_dim or head_dim)))
    widest = max(dims.values())
    if arch is None:
        small = dict(BLOCK_M=16, BLOCK_N=16, **dims, num_warps=4)
        return small, dict(small)
    stages = 3 if arch in _LARGE_SHARED else 2
    if widest > 128 or dtype == torch.float32:
        return (dict(BLOCK_M=64, BLOCK_N=32, **dims, num_warps=8, num_stages=2),
                dict(BLOCK_M=16, BLOCK_N=64, **dims, num_warps=8, num_stages=2))
    warps = 4 if widest <= 64 else 8
    return (dict(BLOCK_M=128, BLOCK_N=64, **dims, num_warps=warps, num_stages=stages),
            dict(BLOCK_M=32, BLOCK_N=128, **dims, num_warps=warps, num_stages=stages))


def _arch(device: torch.device) -> int | None:
    if triton.knobs.runtime.interpret or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def heads_layout(batch: int, heads: int, seq: int, dim: int) -> tuple[int, int, int, int]:
    """Strides of [B, S, H, D] memory viewed as [B, H, S, D]: the flash ops' result layout."""
    return seq * heads * dim, dim, heads * dim, 1


def _strides4(t: torch.Tensor) -> tuple[int, int, int]:
    assert t.stride(-1) == 1, "attention tiles read the head dim contiguous"
    return t.stride(0), t.stride(1), t.stride(2)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """(B, Hq, Hkv, S, D, Dv): v's head dim may differ from q's and k's (latent attention)."""
    batch, hq, seq, dim = q.shape
    hkv = k.shape[1]
    assert k.shape == (batch, hkv, seq, dim) and v.shape[:3] == k.shape[:3] and hq % hkv == 0, \
        (q.shape, k.shape, v.shape)
    return batch, hq, hkv, seq, dim, v.shape[3]


def _window(causal: bool, window: int | None, seq: int) -> int:
    """The window the kernels apply: 0 for none (none given, or one that holds the whole sequence)."""
    if not window or window >= seq:
        return 0
    assert causal and window > 0, f"a sliding window ({window}) is causal and of at least one key"
    return window


def _per_head(sinks: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """The sinks [Hq] as the kernels read them, or q standing in for a pointer never read."""
    if sinks is None:
        return q
    assert sinks.shape == (q.shape[1],) and sinks.is_floating_point(), sinks.shape
    assert sinks.device == q.device, f"the sinks are on {sinks.device}, the queries on {q.device}"
    return sinks.contiguous()


def _per_key(rows: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """A [B, S] operand as the kernels read it (contiguous), or q standing in for a pointer the
    kernels never read."""
    if rows is None:
        return q
    assert rows.shape == (q.shape[0], q.shape[2]) and not rows.is_floating_point(), rows.shape
    # A pointer the GPU cannot read (a host tensor) is refused by the launch with no name to it.
    assert rows.device == q.device, f"a [B, S] operand is on {rows.device}, the queries on {q.device}"
    return rows.contiguous()


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None,
                      out_stride=None, lse_stride=None, window: int | None = None,
                      starts: torch.Tensor | None = None, kept: torch.Tensor | None = None,
                      sinks: torch.Tensor | None = None, softcap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [B, Hq, S, Dv] in q.dtype, lse [B, Hq, S] float32); results at the strides asked (o: the
    flash layout by default, lse: contiguous)."""
    batch, hq, hkv, seq, dim, dim_v = _check(q, k, v)
    window = _window(causal, window, seq)
    assert causal or starts is None
    documents, padding = _per_key(starts, q), _per_key(kept, q)
    scale = dim ** -0.5 if scale is None else scale
    o = outputs.empty_strided((batch, hq, seq, dim_v), out_stride or heads_layout(batch, hq, seq, dim_v),
                              dtype=q.dtype, device=q.device)
    lse = outputs.empty_strided((batch, hq, seq), lse_stride or (hq * seq, seq, 1), dtype=torch.float32,
                                device=q.device)
    cfg, _ = tiles(dim, q.dtype, _arch(q.device), dim_v)
    upcast, ieee = _modes(q.dtype)
    if o.numel():
        attention_forward_kernel[(triton.cdiv(seq, cfg["BLOCK_M"]), batch * hq)](
            o, lse, q, k, v, documents, padding, _per_head(sinks, q), seq, dim, dim_v, hq, hq // hkv, scale, window,
            float(softcap or 1.0),
            *_strides4(q), *_strides4(k), *_strides4(v), *_strides4(o), *lse.stride(),
            CAUSAL=causal, WINDOWED=window > 0, DOCUMENTS=starts is not None, PADDED=kept is not None,
            SINKS=sinks is not None, SOFTCAP=bool(softcap), UPCAST=upcast, IEEE=ieee, **cfg)
    return o, lse


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool, scale: float | None = None,
                       dq_stride=None, dk_stride=None, dv_stride=None, window: int | None = None,
                       starts: torch.Tensor | None = None, kept: torch.Tensor | None = None, softcap: float = 0.0):
    """(dq, dk, dv, delta): the gradients at the strides asked (the flash layout by default) and
    delta = rowsum(do * o), float32 [B, Hq, S], the passes' one temporary."""
    batch, hq, hkv, seq, dim, dim_v = _check(q, k, v)
    window = _window(causal, window, seq)
    assert causal or starts is None
    documents, padding = _per_key(starts, q), _per_key(kept, q)
    scale = dim ** -0.5 if scale is None else scale
    delta = outputs.empty((batch, hq, seq), dtype=torch.float32, device=q.device)
    dq = outputs.empty_strided(q.shape, dq_stride or heads_layout(batch, hq, seq, dim), dtype=q.dtype, device=q.device)
    dk = outputs.empty_strided(k.shape, dk_stride or heads_layout(batch, hkv, seq, dim), dtype=k.dtype, device=k.device)
    dv = outputs.empty_strided(v.shape, dv_stride or heads_layout(batch, hkv, seq, dim_v), dtype=v.dtype,
                               device=v.device)
    if not dq.numel():
        return dq, dk, dv, delta
    _, cfg = tiles(dim, q.dtype, _arch(q.device), dim_v)
    upcast, ieee = _modes(q.dtype)
    flags = dict(CAUSAL=causal, WINDOWED=window > 0, DOCUMENTS=starts is not None, PADDED=kept is not None,
                 SOFTCAP=bool(softcap), UPCAST=upcast, IEEE=ieee)
    launch = {key: value for key, value in cfg.items() if key.startswith("num_")}
    common = (*_strides4(q), *_strides4(k), *_strides4(v), *_strides4(do), *lse.stride())
    rows, keys, dims = cfg["BLOCK_M"], cfg["BLOCK_N"], dict(BLOCK_D=cfg["BLOCK_D"], BLOCK_DV=cfg["BLOCK_DV"])
    attention_delta_kernel[(triton.cdiv(seq, keys), batch * hq)](
        delta, o, do, seq, dim_v, hq, *_strides4(o), *_strides4(do), BLOCK_M=keys, BLOCK_D=dims["BLOCK_DV"], **launch)
    attention_backward_kv_kernel[(triton.cdiv(seq, keys), batch * hkv)](
        dk, dv, q, k, v, do, lse, delta, documents, padding, seq, dim, dim_v, hq, hkv, hq // hkv, scale, window,
        float(softcap or 1.0), *common,
        *_strides4(dk), *_strides4(dv), **flags, BLOCK_M=rows, BLOCK_N=keys, **dims, **launch)
    # The dq pass: tall query tiles (the key pass's BLOCK_N) against short key steps (its BLOCK_M).
    attention_backward_q_kernel[(triton.cdiv(seq, keys), batch * hq)](
        dq, q, k, v, do, lse, delta, documents, padding, seq, dim, dim_v, hq, hq // hkv, scale, window,
        float(softcap or 1.0), *common,
        *_strides4(dq), **flags,
        BLOCK_M=keys, BLOCK_N=rows, **dims, **launch)
    return dq, dk, dv, delta


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, window, starts, kept, sinks, softcap):
        o, lse = attention_forward(q, k, v, causal, scale, window=window, starts=starts, kept=kept, sinks=sinks,
                                   softcap=softcap)
        ctx.save_for_backward(q, k, v, o, lse, sinks)
        ctx.causal, ctx.scale, ctx.window, ctx.starts, ctx.kept = causal, scale, window, starts, kept
        ctx.softcap = softcap
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, sinks = ctx.saved_tensors
        dq, dk, dv, delta = attention_backward(do.contiguous() if do.stride(-1) != 1 else do, q, k, v, o, lse,
                                               ctx.causal, ctx.scale, window=ctx.window, starts=ctx.starts,
                                               kept=ctx.kept, softcap=ctx.softcap)
        dsinks = None if sinks is None else attention_sinks_backward(sinks, lse, delta)
        return dq, dk, dv, None, None, None, None, None, dsinks, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, window: int | None = None, starts: torch.Tensor | None = None,
              kept: torch.Tensor | None = None, sinks: torch.Tensor | None = None, softcap: float = 0.0
              ) -> torch.Tensor:
    """scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, enable_gqa=True) for
    q [B, Hq, S, D], k and v [B, Hkv, S, D], each query seeing only its last `window` keys if
    given, only the keys of its own document if `starts` ([B, S], each query's document's first
    key) is, and only the keys `kept` ([B, S] bool) holds if it is, each head's softmax joined by
    its sink logit if `sinks` ([Hq]) is, the scores capped to softcap * tanh(s / softcap) if
    `softcap` is not 0; differentiable in q, k, v and the sinks."""
    return AttentionFunction.apply(q, k, v, causal, scale, window, starts, kept, sinks, softcap)
