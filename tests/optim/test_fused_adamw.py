"""The host fused AdamW against torch.optim.AdamW in float32, on both backends.

Sizes are odd on purpose: none is a multiple of a vector width, so every vector body has a tail.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from megacompile.errors import OptimizerInputError
from megacompile import native
from megacompile.optim import fused_adamw

SIZES = [1, 7, 17, 1023, 100003]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8)


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path_factory.mktemp("megacompile_cache")))
        yield


@pytest.fixture(params=["cpp", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setenv("MEGACOMPILE_HOST_ADAM", "torch")
    else:
        monkeypatch.delenv("MEGACOMPILE_HOST_ADAM", raising=False)
        if native.compiler() is None:
            pytest.skip("no C++ compiler on this machine")
    assert fused_adamw.backend() == request.param
    return request.param


def assert_state_close(actual, expected, lr):
    """(master, exp_avg, exp_avg_sq) within 1e-6 relative.

    torch's float32 sqrt on CPU (MKL) is not always correctly rounded and ours is, so an update
    lr * m / denom may differ by an ulp: near zero, a master is allowed 1e-6 of the update size.
    """
    for a, e, atol in zip(actual, expected, (1e-6 * lr, 1e-12, 1e-12)):
        torch.testing.assert_close(a, e, rtol=1e-6, atol=atol)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def make_block(numel, steps, grad_dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen).to(grad_dtype) for _ in range(steps)]
    return master, grads


def torch_reference(master, grads, *, weight_decay, grad_scale=1.0, lr, beta1, beta2, eps):
    """torch.optim.AdamW on float32, fed grad.float() * grad_scale: returns master, m, v."""
    param = torch.nn.Parameter(master.clone())
    optimizer = torch.optim.AdamW([param], lr=lr, betas=(beta1, beta2), eps=eps,
                                  weight_decay=weight_decay, foreach=False, fused=False)
    for grad in grads:
        param.grad = grad.float() * grad_scale
        optimizer.step()
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"], state["exp_avg_sq"]


def fused(master, grads, *, out=None, **hyper):
    """megacompile's update from zero state over `grads`: returns master, m, v."""
    master = master.clone()
    exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    for step, grad in enumerate(grads, start=1):
        grad_before = grad.clone()
        fused_adamw.adamw_update_(master, grad, exp_avg, exp_avg_sq, step=step, out=out, **hyper)
        assert torch.equal(grad, grad_before), "the update wrote into the caller's grad"
    return master, exp_avg, exp_avg_sq


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_adamw_over_steps(backend, numel, weight_decay, grad_dtype):
    master, grads = make_block(numel, steps=4, grad_dtype=grad_dtype)
    expected = torch_reference(master, grads, weight_decay=weight_decay, **HYPER)
    actual = fused(master, grads, weight_decay=weight_decay, **HYPER)
    assert_state_close(actual, expected, HYPER["lr"])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_scale_multiplies_the_grad(backend, grad_dtype):
    master, grads = make_block(1023, steps=3, grad_dtype=grad_dtype)
    hyper = dict(HYPER, weight_decay=0.1, grad_scale=0.37)
    expected = torch_reference(master, grads, **hyper)
    actual = fused(master, grads, **hyper)
    assert_state_close(actual, expected, HYPER["lr"])


def test_other_hyperparameters(backend):
    # beta1 < 0.5 takes the other branch of torch's lerp; a large eps and lr move every term.
    master, grads = make_block(1023, steps=3)
    hyper = dict(lr=0.05, beta1=0.3, beta2=0.95, eps=1e-3, weight_decay=0.5)
    expected = torch_reference(master, grads, **hyper)
    actual = fused(master, grads, **hyper)
    assert_state_close(actual, expected, hyper["lr"])


