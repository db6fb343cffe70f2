"""Tensors a model hands out beside its loss (megacompile.LossAndOutputs): the step carries them
out of the same forward whose gradient it takes, detached, and `engine.last_outputs` holds them.
Their values are eager's, the gradients those of the same model returning its loss alone, with
grad_accum > 1 (micro-batch-major and layer-major), at the smallest budget (every block's weights
streamed), and a skipped step hands out its own forward's values, never an earlier step's."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import megacompile
from megacompile import LossAndOutputs
from megacompile.optim import AdamW
from tests import models
from tests.fusion.training import host_grads

VOCAB, ROWS, T = 64, 3, 12


class RowLogprobs(nn.Module):
    """A GPT whose loss is minus the mean of its rows' log-probabilities; with `hand_out`, each row's
    log-probability and the first logit of each row come out beside it."""

    def __init__(self, gpt: nn.Module, hand_out: bool = True):
        super().__init__()
        self.gpt, self.hand_out = gpt, hand_out

    def forward(self, idx, targets, scale):
        logits, _ = self.gpt(idx)
        picked = logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        rows = picked.sum(-1)
        loss = -(rows * scale).mean()
        if not self.hand_out:
            return loss
        return LossAndOutputs(loss, {"rows": rows, "first_logit": logits[:, 0, 0]})


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return models.NanoGPT(vocab=VOCAB, d=32, layers=3, heads=4, block=T)


def _batches(n: int, scale: float = 1.0) -> list[dict]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (ROWS, T + 1), generator=g)
        out.append({"idx": ids[:, :-1], "targets": ids[:, 1:], "scale": torch.tensor(scale)})
    return out


def _engine(model: nn.Module, budget: float = 1.0, **kw) -> megacompile.Engine:
    return megacompile.compile(model, hbm_budget=budget, device="cpu", compute_dtype=torch.float32,
                               optimizer=AdamW(lr=1e-3, kernel="torch"), **kw)


def _eager_outputs(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return copy.deepcopy(model)(**batch).outputs


def test_the_outputs_are_the_steps_own_forward_values_and_the_gradients_the_loss_alones():
    gpt, (batch,) = _gpt(), _batches(1)
    model = RowLogprobs(copy.deepcopy(gpt))
    want = _eager_outputs(model, batch)
    engine, plain = _engine(model), _engine(RowLogprobs(copy.deepcopy(gpt), hand_out=False))
    assert engine.last_outputs is None                      # no step yet
    loss = engine.step(**batch)
    assert isinstance(loss, float) and loss == plain.step(**batch)
    got = engine.last_outputs
    assert set(got) == {"rows", "first_logit"} and plain.last_outputs == {}
    for name in want:
        assert not got[name].requires_grad and got[name].device.type == "cpu"
        assert torch.allclose(got[name], want[name], rtol=1e-6, atol=1e-6), name
    assert loss == pytest.approx(-want["rows"].mean().item(), rel=1e-6)      # what the loss read
    assert engine.plan.captured.extra_outputs == ("rows", "first_logit")
    ours, theirs = host_grads(engine), host_grads(plain)
    assert all(torch.allclose(ours[n], theirs[n], rtol=1e-6, atol=1e-7) for n in theirs)
    assert isinstance(engine(**batch), LossAndOutputs)     # a forward-only call returns what the model returns
    engine.close()
    plain.close()


@pytest.mark.slow
@pytest.mark.parametrize("accumulation", ["micro", "layer"])
def test_each_micro_batch_hands_out_its_own_values_with_the_weights_streamed(accumulation):
    """At the smallest budget each block's weights come from the host for its forward; every
    micro-batch of a step sees the masters the step started from, so its values are eager's on
    them, and the trained weights are those of the loss-only model."""
    gpt, k = _gpt(), 2
    batches = _batches(2 * k)
    model = RowLogprobs(copy.deepcopy(gpt))
    smallest = megacompile.minimum_budget(copy.deepcopy(model), compute_dtype=torch.float32, hardware="cpu",
                                          inputs=batches[0], grad_accum=k, accumulation=accumulation)
    engine = _engine(model, smallest, grad_accum=k, accumulation=accumulation)
    plain = _engine(RowLogprobs(copy.deepcopy(gpt), hand_out=False), smallest, grad_accum=k,
                    accumulation=accumulation)
    eager = RowLogprobs(copy.deepcopy(gpt))
    for start in range(0, len(batches), k):
        engine.synchronize()
        eager.load_state_dict(engine.state_dict())          # the masters this step starts from
        seen = []
        for batch in batches[start:start + k]:
            assert engine.step(**batch) == plain.step(**batch)
            seen.append(engine.last_outputs)
        if accumulation == "layer":
            assert seen[0] is None and len(engine.accumulated_outputs) == k
            seen = engine.accumulated_outputs
        assert seen[-1] is engine.last_outputs or accumulation == "layer"
        for batch, got in zip(batches[start:start + k], seen):
            want = _eager_outputs(eager, batch)
            assert all(torch.allclose(got[n], want[n], rtol=1e-6, atol=1e-6) for n in want)
    engine.synchronize()
    plain.synchronize()
    theirs = plain.state_dict()
    assert all(torch.equal(v, theirs[n]) for n, v in engine.state_dict().items())
    assert engine.plan.predicted_peak_bytes <= smallest * 2 ** 30
    engine.close()
    plain.close()


def test_a_skipped_step_hands_out_its_own_forward_and_a_failed_one_none():
    engine = _engine(RowLogprobs(_gpt()))
    good, bad = _batches(1)[0], _batches(1, scale=float("nan"))[0]
    engine.step(**good)
    with pytest.warns(RuntimeWarning, match="skipped"):
        engine.step(**bad)
    assert engine.last_step.skipped == "loss"
    assert set(engine.last_outputs) == {"rows", "first_logit"}
    assert torch.isfinite(engine.last_outputs["rows"]).all()      # the rows' values; the scale made the loss NaN
    with pytest.raises(megacompile.InputMismatchError):
        engine.step(**{**good, "targets": torch.full_like(good["targets"], VOCAB + 5)})
    assert engine.last_outputs is None                      # not the skipped step's
    engine.close()


class HandsOutLogits(nn.Module):
    """A Hugging Face causal LM inside a wrapper: its loss, its logits handed out beside it."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, **batch):
        out = self.lm(**batch)
        return LossAndOutputs(out.loss, {"logits": out.logits})


