"""A preference stage's micro-batches through engine.step, with what each one's forward handed out
beside its loss (the objectives' `hand_out`: the rows' log-probabilities or rewards, for the logged
metrics). The training forward gives them: every micro-batch of a step sees the masters the step
starts from (they move after its last one), so they are the values a forward-only pass of the
same rows before the step would give, without a third pass of the weights over the link."""
from __future__ import annotations

import torch


def step_micro_batches(engine, micro: list[dict]) -> tuple[list, int, list[dict[str, torch.Tensor]]]:
    """engine.step over each micro-batch's inputs, up to the first skipped one. Returns the losses
    (None for a micro-batch that waits for a layer-major step's last), the tokens read, and each
    micro-batch's handed-out tensors, for those whose forward ran (a skipped step's included,
    whose values the skipped forward computed; those after a skip never ran)."""
    losses, tokens, outputs = [], 0, []
    for inputs in micro:
        losses.append(engine.step(**inputs))
        counted = engine.last_step.tokens      # a skipped step's record counts none; its rows were read
        tokens += inputs["input_ids"].numel() if counted is None else counted
        outputs.append(engine.last_outputs)
        if engine.last_step.skipped:
            break
    if engine.accumulated_outputs:      # a layer-major step: its last call ran every micro-batch
        outputs = list(engine.accumulated_outputs)
    return losses, tokens, outputs
