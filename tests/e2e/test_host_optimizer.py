"""The host optimizer inside a step: global-norm clipping, gradient accumulation, LR schedules.

Each is held against the eager recipe a user would otherwise write with torch.optim.AdamW.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.ir.program import Op
from tests import models
from tests.e2e.harness import assert_same_weights, clone, float64_noise

LR = 1e-3


def _model():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=64, layers=3)


def _batches(n, t=16):
    return [models.batch(96, 2, t, seed=i) for i in range(n)]


def test_clipping_is_exact_and_updates_follow_the_whole_backward():
    model, batches, max_norm = _model(), _batches(5), 0.05

    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        norms, losses = [], []
        for ids in batches:
            opt.zero_grad()
            _, loss = m(ids, ids)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm).item())
            opt.step()
            losses.append(loss.item())
        return norms, losses

    reference = clone(model)
    norms, eager = train(reference)
    assert min(norms) > max_norm, "the test must actually clip"
    noise = float64_noise(train, model, reference)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=LR, max_grad_norm=max_norm, kernel="torch"))
    ours = [engine.step(idx=ids, targets=ids) for ids in batches]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=noise)
    nodes = engine.plan.program.nodes
    clip = next(i for i, n in enumerate(nodes) if n.op is Op.CLIP_GRADS)
    assert all(i < clip for i, n in enumerate(nodes) if n.op in (Op.BACKWARD, Op.OFFLOAD))
    steps = [n.stage for n in nodes[clip:] if n.op is Op.OPTIMIZER_STEP]
    assert steps == sorted(steps), "clipped updates run in forward order, ready for the next forward"


def test_an_infinite_max_norm_measures_the_norm_and_never_clips():
    """clip_grad_norm_(max_norm=inf) returns the norm and leaves the gradients as they are: the
    engine logs the same norm and trains bit for bit as it does without clipping."""
    model, batches = _model(), _batches(3)

    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        norms = []
        for ids in batches:
            opt.zero_grad()
            _, loss = m(ids, ids)
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")).item())
            opt.step()
        return norms

    reference = clone(model)
    norms = train(reference)
    measured, plain = (megacompile.compile(clone(model), hbm_budget=1.0, device="cpu",
                                           optimizer=megacompile.AdamW(lr=LR, max_grad_norm=m, kernel="torch"))
                       for m in (float("inf"), None))
    ours = []
    for ids in batches:
        measured.step(idx=ids, targets=ids)
        plain.step(idx=ids, targets=ids)
        ours.append(measured.last_step.grad_norm)
        assert plain.last_step.grad_norm is None
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(norms), rtol=1e-5, atol=0)
    assert_same_weights(measured, reference, noise=float64_noise(train, model, reference))
    a, b = measured.state_dict(), plain.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_gradient_accumulation_matches_eager_accumulation():
    model, batches, k = _model(), _batches(8), 4

    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        losses = []
        for i, ids in enumerate(batches):
            _, loss = m(ids, ids)
            (loss / k).backward()
            losses.append(loss.item())
            if i % k == k - 1:
                opt.step()
                opt.zero_grad()
        return losses

    reference = clone(model)
    eager = train(reference)
    noise = float64_noise(train, model, reference)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=k,
                                 optimizer=megacompile.AdamW(lr=LR, kernel="torch"))
    ours = [engine.step(idx=ids, targets=ids) for ids in batches]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert engine.steps_done == 2 and engine.micro_batches == 8
    assert_same_weights(engine, reference, noise=noise)


def test_learning_rate_schedules_callable_and_torch_scheduler():
    model, batches = _model(), _batches(6)

    def train(m):
        opt = torch.optim.AdamW(m.parameters(), lr=LR)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3)
        for ids in batches:
            opt.zero_grad()
            _, loss = m(ids, ids)
            loss.backward()
            opt.step()
            sched.step()

    reference = clone(model)
    train(reference)
    noise = float64_noise(train, model, reference)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=LR, kernel="torch"))
    ours_sched = torch.optim.lr_scheduler.StepLR(engine.torch_optimizer, step_size=2, gamma=0.3)
    for ids in batches:
        engine.step(idx=ids, targets=ids)
        ours_sched.step()
    assert_same_weights(engine, reference, noise=noise)
    by_callable = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu",
                                      optimizer=megacompile.AdamW(lr=lambda step: LR * 0.3 ** ((step - 1) // 2), kernel="torch"))
    for ids in batches:
        by_callable.step(idx=ids, targets=ids)
    assert_same_weights(by_callable, reference, noise=noise)


def test_a_schedule_that_returns_a_bad_rate_is_reported():
    engine = megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=lambda step: float("nan")))
    with pytest.raises(megacompile.OptimizerInputError, match="step 1"):
        engine.step(idx=_batches(1)[0], targets=_batches(1)[0])


def test_the_host_optimizer_runs_on_every_core_it_is_given():
    """The copy streams run one intra-op thread each, but the host stream's AdamW takes this
    process's share of the cores, and nothing changes torch's default for later threads."""
    import threading

    from megacompile.optim import fused_adamw
    from megacompile.optim.host_threads import host_threads
    threads = host_threads()
    if threads < 2:
        pytest.skip("needs a host share of 2 cores or more")
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=256, layers=1)    # a block of 786k params: 12 chunks of 64K
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(lr=LR))
    if fused_adamw.backend() != "cpp":
        pytest.skip("the native host AdamW kernel is unavailable here")
    ids = _batches(1)[0]
    engine.step(idx=ids, targets=ids)
    engine.synchronize()
    assert fused_adamw.last_threads() == engine.last_step.host_threads == threads
    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [torch.get_num_threads()], "a stream thread changed torch's process-wide thread count"
    engine.close()


def test_with_clipping_each_gradients_norm_is_taken_as_it_lands(monkeypatch):
    """The global norm is summed from the squared norms taken as each gradient lands, on the copy
    thread, during the backward; the clip at commit reads no gradient (exactness:
    test_clipping_is_exact...)."""
    import threading

    from megacompile.runtime import host_grads as host_module
    calls = []
    real = host_module.grad_sq_norm

    def counted(flat):
        calls.append(threading.current_thread() is threading.main_thread())
        return real(flat)
    monkeypatch.setattr(host_module, "grad_sq_norm", counted)
    torch.manual_seed(0)
    engine = megacompile.compile(_model(), hbm_budget=1.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=LR, max_grad_norm=0.05))
    ids = _batches(1)[0]
    engine.step(idx=ids, targets=ids)
    engine.synchronize()
    assert len(calls) == len(engine.host.slots)     # once per parameter, none again at the clip
    assert not any(calls)                           # all on the thread the gradients land on
    assert engine.last_step.grad_norm == pytest.approx(engine.host.grad_sq_norm() ** 0.5)
    engine.close()


def test_bf16_gradients_reach_adamw_unwidened_and_train_the_same():
    """With bf16 compute and one micro-batch a step, owners whose gradients are not summed keep them
    in bf16 (no fp32 copy); the values are the device's bf16 gradients either way, so training is
    bit-identical to widening them first."""
    from megacompile.engine import host_setup
    model, batches = models.hf_llama(layers=2, d=32), _batches(3)

    def run(widen: bool):
        torch.manual_seed(0)
        eng = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu", compute_dtype=torch.bfloat16,
                                  optimizer=megacompile.AdamW(lr=LR))
        real = host_setup.HostState
        if widen:   # a HostState told of accumulation keeps fp32 grads
            host_setup.HostState = lambda *a, **k: real(*a, **{**k, "grad_accum": 2})
        try:
            losses = [eng.step(input_ids=ids, labels=ids) for ids in batches]
        finally:
            host_setup.HostState = real
        dtypes = {b.grad.dtype for b in eng.host.owners.values()}
        state = eng.state_dict()
        eng.close()
        return losses, state, dtypes

    losses, state, dtypes = run(widen=False)
    widened_losses, widened_state, widened_dtypes = run(widen=True)
    assert dtypes == {torch.bfloat16} and widened_dtypes == {torch.float32}
    assert losses == widened_losses
    assert all(torch.equal(state[k], widened_state[k]) for k in state)
