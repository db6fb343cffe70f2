"""The post-training objectives' handed-out tensors (hand_out=True: LossAndOutputs beside the loss,
`engine.last_outputs`, `engine.accumulated_outputs`) out of the fused program: where the head's
log-probabilities run on the chunked kernels (fusion/logprobs.py), DPO's and KTO's rows'
log-probabilities come out of the kernels' picked logits and logsumexps, and the reward model's
rewards out of its fused norms. The loss and the gradients are the unfused run's, and every
micro-batch's handed-out values are the unfused run's and eager's on the weights the step started
from: same names in the same order, same dtype and shape, with grad_accum > 1 micro-batch-major
and layer-major. Torch's attention ops stay in place (under the interpreter the attention kernel
is a step's costliest call; the hand-out is the head's)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import megacompile
from megacompile import LossAndOutputs
from megacompile.fusion import kernel_counts
from megacompile.posttrain import DPOLoss, DPOObjective, KTOLoss, KTOObjective, RewardModel
from megacompile.posttrain.logprobs import token_logprobs
from tests import models
from tests.fusion.test_logprobs import SMALL, T, WIDTH, _batch, _dpo_inputs, _kto_inputs
from tests.fusion.training import host_grads, torch_attention, torch_order_adamw


class _Several(nn.Module):
    """A policy whose loss is minus its rows' mean log-probability, handing out several tensors of
    several dtypes and shapes beside it: each row's token count (int64), its tokens'
    log-probabilities (B, T) and its log-probability (B,)."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def forward(self, input_ids, labels):
        logps, mask = token_logprobs(self.policy(input_ids).logits, labels)
        rows = logps.sum(-1)
        return LossAndOutputs(-rows.mean(), {"count": mask.sum(-1), "tokens": logps, "rows": rows})


def _reward_model() -> nn.Module:
    model = RewardModel.of(models.hf_llama(layers=2, d=WIDTH, vocab=SMALL), seed=1)
    model.hand_out = True
    return model


def _reward_inputs(seed: int) -> dict:
    ids, _ = _batch(seed, SMALL)
    return dict(input_ids=ids, last=torch.tensor([T - 1, 9, T - 3, 5]), margin=torch.tensor([0.0, 0.5]))


# kind: (the objective of a policy, its step inputs of a seed, its handed-out names, whether its head
# is the log-probabilities' kernels)
OBJECTIVES = {
    "dpo": (lambda: DPOObjective(models.hf_llama(layers=2, d=WIDTH, vocab=SMALL), DPOLoss(beta=0.1), hand_out=True),
            lambda seed: _dpo_inputs(seed, SMALL), ("logps",), True),
    "kto": (lambda: KTOObjective(models.hf_llama(layers=2, d=WIDTH, vocab=SMALL), KTOLoss(beta=0.5), hand_out=True),
            _kto_inputs, ("logps",), True),
    "several": (lambda: _Several(models.hf_llama(layers=2, d=WIDTH, vocab=SMALL)),
                lambda seed: dict(zip(("input_ids", "labels"), _batch(seed, SMALL))), ("count", "tokens", "rows"),
                True),
    "rm": (_reward_model, _reward_inputs, ("rewards",), False),
}


def _engine(objective: nn.Module, fuse: bool, accum: int, accumulation: str, dtype=torch.float32):
    return megacompile.compile(copy.deepcopy(objective), hbm_budget=64.0, device="cpu", fuse=fuse,
                               compute_dtype=dtype, optimizer=torch_order_adamw(), grad_accum=accum,
                               accumulation=accumulation)


def _step(engine, batches: list[dict], accumulation: str):
    """One step of len(batches) micro-batches: its loss, each micro-batch's handed-out tensors, the
    gradients the host optimizer got."""
    seen = []
    for batch in batches:
        loss = engine.step(**batch)
        seen.append(engine.last_outputs)
    if accumulation == "layer" and len(batches) > 1:
        assert seen[:-1] == [None] * (len(batches) - 1)      # the walk runs at the step's last call
        assert seen[-1] is engine.accumulated_outputs[-1] and len(engine.accumulated_outputs) == len(batches)
        seen = engine.accumulated_outputs
    else:
        assert engine.accumulated_outputs == []
    return loss, seen, host_grads(engine)


