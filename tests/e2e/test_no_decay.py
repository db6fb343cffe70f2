"""AdamW(no_decay=...): the parameters it names step with weight decay 0 and the rest with
weight_decay, as torch.optim.AdamW over two param groups does; megacompile.hf_no_decay picks them
as Hugging Face's Trainer does (biases and norm weights). Held against eager AdamW with the
Trainer's own groups, in RAM and through the disk tier, and across a checkpoint."""
from __future__ import annotations

import functools

import pytest
import torch

import megacompile
from megacompile.cost.host_memory import LEVELS, host_costs
from tests import models
from tests.e2e.atomic import assert_bit_equal
from tests.e2e.harness import assert_same_weights, clone, float64_noise

LR, WD, GiB = 1e-2, 0.1, 2 ** 30


def _model():
    torch.manual_seed(0)
    return models.NanoGPT(vocab=96, d=32, layers=2, heads=2)


def _batches(n):
    return [models.batch(96, 2, 16, seed=i) for i in range(n)]


@functools.lru_cache(maxsize=None)
def _trainer_decay_rule():
    from transformers import Trainer     # seconds to import: once
    return Trainer.get_decay_parameter_names


def _hf_decayed(model) -> set[str]:
    """The parameters transformers' Trainer decays (its first param group)."""
    return set(_trainer_decay_rule()(None, model))


def _engine(model, kernel="torch", no_decay=megacompile.hf_no_decay, **kw):
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", **kw, optimizer=megacompile.AdamW(
        lr=LR, weight_decay=WD, kernel=kernel, no_decay=no_decay))


def _train(engine, batches):
    return [engine.step(idx=ids, targets=ids) for ids in batches]


@pytest.mark.parametrize("kernel", ["torch", "fused"])
def test_hf_grouping_trains_as_eager_adamw_over_the_trainers_two_param_groups(kernel):
    model, batches = _model(), _batches(5)
    decayed = _hf_decayed(model)

    def train(m):
        named = list(m.named_parameters())
        opt = torch.optim.AdamW([{"params": [p for n, p in named if n in decayed], "weight_decay": WD},
                                 {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}], lr=LR)
        losses = []
        for ids in batches:
            opt.zero_grad()
            _, loss = m(ids, ids)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    reference = clone(model)
    eager = train(reference)
    engine = _engine(clone(model), kernel)
    exempt = {n for n, _ in model.named_parameters()} - decayed
    assert engine.state.no_decay == exempt and {"transformer.ln_f.weight", "transformer.h.0.ln_1.weight",
                                                "transformer.h.0.attn.qkv.bias"} <= exempt
    ours = _train(engine, batches)
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(eager), rtol=1e-5, atol=0)
    assert_same_weights(engine, reference, noise=float64_noise(train, model, reference))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=16))


@pytest.mark.parametrize("make", [_model, lambda: models.hf_llama(layers=1, d=32),
                                  lambda: models.hf_gpt2(layers=1, d=32), _qwen3],
                         ids=["nanogpt", "llama", "gpt2", "qwen3"])
def test_hf_no_decay_is_the_trainers_rule(make):
    model = make()
    assert set(megacompile.hf_no_decay(model)) == {n for n, _ in model.named_parameters()} - _hf_decayed(model)


def test_through_the_disk_tier_it_trains_bit_for_bit_as_in_ram(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "1024")     # an owner in several pieces, runs across them
    model, batches = _model(), _batches(3)
    ram = _engine(clone(model))
    in_ram = _train(ram, batches)
    room = host_costs(ram.plan.captured, torch.float32)[2].ram_bytes / GiB
    disk = _engine(clone(model), nvme_dir=str(tmp_path / "tier"), host_budget=room)
    assert _train(disk, batches) == in_ram
    assert disk.host_cost.placement == LEVELS[2]             # masters and moments on disk
    assert_bit_equal(disk.state_dict(), ram.state_dict())


def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path):
    model, batches = _model(), _batches(4)
    straight, first = _engine(clone(model)), _engine(clone(model))
    expected = _train(straight, batches)
    _train(first, batches[:2])
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = _engine(clone(model))
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert _train(resumed, batches[2:]) == expected[2:]
    assert_bit_equal(resumed.state_dict(), straight.state_dict())


def test_a_tied_weight_is_exempt_by_any_of_its_names():
    engine = _engine(_model(), no_decay=["lm_head.weight"])      # tied to transformer.wte.weight
    assert engine.state.no_decay == {"transformer.wte.weight"}


@pytest.mark.parametrize("no_decay, message", [
    ("bias", "parameter names .a list"),
    ([3], "holds 3, not a parameter name"),
])
def test_no_decay_that_names_no_parameters_is_refused(no_decay, message):
    with pytest.raises(megacompile.OptimizerInputError, match=message):
        megacompile.AdamW(weight_decay=WD, no_decay=no_decay)


@pytest.mark.parametrize("no_decay, message", [
    (["transformer.h.0.ln_1.weight", "ln_f.weight"],
     r"names 1 of 2 that are no parameter of the model \('ln_f.weight'\).*"
     r"'ln_f.weight' is 'transformer.ln_f.weight'\?"),
    (lambda model: 7, "returned int, not parameter names"),
])
def test_names_the_model_lacks_are_refused_at_compile(no_decay, message):
    with pytest.raises(megacompile.OptimizerInputError, match=message):
        _engine(_model(), no_decay=no_decay)
