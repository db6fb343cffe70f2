"""Every kernel against its reference (forward and backward, fp32 and bf16) plus the sm_80/sm_90
compile of every specialization that ran: the body of `python -m megacompile.kernels --check`.

Error is max |out - ref| / max |ref| over each output (so a wrong small gradient cannot hide under
an absolute tolerance), the largest over a kernel's outputs in one direction.
"""
import math
import time
from dataclasses import dataclass, field

import torch
import triton

from . import reference as ref
from .adamw import adamw_step_
from .attention import attention
from .cast import accumulate_, cast, scale
from .embedding import embedding_backward
from .fused_linear_cross_entropy import fused_linear_cross_entropy
from .gelu import geglu, gelu
from .grouped_gemm import grouped_matmul
from .gpu_compile import ARCHS, compile_launches, kernels, record_launches
from .layer_norm import layer_norm
from .linear_logprobs import linear_logprobs
from .rms_norm import rms_norm
from .rope import rope
from .softmax import softmax
from .swiglu import swiglu

# Under the interpreter kernels read host memory; with a GPU (and the interpreter off) they run on it.
DEVICE = torch.device("cpu" if triton.knobs.runtime.interpret or not torch.cuda.is_available() else "cuda")
DTYPES = (torch.float32, torch.bfloat16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
EXACT = 0.0

# (name, odd shapes): "check" is the command line's size, "test" keeps pytest fast
SHAPES = {
    "check": dict(rows=(1823, 781), rope=(2, 7, 3, 301, 96), attn=(2, 3, 301, 301), lm=(1823, 781, 3001),
                  experts=((0, 1, 700, 0, 122), 96, 200)),
    "test": dict(rows=(37, 129), rope=(2, 3, 2, 19, 24), attn=(2, 2, 37, 37), lm=(67, 33, 257),
                 experts=((0, 1, 35, 0, 1), 24, 40)),
}


def relative_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    out, expected = out.detach().float(), expected.detach().float()
    assert out.shape == expected.shape, f"shape {tuple(out.shape)} != reference {tuple(expected.shape)}"
    scale = expected.abs().max().item()
    diff = (out - expected).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_autograd(fn, reference, inputs, grad_inputs, seed: int = 0) -> tuple[float, float]:
    """(forward error, backward error) of fn against reference on copies of inputs.

    grad_inputs: indices of the inputs that get gradients; every output gets a random upstream grad.
    """
    def leaves():
        return [
            t.detach().clone().requires_grad_(i in grad_inputs) if isinstance(t, torch.Tensor) else t
            for i, t in enumerate(inputs)
        ]

    xs, rs = leaves(), leaves()
    outs, refs = fn(*xs), reference(*rs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    refs = refs if isinstance(refs, tuple) else (refs,)
    forward = max(relative_error(o, r) for o, r in zip(outs, refs, strict=True))
    gen = torch.Generator().manual_seed(seed)
    upstream = [torch.randn(r.shape, generator=gen).to(r.device, r.dtype) for r in refs]
    torch.autograd.backward(outs, upstream)
    torch.autograd.backward(refs, upstream)
    backward = max(relative_error(xs[i].grad, rs[i].grad) for i in grad_inputs)
    return forward, backward


def _randn(*shape, dtype, gen, scale=1.0, offset=0.0):
    """Seeded on the host (the same numbers on every machine), then moved to DEVICE."""
    return (torch.randn(*shape, generator=gen) * scale + offset).to(DEVICE, dtype)


# Each case: (dtype, shapes, gen) -> (forward error, backward error or nan where there is none)
def case_rms_norm(dtype, s, gen):
    m, n = s["rows"]
    x, w = _randn(m, n, dtype=dtype, gen=gen), _randn(n, dtype=dtype, gen=gen, scale=0.1, offset=1.0)
    return compare_autograd(
        lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: ref.rms_norm_ref(x, w, 1e-6), (x, w), (0, 1)
    )


def case_rms_norm_frozen(dtype, s, gen):
    """The weight frozen (LoRA): the backward makes dx alone (WEIGHT_GRAD=False)."""
    m, n = s["rows"]
    x, w = _randn(m, n, dtype=dtype, gen=gen), _randn(n, dtype=dtype, gen=gen, scale=0.1, offset=1.0)
    return compare_autograd(
        lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: ref.rms_norm_ref(x, w, 1e-6), (x, w), (0,)
    )


def case_layer_norm(dtype, s, gen):
    m, n = s["rows"]
    x = _randn(m, n, dtype=dtype, gen=gen, offset=0.5)
    w, b = _randn(n, dtype=dtype, gen=gen, scale=0.1, offset=1.0), _randn(n, dtype=dtype, gen=gen, scale=0.1)
    return compare_autograd(layer_norm, ref.layer_norm_ref, (x, w, b), (0, 1, 2))


def case_layer_norm_frozen(dtype, s, gen):
    """The weight and bias frozen (LoRA, freeze): the backward makes dx alone (WEIGHT_GRAD=False)."""
    m, n = s["rows"]
    x = _randn(m, n, dtype=dtype, gen=gen, offset=0.5)
    w, b = _randn(n, dtype=dtype, gen=gen, scale=0.1, offset=1.0), _randn(n, dtype=dtype, gen=gen, scale=0.1)
    return compare_autograd(layer_norm, ref.layer_norm_ref, (x, w, b), (0,))


def case_swiglu(dtype, s, gen):
    a, b = _randn(*s["rows"], dtype=dtype, gen=gen, scale=3.0), _randn(*s["rows"], dtype=dtype, gen=gen)
    return compare_autograd(swiglu, ref.swiglu_ref, (a, b), (0, 1))


def _case_gelu(gated: bool, approximate: str):
    def case(dtype, s, gen):
        a, b = _randn(*s["rows"], dtype=dtype, gen=gen, scale=3.0), _randn(*s["rows"], dtype=dtype, gen=gen)
        if gated:
            return compare_autograd(
                lambda a, b: geglu(a, b, approximate), lambda a, b: ref.gelu_ref(a, b, approximate), (a, b), (0, 1)
            )
        return compare_autograd(
            lambda a: gelu(a, approximate), lambda a: ref.gelu_ref(a, None, approximate), (a,), (0,)
        )
    return case


def rope_inputs(dtype, s, gen, batched_table: bool = True):
    """q, k as HF makes them ([B, S, H, D] projections viewed as [B, H, S, D]) and cos, sin tables."""
    batch, hq, hkv, seq, dim = s["rope"]
    q = _randn(batch, seq, hq, dim, dtype=dtype, gen=gen).transpose(1, 2)
    k = _randn(batch, seq, hkv, dim, dtype=dtype, gen=gen).transpose(1, 2)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    positions = torch.arange(seq, dtype=torch.float32)[None, :] + 3.0 * torch.arange(batch)[:, None]
    angles = positions[..., None] * inv_freq  # [B, S, D/2]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype)
    if not batched_table:
        cos, sin = cos[0], sin[0]
    return q, k, cos, sin


def case_rope(dtype, s, gen):
    return compare_autograd(rope, ref.rope_ref, rope_inputs(dtype, s, gen), (0, 1))


def _case_softmax(causal: bool):
    def case(dtype, s, gen):
        shape = s["attn"] if causal else s["rows"]
        scale = 1.0 / math.sqrt(96) if causal else 1.0
        x = _randn(*shape, dtype=dtype, gen=gen, scale=4.0)
        return compare_autograd(
            lambda x: softmax(x, scale, causal), lambda x: ref.softmax_ref(x, scale, causal), (x,), (0,)
        )
    return case


def _documents(batch: int, seq: int) -> list[list[int]]:
    """Document lengths per row, laid end to end: one-token documents, one longer than a tile,
    boundaries inside tiles; the last row one document."""
    first = [1, 5, 1, seq // 2]
    return [[*first, seq - sum(first)], *[[seq]] * (batch - 1)]


def _padding(batch: int, seq: int) -> torch.Tensor:
    """[B, S] bool: row 0 padded on the left (its first queries see no key: o = 0, no gradient),
    row 1 on the right, the others not at all."""
    kept = torch.ones(batch, seq, dtype=torch.bool)
    kept[0, :3] = False
    kept[min(1, batch - 1), seq - 4:] = False
    return kept


def _case_attention(causal: bool, window: int | None = None, documents: bool = False, padded: bool = False,
                    sinks: bool = False, softcap: float = 0.0):
    """Grouped-query heads (3 query heads per key/value head), a sequence no tile divides, q, k, v
    as HF makes them ([B, S, H, D] projections viewed [B, H, S, D]); a window (causal) shorter than
    a tile, so tiles hold rows that see none of a key tile; documents packed in a row; attention
    sinks (GPT-OSS), differentiated with q, k and v; Gemma 2's logit softcapping (a cap the
    scores pass)."""
    def case(dtype, s, gen):
        batch, hq, hkv, seq, dim = s["rope"]
        hq = 3 * hkv
        q, k, v = (_randn(batch, seq, h, dim, dtype=dtype, gen=gen).transpose(1, 2) for h in (hq, hkv, hkv))
        scale = 0.7 / math.sqrt(dim)
        starts = ref.document_starts(_documents(batch, seq), device=DEVICE) if documents else None
        kept = _padding(batch, seq).to(DEVICE) if padded else None
        if sinks:
            logits = _randn(hq, dtype=dtype, gen=gen)
            return compare_autograd(lambda q, k, v, z: attention(q, k, v, causal, scale, window, starts, kept, z),
                                    lambda q, k, v, z: ref.attention_ref(q, k, v, causal, scale, window, starts, kept, z),
                                    (q, k, v, logits), (0, 1, 2, 3))
        if softcap:
            return compare_autograd(
                lambda q, k, v: attention(q, k, v, causal, scale, window, starts, kept, softcap=softcap),
                lambda q, k, v: ref.attention_ref(q, k, v, causal, scale, window, starts, kept, softcap=softcap),
                (q, k, v), (0, 1, 2))
        return compare_autograd(lambda q, k, v: attention(q, k, v, causal, scale, window, starts, kept),
                                lambda q, k, v: ref.attention_ref(q, k, v, causal, scale, window, starts, kept),
                                (q, k, v), (0, 1, 2))
    return case


def case_embedding_backward(dtype, s, gen):
    """The [V, H] weight gradient: ids that repeat (one in a run of 40 rows), ids no token has, a
    padding_idx whose row stays zero; against ATen's op summing in float32 (no backward of its own)."""
    m, n = s["rows"]
    vocab = 97
    ids = torch.randint(0, vocab - 2, (m,), generator=gen)      # ids 95 and 96: no token has them
    ids[:40] = 3
    grad = _randn(m, n, dtype=dtype, gen=gen)
    ids = ids.to(DEVICE)
    out = embedding_backward(grad, ids, vocab, 5)
    expected = torch.ops.aten.embedding_dense_backward(grad.float(), ids, vocab, 5, False)
    return relative_error(out, expected), math.nan


def lm_inputs(dtype, s, gen, ignore_fraction: float = 0.1):
    n, hidden, vocab = s["lm"]
    h = _randn(n, hidden, dtype=dtype, gen=gen)
    w = _randn(vocab, hidden, dtype=dtype, gen=gen, scale=hidden**-0.5)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < ignore_fraction] = -100
    return h, w, labels.to(DEVICE)


def case_fused_linear_cross_entropy(dtype, s, gen):
    h, w, labels = lm_inputs(dtype, s, gen)
    return compare_autograd(
        lambda h, w, y: fused_linear_cross_entropy(h, w, y), ref.fused_linear_cross_entropy_ref, (h, w, labels), (0, 1)
    )


def case_fused_linear_cross_entropy_softcap(dtype, s, gen):
    """Gemma 2's final logit softcapping, with logits scaled past a cap of 2 so tanh bends them."""
    h, w, labels = lm_inputs(dtype, s, gen)
    h = h * 4
    return compare_autograd(lambda h, w, y: fused_linear_cross_entropy(h, w, y, softcap=2.0),
                            lambda h, w, y: ref.fused_linear_cross_entropy_ref(h, w, y, softcap=2.0),
                            (h, w, labels), (0, 1))


def case_linear_logprobs(dtype, s, gen):
    """Each token's log-probability (the post-training losses' read), its gradient under a random
    upstream gradient per token; ignored positions masked to token 0 first, as the losses do."""
    h, w, labels = lm_inputs(dtype, s, gen)
    labels = labels.clamp(min=0)
    return compare_autograd(lambda h, w, y: linear_logprobs(h, w, y), ref.linear_logprobs_ref, (h, w, labels), (0, 1))


def case_linear_logprobs_temperature(dtype, s, gen):
    """The logits divided by GRPO's temperature before the log-softmax."""
    h, w, labels = lm_inputs(dtype, s, gen)
    return compare_autograd(lambda h, w, y: linear_logprobs(h, w, y, temperature=0.7),
                            lambda h, w, y: ref.linear_logprobs_ref(h, w, y, temperature=0.7),
                            (h, w, labels.clamp(min=0)), (0, 1))


def case_grouped_gemm(dtype, s, gen):
    """Rows per expert with empty experts, a one-row expert and one that takes nearly all."""
    counts, k, n = s["experts"]
    x = _randn(sum(counts), k, dtype=dtype, gen=gen)
    w = _randn(len(counts), k, n, dtype=dtype, gen=gen, scale=k**-0.5)
    offs = torch.tensor(counts).cumsum(0).to(DEVICE, torch.int32)
    return compare_autograd(grouped_matmul, ref.grouped_mm_ref, (x, w, offs), (0, 1))


def case_adamw(dtype, s, gen, steps: int = 3):
    """dtype is the gradient's; three steps from a warm state, with the bf16 copy-out."""
    shape = s["rows"]
    p = _randn(*shape, dtype=torch.float32, gen=gen)
    m = _randn(*shape, dtype=torch.float32, gen=gen, scale=1e-2)
    v = _randn(*shape, dtype=torch.float32, gen=gen, scale=1e-2).square()
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    kp, km, kv, out = p.clone(), m.clone(), v.clone(), torch.empty(shape, dtype=torch.bfloat16, device=DEVICE)
    err = 0.0
    for step in range(1, steps + 1):
        g = _randn(*shape, dtype=dtype, gen=gen, scale=1e-2)
        adamw_step_(kp, g, km, kv, step=step, out=out, **hyper)
        p, m, v = ref.adamw_ref(p, g, m, v, step=step, **hyper)
        err = max(err, relative_error(kp, p), relative_error(km, m), relative_error(kv, v))
    # The copy-out is the new master rounded once: compared with the kernel's own master (a
    # master one ulp off the reference, within tolerance, may round to the next bf16).
    return max(err, relative_error(out, ref.cast_ref(kp))), math.nan


def case_cast(dtype, s, gen):
    """fp32 -> dtype over values at every scale plus the special ones: the bits must match torch's."""
    exponents = torch.randint(-130, 120, s["rows"], generator=gen).to(DEVICE)
    x = _randn(*s["rows"], dtype=torch.float32, gen=gen) * torch.exp2(exponents)
    x.view(-1)[:6] = torch.tensor([float("inf"), -float("inf"), 3.4028235e38, -0.0, 1e-45, 1.0 + 2**-8], device=DEVICE)
    out, expected = cast(x, dtype), ref.cast_ref(x, dtype)
    same_bits = torch.equal(out.view(torch.int16), expected.view(torch.int16))
    return (0.0 if same_bits else math.inf), math.nan


def case_accumulate(dtype, s, gen):
    acc, g = _randn(*s["rows"], dtype=torch.float32, gen=gen), _randn(*s["rows"], dtype=dtype, gen=gen)
    expected = ref.accumulate_ref(acc, g)
    accumulate_(acc, g)
    return (0.0 if torch.equal(acc, expected) else math.inf), math.nan


def case_scale(dtype, s, gen):
    """x * (1/3) in fp32, rounded once to x's dtype: the bits must match torch's fp32 product cast."""
    x = _randn(*s["rows"], dtype=dtype, gen=gen)
    factor = torch.tensor(1 / 3, device=DEVICE)
    same = torch.equal(scale(x, factor), (x.float() * factor).to(dtype))
    return (0.0 if same else math.inf), math.nan


# (table name, case, dtypes, tolerance per dtype)
CASES = [
    ("rms_norm", case_rms_norm, DTYPES, TOLERANCE),
    ("rms_norm(frozen w)", case_rms_norm_frozen, DTYPES, TOLERANCE),
    ("layer_norm", case_layer_norm, DTYPES, TOLERANCE),
    ("layer_norm(frozen w)", case_layer_norm_frozen, DTYPES, TOLERANCE),
    ("swiglu", case_swiglu, DTYPES, TOLERANCE),
    ("gelu(erf)", _case_gelu(False, "none"), DTYPES, TOLERANCE),
    ("gelu(tanh)", _case_gelu(False, "tanh"), DTYPES, TOLERANCE),
    ("geglu(erf)", _case_gelu(True, "none"), DTYPES, TOLERANCE),
    ("geglu(tanh)", _case_gelu(True, "tanh"), DTYPES, TOLERANCE),
    ("rope", case_rope, DTYPES, TOLERANCE),
    # dx = y * (dy - sum(dy * y)) cancels: eager fp32 is itself ~1e-5 from the float64 answer here
    ("softmax", _case_softmax(False), DTYPES, {torch.float32: 5e-5, torch.bfloat16: 1e-2}),
    ("softmax(causal)", _case_softmax(True), DTYPES, {torch.float32: 5e-5, torch.bfloat16: 1e-2}),
    ("attention", _case_attention(False), DTYPES, TOLERANCE),
    ("attention(causal)", _case_attention(True), DTYPES, TOLERANCE),
    ("attention(window)", _case_attention(True, window=3), DTYPES, TOLERANCE),
    ("attention(documents)", _case_attention(True, documents=True), DTYPES, TOLERANCE),
    ("attention(win,docs)", _case_attention(True, window=3, documents=True), DTYPES, TOLERANCE),
    ("attention(padded)", _case_attention(True, window=3, padded=True), DTYPES, TOLERANCE),
    ("attention(sinks)", _case_attention(True, window=3, padded=True, sinks=True), DTYPES, TOLERANCE),
    ("attention(softcap)", _case_attention(True, window=3, softcap=0.5), DTYPES, TOLERANCE),
    ("embedding_backward", case_embedding_backward, DTYPES, TOLERANCE),
    ("fused_linear_ce", case_fused_linear_cross_entropy, DTYPES, TOLERANCE),
    ("fused_linear_ce(cap)", case_fused_linear_cross_entropy_softcap, DTYPES, TOLERANCE),
    ("linear_logprobs", case_linear_logprobs, DTYPES, TOLERANCE),
    ("linear_logprobs(temp)", case_linear_logprobs_temperature, DTYPES, TOLERANCE),
    ("grouped_gemm", case_grouped_gemm, DTYPES, TOLERANCE),
    ("adamw", case_adamw, DTYPES, {torch.float32: 1e-6, torch.bfloat16: 1e-6}),
    ("cast_fp32_to_bf16", case_cast, (torch.bfloat16,), {torch.bfloat16: EXACT}),
    ("accumulate_grad", case_accumulate, DTYPES, {torch.float32: EXACT, torch.bfloat16: EXACT}),
    ("scale", case_scale, DTYPES, {torch.float32: EXACT, torch.bfloat16: EXACT}),
]


@dataclass
class Row:
    kernel: str
    dtype: torch.dtype
    forward: float
    backward: float
    tol: float
    seconds: float
    launches: list = field(default_factory=list)
    compiled: dict = field(default_factory=dict)  # arch -> "ok" or the first error
    error: str = ""               # what the case raised: the row fails, the other cases still run

    @property
    def passed(self) -> bool:
        errors_ok = all(math.isnan(e) or e <= self.tol for e in (self.forward, self.backward))
        return not self.error and errors_ok and bool(self.launches) and all(r == "ok" for r in self.compiled.values())


def run(size: str = "check", compile_gpu: bool = True, only: str | None = None, seed: int = 0) -> list[Row]:
    """Run every case; then compile every launched specialization for each arch in ARCHS."""
    rows = []
    for name, case, dtypes, tol in CASES:
        if only and only not in name:
            continue
        for dtype in dtypes:
            start = time.perf_counter()
            error = ""
            with record_launches() as launches:
                try:
                    fwd, bwd = case(dtype, SHAPES[size], torch.Generator().manual_seed(seed))
                except Exception as e:     # one kernel failing on a new GPU must not hide the others
                    fwd = bwd = math.nan
                    error = f"{type(e).__name__}: {e}"
            rows.append(Row(name, dtype, fwd, bwd, tol[dtype], time.perf_counter() - start, list(launches.values()),
                            error=error))
    if compile_gpu:
        unique = {launch.key: launch for row in rows for launch in row.launches}
        results = compile_launches(unique.values())
        for row in rows:
            for arch in ARCHS:
                failures = [f"{x.kernel}: {results[x.key][arch]}" for x in row.launches if results[x.key][arch] != "ok"]
                row.compiled[arch] = failures[0] if failures else "ok"
    return rows


def uncovered(rows: list[Row]) -> list[str]:
    """Kernels that no case launched."""
    launched = {x.kernel for row in rows for x in row.launches}
    return [name for _, name, _ in kernels() if name not in launched]


def format_table(rows: list[Row]) -> str:
    def num(x):
        return "-" if math.isnan(x) else f"{x:.2e}"

    header = (f"{'kernel':<20} {'dtype':<9} {'fwd err':>9} {'bwd err':>9} {'tol':>9} "
              + "".join(f"{f'sm_{a}':>7}" for a in ARCHS) + f" {'s':>6}  result")
    lines = [header, "-" * len(header)]
    for r in rows:
        sm = [("ok" if r.compiled.get(a) == "ok" else ("-" if a not in r.compiled else "FAIL")) for a in ARCHS]
        lines.append(
            f"{r.kernel:<20} {str(r.dtype).replace('torch.', ''):<9} {num(r.forward):>9} {num(r.backward):>9} "
            f"{num(r.tol):>9}" + "".join(f"{x:>7}" for x in sm) + f" {r.seconds:>6.1f}  {'pass' if r.passed else 'FAIL'}"
        )
    for r in rows:
        if r.error:
            lines.append(f"  {r.kernel} {r.dtype}: {r.error}")
        for arch, result in r.compiled.items():
            if result != "ok":
                lines.append(f"  {r.kernel} {r.dtype} sm_{arch}: {result}")
    return "\n".join(lines)
