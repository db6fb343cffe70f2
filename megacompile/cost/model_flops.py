"""Model FLOPs of a step: the work the model itself asks for, whatever the schedule adds.

A trained weight's matmul runs three times a token (forward, the input's gradient, its own
gradient): 6ND. A frozen weight (LoRA's base, a frozen layer, a held tower) runs its forward, and
its input's gradient where something before it trains, but never its own gradient: 4 a token
behind a trained parameter, 2 before the first (a LoRA plan counted by its adapters alone would
read as a card at a fraction of a per cent of its peak). Tables only looked up (token and position embeddings,
capture/lookups.py) and buffers count nothing; a routed expert counts its top_k / experts share.
"""
from __future__ import annotations

from ..capture import CapturedModel
from ..capture.lookups import lookup_params


def frozen_flop_weights(captured: CapturedModel) -> tuple[float, float]:
    """(frozen parameters behind the first trained one, frozen parameters before it), each counted
    at its active share: the N of 4ND and of 2ND."""
    lookups = lookup_params(captured.stages)
    first_trained = min((s for s, st in enumerate(captured.stages)
                         for slot in st.template.params if slot.trainable), default=len(captured.stages))
    last_reader: dict[str, int] = {}
    for s, stage in enumerate(captured.stages):
        for name in stage.params:
            last_reader[name] = s
    behind = before = 0.0
    for name, e in captured.state.items():
        if e.trainable or e.is_buffer or name in lookups or name not in last_reader:
            continue
        n = e.numel * captured.routed_fractions.get(name, 1.0)
        if last_reader[name] >= first_trained:
            behind += n
        else:
            before += n
    return behind, before


def forward_params(captured: CapturedModel) -> float:
    """The N of a forward's 2ND: every parameter whose matmul a token runs, trained or frozen."""
    return captured.flop_params + sum(frozen_flop_weights(captured))


def model_flops(captured: CapturedModel, tokens: int) -> float:
    """FLOPs the model asks for over `tokens`: 6ND for the trained parameters, 4ND and 2ND for the
    frozen ones behind and before them (training); 2ND for every parameter (forward only)."""
    if not captured.train:
        return 2.0 * forward_params(captured) * tokens
    behind, before = frozen_flop_weights(captured)
    return (6.0 * captured.flop_params + 4.0 * behind + 2.0 * before) * tokens
