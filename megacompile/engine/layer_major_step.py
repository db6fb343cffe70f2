"""The engine's side of a layer-major step: the step's micro-batches wait on the host until the
last one arrives, then one program runs them all (passes/layer_major.py).

step() still takes one micro-batch per call. The first k-1 calls of a step keep a host copy of
their inputs and return None (no loss exists yet); the k-th runs every micro-batch's forward
block by block, the backwards likewise, lands one gradient sum per parameter on the host (as with
grad_accum=1: no fp32 accumulator), and updates the masters. It returns the last micro-batch's
loss; `engine.accumulated_losses` holds all k. The k-th call runs the one step protocol
(engine/step.py): an exception leaves the waiting micro-batches waiting (the failed one is not
kept, so it can be retried), a non-finite loss or gradient drops the whole step, them included.
The waiting micro-batches live in the training state only, so saving a checkpoint while some
wait is refused (save between optimizer steps). All micro-batches of a step must have the same
shapes: one program runs them together.
"""
from __future__ import annotations

import time

from ..errors import InputMismatchError, NonFiniteError
from .step import StepRecord, run_step, tokens


def layer_major_step(engine, args: tuple, kwargs: dict, started: float, weight: float | None = None):
    """Run (or hold) one micro-batch of a layer-major step; NotImplemented when the plan for these
    inputs is micro-batch-major (accumulation='auto' chose it), so the caller runs it that way.
    started: the call's perf_counter() at entry, for the record's seconds; weight: the
    micro-batch's loss gradient (Engine.weighted_step), None for 1/k."""
    compiled = engine._compile(args, kwargs, train=True, update=True)
    k = compiled.plan.program.facts.get("micro_batches", 1)
    if k == 1:
        return NotImplemented
    compiled.captured.check_inputs(engine._inputs(args, kwargs))
    engine._require_weights()
    state = engine.state
    waiting = state.waiting_micro_batches
    inputs = [t.detach().to("cpu", copy=True) for t in engine._inputs(args, kwargs)]
    if waiting and [t.shape for t in waiting[0]] != [t.shape for t in inputs]:
        raise InputMismatchError(
            f"micro-batch {len(waiting)} of a layer-major step has shapes {[tuple(t.shape) for t in inputs]}, its "
            f"first {[tuple(t.shape) for t in waiting[0]]}: one program runs a step's micro-batches together, so "
            "give them the same shapes (pad), or compile with accumulation='micro'")
    if len(waiting) < k - 1:
        waiting.append(inputs)
        state.waiting_weights.append(weight)
        # No loss and no peak yet: the micro-batch only waits. Its tokens count for the step.
        engine.last_step = StepRecord(state.steps_done + 1, None, len(waiting) - 1, False,
                                      lr=state.step_context()["lr"], tokens=tokens(args, kwargs),
                                      seconds=time.perf_counter() - started)
        return None
    try:
        loss = run_step(engine, compiled, waiting + [inputs], micro=k - 1, last=True, tokens=tokens(args, kwargs),
                        started=started, micro_batches=k, weights=state.waiting_weights + [weight])
    except NonFiniteError:
        waiting.clear()      # the step was dropped, its waiting micro-batches with it
        state.waiting_weights.clear()
        raise
    waiting.clear()
    state.waiting_weights.clear()
    return loss
