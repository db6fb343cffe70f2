"""The engine's side of a layer-major step: the step's micro-batches wait on the host until the
last one arrives, then one program runs them all (passes/layer_major.py).

step() still takes one micro-batch per call. The first k-1 calls of a step keep a host copy of
their inputs and return None (no loss exists yet); the k-th runs every micro-batch's forward
block by block, the backwards likewise, lands one gradient sum per parameter on the host (as with
grad_accum=1: no fp32 accumulator), and updates the masters. It returns the last micro-batch's
loss; `engine.accumulated_losses` holds all k. A step is all or nothing as before: an exception
leaves the waiting micro-batches waiting (the failed one is not kept, so it can be retried), a
non-finite loss or gradient drops the whole step. The waiting micro-batches live in the engine
only, so saving a checkpoint while some wait is refused (save between optimizer steps). All
micro-batches of a step must have the same shapes: one program runs them together.
"""
from __future__ import annotations

import time

from ..errors import ArgumentError, InputMismatchError

MODES = ("micro", "layer", "auto")


def check_mode(accumulation: str) -> str:
    if accumulation not in MODES:
        raise ArgumentError(f"accumulation says how the micro-batches of a step run: 'micro' (each step() call "
                            "through the whole model, the default), 'layer' (all of a step's micro-batches through "
                            "each block while its weights are on the device) or 'auto' (the planner's choice by "
                            f"predicted time); got {accumulation!r}")
    return accumulation


def layer_major_step(engine, args: tuple, kwargs: dict, started: float):
    """Run (or hold) one micro-batch of a layer-major step; NotImplemented when the plan for these
    inputs is micro-batch-major (accumulation='auto' chose it), so the caller runs it that way.
    started: the call's perf_counter() at entry, for the record's seconds."""
    from ..runtime.executor import NonFiniteLoss
    from ..engine import StepRecord, _tokens

    compiled = engine._compile(args, kwargs, train=True, update=True)
    k = compiled.plan.program.facts.get("micro_batches", 1)
    if k == 1:
        return NotImplemented
    engine._require_weights()
    waiting = engine.waiting_micro_batches
    inputs = [t.detach().to("cpu", copy=True) for t in engine._inputs(args, kwargs)]
    if waiting and [t.shape for t in waiting[0]] != [t.shape for t in inputs]:
        raise InputMismatchError(
            f"micro-batch {len(waiting)} of a layer-major step has shapes {[tuple(t.shape) for t in inputs]}, its "
            f"first {[tuple(t.shape) for t in waiting[0]]}: one program runs a step's micro-batches together, so "
            "give them the same shapes (pad), or compile with accumulation='micro'")
    lr = engine._step_context()["lr"]
    if len(waiting) < k - 1:
        waiting.append(inputs)
        # No loss and no peak yet: the micro-batch only waits. Its tokens count for the step.
        engine.last_step = StepRecord(engine.steps_done + 1, None, len(waiting) - 1, False, lr=lr,
                                      tokens=_tokens(args, kwargs), seconds=time.perf_counter() - started)
        return None
    batches = waiting + [inputs]
    engine.host.begin_micro_batch(first=True, last=True, norms=engine.optimizer.max_grad_norm is not None)
    context = engine._step_context()
    rng = engine.backend.get_rng_state()
    try:
        outs = compiled.executor.run(batches, seed=1.0 / k, context=context, check_loss=True)
    except NonFiniteLoss as e:
        waiting.clear()
        engine.micro_batches += k - 1     # _skip takes the step's earlier micro-batches back off
        return engine._skip(compiled, e.loss, "loss", f"the loss is {e.loss}", k - 1)
    except BaseException:
        engine.backend.set_rng_state(rng)
        engine.host.restore_copies()
        raise
    finally:
        compiled.plan.measured_peak_bytes = engine.backend.memory.peak_bytes
        engine._last = engine._last_train = compiled
    losses = [float(x) for x in outs[::len(compiled.captured.outputs)]]
    waiting.clear()
    bad = engine.host.nonfinite_grads()
    if bad:
        engine.micro_batches += k - 1
        return engine._skip(compiled, losses[-1], "gradient",
                            f"{len(bad)} gradients hold inf or NaN ({', '.join(bad[:3])})", k - 1)
    engine.host.commit_micro_batch()
    compiled.executor.commit()
    engine.micro_batches += k
    engine.steps_done += 1
    engine.torch_optimizer.step()
    engine.accumulated_losses = losses
    # The k-th call ran the whole step: its seconds and peaks are the step's, its tokens its own
    # micro-batch's (the waiting calls' records counted theirs), as with micro-batch-major steps.
    engine.last_step = StepRecord(context["step"], losses[-1], k - 1, True, grad_norm=context.get("grad_norm"),
                                  lr=context["lr"], tokens=_tokens(args, kwargs),
                                  seconds=time.perf_counter() - started,
                                  device_peak_bytes=compiled.plan.measured_peak_bytes,
                                  predicted_device_peak_bytes=compiled.plan.predicted_peak_bytes)
    return losses[-1]
