"""One step, all or nothing: the protocol every step() runs, micro-batch-major or layer-major.

Until the commit, nothing but the running micro-batch's own landing gradients is written, so an
exception anywhere (an op, the budget guard, KeyboardInterrupt) leaves masters, moments, counters
and the device ledger as they were, and puts the random state back (a retry draws the same dropout
masks); a non-finite loss or gradient skips the whole step, the micro-batches already accumulated
in it included (their sum may hold the inf or NaN). With data parallelism every rank hears of a
failure or a skip on any of them, so they all commit or all skip.

Under compile(..., updates="as_gradients_land") the updates start during the walk (runtime/
early_updates.py): a step is still skipped whole when none of them ran, but one that failed after
the first ran is only partly applied, and the engine then refuses to go on (PartialStepError)
until a checkpoint is loaded.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from ..errors import NonFiniteError, PartialStepError
from ..runtime.executor import NonFiniteLoss
from ..runtime.host_heap import resident_set_bytes
from .gradless import enter_program


@dataclass(frozen=True)
class StepRecord:
    """What the last step() did: `engine.last_step`.

    step: the 1-based optimizer step the micro-batch belonged to; loss: its loss; micro_batch:
    its index in the step (0 .. grad_accum-1); updated: the masters were updated (the step's last
    micro-batch committed); skipped: None, "loss" or "gradient" (inf or NaN found; nothing was
    updated); reason: why, in words; grad_norm: the global norm when clipping (the whole step's,
    on its last micro-batch); lr: the step's learning rate; tokens: elements of the micro-batch's
    input_ids (or first input); seconds: the call's wall time; device_peak_bytes and
    predicted_device_peak_bytes: the plan's measured and predicted device peaks; host_threads:
    the threads the host AdamW runs the step's update on (this rank's share of the cores it may
    use, optim/host_threads.py; an owner under 64K elements a thread takes fewer);
    host_resident_bytes: the process's resident set as the call returns (its host memory, the
    interpreter, torch and the caller's data included); partial: the step failed after some of its
    host updates had run (updates='as_gradients_land'): the masters hold part of it, `reason`
    says how far it got, and the engine refuses to go on until a checkpoint is loaded.
    """
    step: int
    loss: float
    micro_batch: int
    updated: bool
    skipped: str | None = None
    reason: str | None = None
    grad_norm: float | None = None
    lr: float | None = None
    tokens: int | None = None
    seconds: float | None = None
    device_peak_bytes: int | None = None
    predicted_device_peak_bytes: int | None = None
    host_threads: int | None = None
    host_resident_bytes: int | None = None
    partial: bool = False

    def __post_init__(self) -> None:
        if self.skipped or self.partial:
            object.__setattr__(self, "updated", False)


def run_step(engine, compiled, inputs: list, *, micro: int, last: bool, tokens: int | None,
             started: float, micro_batches: int = 1, weights: list[float | None] | None = None) -> float:
    """Run `compiled` over `inputs` and commit, or leave nothing; returns the (last) loss.

    micro: the index in the optimizer step of the micro-batch this call commits (the last one, for
    a layer-major program); micro_batches: how many micro-batches the program runs together (1:
    `inputs` is one micro-batch's tensors; k: a list of k of them, the whole step at once).
    weights: each micro-batch's loss gradient (Engine.weighted_step), None for 1/grad_accum.
    started: the call's perf_counter() at entry, for the record's seconds."""
    state, backend = engine.state, engine.backend
    host, dp = state.host, state.data_parallel
    # Micro-batch-major: the step's earlier calls committed their micro-batches one by one; a
    # layer-major program holds them all, none committed yet.
    earlier_committed = micro if micro_batches == 1 else 0
    # The last step's updates may still be running: the plan waits for each owner's update
    # before its first prefetch, so they finish before this step's offloads touch the grads.
    host.begin_micro_batch(first=micro_batches > 1 or micro == 0, last=last,
                           norms=state.optimizer.max_grad_norm is not None)
    if dp is not None:      # how long its collectives wait for the other ranks (distributed/timeouts.py)
        dp.before_step(compiled.plan)
    context = state.step_context()
    rng = backend.get_rng_state()
    if compiled.executor.early is not None:    # a failure before the walk began must not read the last step's
        compiled.executor.early.clear()
    try:
        # Before anything runs; with data parallelism the other ranks hear of it as of any failure.
        enter_program(compiled.captured, host, data_parallel=dp is not None)
        outputs = compiled.executor.run(inputs, seed=_seeds(weights, micro_batches, state.grad_accum),
                                        context=context, check_loss=True)
    except NonFiniteLoss as e:
        _hand_out(engine, compiled.captured, e.outputs)     # the walk's own values: read, though dropped
        if dp is not None:   # the other ranks wait for this one's word
            dp.agree(host, e.loss, last)
        _refuse_if_partial(engine, compiled, context, f"the loss is {e.loss}", e.loss, micro)
        return _skip(engine, compiled, e.loss, "loss", f"the loss is {e.loss}", micro, earlier_committed)
    except BaseException as e:
        if dp is not None:
            dp.failed(e)
        backend.set_rng_state(rng)
        host.restore_copies()
        early = compiled.executor.early
        if early is not None and early.started:    # the failed walk waited for the updates it started
            _partial(engine, context, _partly(context, early, f"{type(e).__name__}: {e}"), float("nan"), micro)
            e.add_note(f"megacompile: {state.partial_step}; load_checkpoint(path) to go on")
        raise
    finally:
        compiled.measured.peak_bytes = backend.memory.peak_bytes
        engine._last = engine._last_train = compiled
    losses = [float(x) for x in outputs[::len(compiled.captured.outputs)]]     # one per micro-batch
    _hand_out(engine, compiled.captured, outputs)
    loss = losses[-1]
    refused = dp.agree(host, loss, last) if dp is not None else None
    if refused is not None:
        return _skip(engine, compiled, loss, *refused, micro, earlier_committed)
    bad = host.nonfinite_grads() if last else []
    if bad:
        _refuse_if_partial(engine, compiled, context,
                           f"{len(bad)} gradients hold inf or NaN ({', '.join(bad[:3])})", loss, micro)
        return _skip(engine, compiled, loss, "gradient",
                     f"{len(bad)} gradients hold inf or NaN ({', '.join(bad[:3])})", micro, earlier_committed)
    host.commit_micro_batch()
    compiled.executor.commit()
    state.micro_batches_committed(micro_batches, step_ends=last)   # and tells attached LR schedulers
    if micro_batches > 1:
        engine.accumulated_losses = losses
    # A layer-major program ran the whole step: its seconds and peaks are the step's, its tokens
    # this call's own micro-batch's (the waiting calls' records counted theirs).
    engine.last_step = StepRecord(context["step"], loss, micro, last, grad_norm=context.get("grad_norm"),
                                  lr=context["lr"], tokens=tokens, seconds=time.perf_counter() - started,
                                  device_peak_bytes=compiled.measured.peak_bytes,
                                  predicted_device_peak_bytes=compiled.plan.predicted_peak_bytes,
                                  host_threads=backend.host.threads, host_resident_bytes=resident_set_bytes())
    if last:
        engine.skip_streak.updated()
    if dp is not None:
        dp.step_done(compiled.plan, engine.last_step.seconds)
    return loss


def _hand_out(engine, captured, outputs: list) -> None:
    """The tensors each micro-batch's forward handed out beside its loss (capture/loss.py
    LossAndOutputs), by name, from the walk's OUTPUT values (each micro-batch's loss, then they):
    `engine.last_outputs` the call's last micro-batch's, `engine.accumulated_outputs` every
    micro-batch's of a layer-major program. Set once the walk has ended, so a step that raised
    leaves None (step() clears them first), never the values of an earlier step."""
    n = len(captured.outputs)
    each = [dict(zip(captured.extra_outputs, outputs[i + 1:i + n])) for i in range(0, len(outputs), n)]
    if each:
        engine.last_outputs = each[-1]
        engine.accumulated_outputs = each if len(each) > 1 else []


def _seeds(weights: list[float | None] | None, micro_batches: int, grad_accum: int) -> float | list[float]:
    """The loss gradients the program starts its backward from: one for a micro-batch's program,
    one a micro-batch for a layer-major step's; 1/k where no weight was given."""
    even = 1.0 / (micro_batches if micro_batches > 1 else grad_accum)
    if weights is None or all(w is None for w in weights):
        return even
    seeds = [even if w is None else w for w in weights]
    return seeds if micro_batches > 1 else seeds[0]