def _eager(objective: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return copy.deepcopy(objective)(**batch).outputs


def _same_outputs(got: dict, want: dict, names: tuple, what: str) -> None:
    assert tuple(got) == names, (what, tuple(got))
    for name in names:
        a, b = got[name], want[name]
        assert not a.requires_grad and a.device.type == "cpu", (what, name)
        assert a.dtype == b.dtype and a.shape == b.shape, (what, name, a.dtype, tuple(a.shape), b.dtype, tuple(b.shape))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{what} {name}: {m}")


@pytest.mark.parametrize("kind,accum,accumulation", [
    ("dpo", 1, "micro"),
    pytest.param("dpo", 2, "layer", marks=pytest.mark.slow),
    pytest.param("dpo", 2, "micro", marks=pytest.mark.slow),
    pytest.param("kto", 1, "micro", marks=pytest.mark.slow),
    pytest.param("kto", 2, "layer", marks=pytest.mark.slow),
    pytest.param("several", 2, "layer", marks=pytest.mark.slow),
    pytest.param("rm", 1, "micro", marks=pytest.mark.slow),
    pytest.param("rm", 2, "layer", marks=pytest.mark.slow),
], ids=lambda v: str(v))
def test_the_fused_program_hands_out_the_unfused_values(kind, accum, accumulation):
    make, inputs, names, kernels = OBJECTIVES[kind]
    torch.manual_seed(0)
    objective = make()
    batches = [inputs(k) for k in range(accum)]
    plain, fused = (_engine(objective, f, accum, accumulation) for f in (False, True))
    with torch_attention():     # the plan (and its fusion) is made at the first step
        (want_loss, want, want_grads), (loss, got, grads) = (_step(e, batches, accumulation) for e in (plain, fused))
    epilogue = next(t for t in fused.plan.captured.templates if t.kind == "epilogue")
    forward, backward = (dict(kernel_counts(g.gm)) for g in (epilogue.forward, epilogue.backward))
    if kernels:
        assert forward.get("linear_logprobs") == 1 and backward.get("linear_logprobs_backward") == 1
    else:
        assert "linear_logprobs" not in forward and forward.get("rms_norm") == 1
    assert fused.plan.captured.extra_outputs == plain.plan.captured.extra_outputs == names
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    assert len(got) == len(want) == accum
    for k, batch in enumerate(batches):      # every micro-batch saw the weights the step started from
        _same_outputs(got[k], want[k], names, f"micro-batch {k}, unfused")
        _same_outputs(got[k], _eager(objective, batch), names, f"micro-batch {k}, eager")
    plain.close()
    fused.close()


@pytest.mark.slow
def test_bf16_hands_out_fp32_rows_as_close_as_eager_bf16():
    """In bf16 the kernels read bf16 logits as eager's fp32 copy does: the handed-out rows are fp32,
    the shape of eager's, and off the fp32 rows by at most twice eager bf16's error plus 1e-4 of their size."""
    make, inputs, names, _ = OBJECTIVES["dpo"]
    torch.manual_seed(0)
    objective = make()
    batch = inputs(0)
    exact = _eager(objective, batch)["logps"]
    runs = []
    for fuse in (False, True):
        engine = _engine(objective, fuse, 1, "micro", torch.bfloat16)
        with torch_attention():
            engine.step(**batch)
        runs.append(engine.last_outputs)
        engine.close()
    assert all(tuple(r) == names and r["logps"].dtype == torch.float32 and r["logps"].shape == exact.shape
               for r in runs)
    err = [(r["logps"] - exact).abs().max().item() for r in runs]
    assert err[1] <= 2 * err[0] + 1e-4 * exact.abs().max().item(), err