def _hf_batch(vocab: int) -> dict:
    ids = torch.randint(3, vocab, (2, T), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def test_a_wrapped_hf_models_kv_cache_is_turned_off_as_the_root_ones():
    """The inner model's config, not the wrapper's (it has none), says use_cache: the step has no cache."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    lm = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, use_cache=True))
    batch = _hf_batch(VOCAB)
    with torch.no_grad():
        want = copy.deepcopy(lm)(**batch, use_cache=False).logits
    engine = _engine(HandsOutLogits(lm))
    assert lm.config.use_cache is False
    engine.step(**batch)
    assert torch.allclose(engine.last_outputs["logits"], want, rtol=1e-5, atol=1e-5)
    engine.close()


def test_an_moe_models_logits_come_out_beside_its_loss_with_the_router_loss_added_in_place():
    """Mixtral adds its load-balancing loss to the loss in place (`loss += coef * aux_loss`), so its
    epilogue is traced functionalized: the handed-out logits stay a detached value, with no gradient
    through them, and the loss is eager's."""
    from tests.families import FAMILIES
    torch.manual_seed(0)
    lm = FAMILIES["mixtral"]()
    assert lm.config.output_router_logits
    batch = _hf_batch(lm.config.vocab_size)
    with torch.no_grad():
        want = copy.deepcopy(lm)(**batch)
    engine = _engine(HandsOutLogits(lm))
    loss = engine.step(**batch)
    assert loss == pytest.approx(want.loss.item(), rel=1e-5)
    assert torch.allclose(engine.last_outputs["logits"], want.logits, rtol=1e-5, atol=1e-5)
    engine.close()