def test_backend_argument_picks_the_implementation(monkeypatch):
    monkeypatch.delenv("MEGACOMPILE_HOST_ADAM", raising=False)
    if fused_adamw.backend() != "cpp":
        pytest.skip("no native kernel on this machine")
    master, grads = make_block(100003, steps=2)
    native = fused(master, grads, weight_decay=0.1, **HYPER)
    as_cpp = fused(master, grads, weight_decay=0.1, backend="cpp", **HYPER)
    as_torch = fused(master, grads, weight_decay=0.1, backend="torch", **HYPER)
    monkeypatch.setenv("MEGACOMPILE_HOST_ADAM", "torch")
    forced = fused(master, grads, weight_decay=0.1, **HYPER)
    for pair in [*zip(as_cpp, native), *zip(as_torch, forced)]:
        assert torch.equal(*(bits(t) for t in pair))
    with pytest.raises(OptimizerInputError, match="native kernel is unavailable"):
        fused(master, grads, weight_decay=0.1, backend="cpp", **HYPER)
    with pytest.raises(OptimizerInputError, match="backend"):
        fused(master, grads, weight_decay=0.1, backend="numpy", **HYPER)


def test_bf16_grad_is_read_exactly(backend):
    master, grads = make_block(1023, steps=2, grad_dtype=torch.bfloat16)
    from_bf16 = fused(master, grads, weight_decay=0.1, **HYPER)
    from_fp32 = fused(master, [g.float() for g in grads], weight_decay=0.1, **HYPER)
    for a, e in zip(from_bf16, from_fp32):
        assert torch.equal(bits(a), bits(e))


@pytest.mark.parametrize("numel", [7, 1023, 100003])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_out_is_the_new_master_cast(backend, numel, out_dtype):
    master, grads = make_block(numel, steps=2, grad_dtype=torch.bfloat16)
    out = torch.full((numel,), float("nan"), dtype=out_dtype)
    new_master, _, _ = fused(master, grads, out=out, weight_decay=0.1, **HYPER)
    assert torch.equal(bits(out), bits(new_master.to(out_dtype)))


def rounding_cases() -> torch.Tensor:
    """Float32 bit patterns whose bf16 cast is easy to get wrong: ties to even in both directions,
    the largest finite float (rounds to inf), subnormals, infinities and signed zeros."""
    patterns = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0xBF808000, 0xBF818000,
                0x7F7FFFFF, 0xFF7FFFFF, 0x00008000, 0x00018000, 0x007FFFFF, 0x80000001,
                0x7F800000, 0xFF800000, 0x00000000, 0x80000000, 0x3DCCCCCD, 0x40490FDB]
    pattern_bits = torch.tensor(patterns, dtype=torch.int64).repeat(61)[:1097]  # odd length
    signed = pattern_bits - (pattern_bits >= 2**31).long() * 2**32
    return signed.to(torch.int32).view(torch.float32)