def _refuse_if_partial(engine, compiled, context: dict, why: str, loss: float, micro: int) -> None:
    """A step found unsound once its walk ended: skipped whole as always when none of its early
    updates ran (they are waited for first), else the state keeps part of it and the engine stops."""
    early = compiled.executor.early
    if early is None:
        return
    engine.state.wait_updates()
    if early.started:
        _partial(engine, context, _partly(context, early, why), loss, micro)
        raise PartialStepError(f"{engine.state.partial_step}; load_checkpoint(path) to go on")


def _partial(engine, context: dict, why: str, loss: float, micro: int) -> None:
    """The state holds part of the step: the engine stops, and its record says so."""
    engine.state.step_partly_applied(why)
    engine.last_step = StepRecord(context["step"], loss, micro, False, reason=why, lr=context.get("lr"),
                                  host_resident_bytes=resident_set_bytes(), partial=True)


def _partly(context: dict, early, why: str) -> str:
    return (f"step {context['step']} failed ({why}) after {early.started} of its {early.owners} owners' host "
            "updates had run (compile(..., updates='as_gradients_land') starts them as gradients land)")


def _skip(engine, compiled, loss: float, what: str, why: str, micro: int,
          earlier_committed: int) -> float:
    """Drop the step: no master, moment or counter changes, and the micro-batches already
    accumulated in it go too (their sum may hold the inf or NaN)."""
    state = engine.state
    compiled.executor.commit_nothing()
    state.host.restore_copies()
    state.step_skipped(earlier_committed)
    step = state.steps_done + 1
    engine.last_step = StepRecord(step, loss, micro, True, skipped=what, reason=why,
                                  host_resident_bytes=resident_set_bytes())
    unchanged = ("masters, AdamW moments and counters are unchanged"
                 + (f", and its {micro} earlier micro-batches dropped" if micro else ""))
    if engine.on_nonfinite == "raise":
        raise NonFiniteError(f"step {step} failed: {why}; nothing of it was applied: {unchanged} "
                             "(compile(..., on_nonfinite='skip') skips such steps with a warning)")
    engine.skip_streak.skipped(engine.last_step)
    warnings.warn(f"step {step} skipped: {why}; {unchanged}", RuntimeWarning, stacklevel=4)
    return loss


def tokens(args: tuple, kwargs: dict) -> int | None:
    ids = kwargs.get("input_ids", args[0] if args else None)
    return ids.numel() if isinstance(ids, torch.Tensor) else None