def cast_through_update(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(master after the update, out) for lr = 0: the masters stay as they are."""
    grad = torch.rand(master.numel()) + 0.1  # m > 0, so lr * m is -0.0 and keeps a -0.0 master
    out = torch.empty(master.numel(), dtype=torch.bfloat16)
    updated = master.clone()
    fused_adamw.adamw_update_(updated, grad, torch.zeros_like(master), torch.zeros_like(master),
                              lr=0.0, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1,
                              out=out)
    return updated, out


def test_out_bf16_rounds_to_nearest_even(backend):
    master = rounding_cases()
    updated, out = cast_through_update(master)
    assert torch.equal(bits(updated), bits(master))
    assert torch.equal(bits(out), bits(master.to(torch.bfloat16)))


def test_out_bf16_keeps_nan(backend):
    # NaNs whose payload fills the low bits: rounding them as numbers would carry into the sign
    # (0x7FFFFFFF -> -0.0) or wrap around (0xFFFFFFFF -> +0.0).
    master = torch.randn(1023)
    master.view(torch.int32)[::5] = 0x7FFFFFFF
    master.view(torch.int32)[1::5] = -1
    master[2::5] = float("nan")
    out = torch.empty(1023, dtype=torch.bfloat16)
    fused_adamw.adamw_update_(master, torch.randn(1023), torch.zeros(1023), torch.zeros(1023),
                              step=1, out=out, weight_decay=0.0, **HYPER)
    assert torch.equal(torch.isnan(out), torch.isnan(master))
    assert torch.isnan(master[::5]).all() and torch.isnan(master[1::5]).all()


def test_slices_match_the_whole(backend):
    # Updating a block in short, misaligned slices runs the scalar prologue and tail where the
    # whole-block call runs vectors: both must round identically.
    master, grads = make_block(10007, steps=2, grad_dtype=torch.bfloat16)
    out_whole = torch.empty(10007, dtype=torch.bfloat16)
    whole = fused(master, grads, out=out_whole, weight_decay=0.1, **HYPER)

    sliced = [master.clone(), torch.zeros(10007), torch.zeros(10007)]
    out_sliced = torch.empty(10007, dtype=torch.bfloat16)
    bounds = [0, 3, 40, 41, 1000, 1037, 5003, 10007]
    for step, grad in enumerate(grads, start=1):
        for lo, hi in zip(bounds, bounds[1:]):
            fused_adamw.adamw_update_(*(t[lo:hi] for t in (sliced[0], grad, *sliced[1:])),
                                      step=step, out=out_sliced[lo:hi], weight_decay=0.1, **HYPER)
    for a, e in zip([*sliced, out_sliced], [*whole, out_whole]):
        assert torch.equal(bits(a), bits(e))


def test_thread_count_does_not_change_the_result(monkeypatch):
    master, grads = make_block(300007, steps=1, grad_dtype=torch.bfloat16)
    results, norms = [], []
    for threads in (1, 2, 3):
        monkeypatch.setattr(fused_adamw, "_num_threads", None)
        fused_adamw.set_num_threads(threads)
        assert fused_adamw.get_num_threads() == threads
        results.append(fused(master, grads, weight_decay=0.1, **HYPER))
        norms.append(fused_adamw.grad_sq_norm(grads[0]))
    for other in results[1:]:
        for a, e in zip(other, results[0]):
            assert torch.equal(bits(a), bits(e))
    assert norms[1:] == norms[:-1]  # partial sums are added in a fixed order
    with pytest.raises(OptimizerInputError):
        fused_adamw.set_num_threads(0)


@pytest.mark.parametrize("narrower", [["-mno-avx512f"], ["-mno-avx512f", "-mno-avx2", "-mno-fma"]],
                         ids=["avx2", "scalar"])
def test_narrower_instruction_sets_give_the_same_bits(monkeypatch, narrower):
    # This machine's -march=native build runs one vector body; building without it runs the
    # others here too.
    compiler = native.compiler()
    if compiler is None or "avx512f" not in native.cpu_signature():
        pytest.skip("needs a C++ compiler and an AVX-512 machine")
    master, grads = make_block(10007, steps=2, grad_dtype=torch.bfloat16)
    results = []
    for flags in ([], narrower):
        library = fused_adamw._load(fused_adamw._build(compiler, [*fused_adamw._CXXFLAGS, *flags]))
        monkeypatch.setattr(fused_adamw, "_library", library)
        monkeypatch.setattr(fused_adamw, "_library_tried", True)
        out = torch.empty(10007, dtype=torch.bfloat16)
        results.append([*fused(master, grads, out=out, weight_decay=0.1, **HYPER), out,
                        *cast_through_update(rounding_cases())])
    for a, e in zip(*results):
        assert torch.equal(bits(a), bits(e))


def test_concurrent_callers_each_get_a_correct_update():
    # The kernel runs without the GIL; a second caller finds the helper threads busy and works
    # alone. Both must end where a lone call ends.
    fused_adamw.set_num_threads(2)
    try:
        blocks = [make_block(200003, steps=2, grad_dtype=torch.bfloat16, seed=s) for s in range(4)]
        expected = [fused(master, grads, weight_decay=0.1, **HYPER) for master, grads in blocks]
        actual = [None] * len(blocks)

        def work(k):
            actual[k] = fused(*blocks[k], weight_decay=0.1, **HYPER)

        workers = [threading.Thread(target=work, args=(k,)) for k in range(len(blocks))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        fused_adamw.set_num_threads(None)
    for got, want in zip(actual, expected):
        for a, e in zip(got, want):
            assert torch.equal(bits(a), bits(e))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_can_update():
    # The parent's helper threads do not exist in a forked child; the child must neither wait for
    # them nor hang on a lock one of them held. (The child avoids torch's own parallel ops, which
    # hang after fork in libgomp.)
    fused_adamw.set_num_threads(2)
    try:
        master, grads = make_block(200003, steps=1)
        expected = fused(master, grads, weight_decay=0.1, **HYPER)[0]  # helpers now exist
        buffers = [master.clone(), grads[0], torch.zeros(200003), torch.zeros(200003)]
        pid = os.fork()
        if pid == 0:  # child: update, then report through the exit status alone
            fused_adamw.adamw_update_(*buffers, step=1, weight_decay=0.1, **HYPER)
            os._exit(0 if buffers[0].numpy().tobytes() == expected.numpy().tobytes() else 1)
        deadline = time.monotonic() + 60
        while (finished := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if finished[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        assert os.waitstatus_to_exitcode(finished[1]) == 0
    finally:
        fused_adamw.set_num_threads(None)


def test_empty_block_is_a_no_op(backend):
    empty = torch.empty(0)
    fused_adamw.adamw_update_(empty, empty.clone(), empty.clone(), empty.clone(), step=1,
                              weight_decay=0.1, out=torch.empty(0, dtype=torch.bfloat16), **HYPER)
    assert fused_adamw.grad_sq_norm(torch.empty(0)) == 0.0


# ---- bad input -------------------------------------------------------------------------------

def _bad_cases():
    n = 33

    def base():
        return dict(master=torch.randn(n), grad=torch.randn(n).bfloat16(), exp_avg=torch.randn(n),
                    exp_avg_sq=torch.rand(n), out=torch.zeros(n, dtype=torch.bfloat16),
                    lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, step=3,
                    grad_scale=1.0)

    def with_(**change):
        return lambda: {**base(), **{k: (v() if callable(v) else v) for k, v in change.items()}}

    return {
        "master float64": with_(master=lambda: torch.randn(n, dtype=torch.float64)),
        "master bf16": with_(master=lambda: torch.randn(n).bfloat16()),
        "grad float16": with_(grad=lambda: torch.randn(n).half()),
        "grad int": with_(grad=lambda: torch.ones(n, dtype=torch.int32)),
        "exp_avg bf16": with_(exp_avg=lambda: torch.randn(n).bfloat16()),
        "exp_avg_sq float64": with_(exp_avg_sq=lambda: torch.rand(n, dtype=torch.float64)),
        "out float16": with_(out=lambda: torch.zeros(n, dtype=torch.float16)),
        "grad not contiguous": with_(grad=lambda: torch.randn(2 * n).bfloat16()[::2]),
        "master 2-D": with_(master=lambda: torch.randn(3, 11)),
        "exp_avg too short": with_(exp_avg=lambda: torch.randn(n - 1)),
        "out too long": with_(out=lambda: torch.zeros(n + 1, dtype=torch.bfloat16)),
        "grad on meta": with_(grad=lambda: torch.empty(n, device="meta")),
        "master is not a tensor": with_(master=lambda: [0.0] * n),
        "lr negative": with_(lr=-1e-3),
        "lr nan": with_(lr=math.nan),
        "beta1 is 1": with_(beta1=1.0),
        "beta2 negative": with_(beta2=-0.1),
        "eps negative": with_(eps=-1e-8),
        "weight_decay negative": with_(weight_decay=-0.1),
        "weight_decay a string": with_(weight_decay="0.1"),
        "step 0": with_(step=0),
        "step fractional": with_(step=1.5),
        "step True": with_(step=True),
        "grad_scale inf": with_(grad_scale=math.inf),
        "grad_scale negative": with_(grad_scale=-1.0),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_bad_input_raises_and_touches_nothing(backend, case):
    kwargs = _bad_cases()[case]()
    before = {k: v.clone() for k, v in kwargs.items()
              if isinstance(v, torch.Tensor) and v.device.type == "cpu"}
    buffers = [kwargs.pop(k) for k in ("master", "grad", "exp_avg", "exp_avg_sq")]
    with pytest.raises(OptimizerInputError):
        fused_adamw.adamw_update_(*buffers, **kwargs)
    kwargs.update(zip(("master", "grad", "exp_avg", "exp_avg_sq"), buffers))
    for name, snapshot in before.items():
        assert torch.equal(bits(kwargs[name]) if kwargs[name].is_floating_point() else kwargs[name],
                           bits(snapshot) if snapshot.is_floating_point() else snapshot), name


@pytest.mark.parametrize("alias", ["exp_avg", "exp_avg_sq", "out"])
def test_buffers_sharing_memory_are_refused(backend, alias):
    n = 64
    storage = torch.randn(2 * n)
    buffers = dict(master=storage[:n], grad=torch.randn(n), exp_avg=torch.zeros(n),
                   exp_avg_sq=torch.zeros(n), out=None)
    buffers[alias] = storage[n // 2: n // 2 + n]  # overlaps the master's second half
    before = storage.clone()
    with pytest.raises(OptimizerInputError, match="share memory"):
        fused_adamw.adamw_update_(buffers["master"], buffers["grad"], buffers["exp_avg"],
                                  buffers["exp_avg_sq"], out=buffers["out"], step=1,
                                  weight_decay=0.0, **HYPER)
    assert torch.equal(storage, before)


# ---- grad_sq_norm ----------------------------------------------------------------------------

@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grad_sq_norm_matches_torch(backend, numel, grad_dtype):
    grad = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(grad_dtype)
    expected = torch.sum(grad.double() ** 2).item()
    assert fused_adamw.grad_sq_norm(grad) == pytest.approx(expected, rel=1e-12)


def test_grad_sq_norm_refuses_bad_input(backend):
    for bad in (torch.randn(3, 4), torch.randn(8).half(), torch.randn(16)[::2]):
        with pytest.raises(OptimizerInputError):
            fused_adamw.grad_sq_norm(bad)


# ---- building the native kernel --------------------------------------------------------------

def test_build_is_cached_and_leaves_no_partial_files(tmp_path, monkeypatch):
    compiler = native.compiler()
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path))
    built = []
    workers = [threading.Thread(target=lambda: built.append(fused_adamw._build(compiler)))
               for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert len(built) == 2 and built[0] == built[1]
    assert [p.name for p in tmp_path.iterdir()] == [built[0].name]
    assert not any(tmp_path.glob("*.partial"))
    mtime = built[0].stat().st_mtime_ns
    assert fused_adamw._build(compiler) == built[0] and built[0].stat().st_mtime_ns == mtime
    library = fused_adamw._load(built[0])
    assert library.megacompile_grad_sq_norm(torch.ones(5).data_ptr(), 0, 5, 1) == 5.0


def test_the_compiled_file_appears_by_rename(tmp_path, monkeypatch):
    # A loader in another process may open the cache entry at any moment: the compiler must write
    # elsewhere in the same folder, and that very file (same inode) must then take the name.
    compiler = native.compiler()
    if compiler is None:
        pytest.skip("no C++ compiler on this machine")
    monkeypatch.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path))
    written = []
    real_run = native.subprocess.run

    def run(command, **kwargs):
        result = real_run(command, **kwargs)
        output = Path(command[command.index("-o") + 1])
        written.append((output, output.stat().st_ino))
        return result

    monkeypatch.setattr(native.subprocess, "run", run)
    target = fused_adamw._build(compiler)
    [(output, inode)] = written
    assert output != target and output.parent == target.parent
    assert target.stat().st_ino == inode


@pytest.mark.parametrize("why", ["no compiler", "compiler fails"])
def test_without_a_native_kernel_warns_once_and_falls_back(tmp_path, monkeypatch, why):
    monkeypatch.delenv("MEGACOMPILE_HOST_ADAM", raising=False)
    monkeypatch.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(fused_adamw, "_library", None)
    monkeypatch.setattr(fused_adamw, "_library_tried", False)
    if why == "no compiler":
        monkeypatch.delenv("CXX", raising=False)
        monkeypatch.setenv("PATH", str(tmp_path))
        reason = "no C\\+\\+ compiler"
    else:
        monkeypatch.setenv("CXX", "false")
        reason = "failed"
    with pytest.warns(RuntimeWarning, match=f"native host AdamW kernel is unavailable.*{reason}"):
        assert fused_adamw.backend() == "torch"
    assert list(tmp_path.glob("*.so*")) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        master, grads = make_block(17, steps=2)
        actual = fused(master, grads, weight_decay=0.1, **HYPER)
    expected = torch_reference(master, grads, weight_decay=0.1, **HYPER)
    assert_state_close(actual, expected, HYPER["lr"])
