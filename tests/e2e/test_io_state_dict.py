"""engine.load_state_dict in parts: a model built on meta loads one shard at a time, before its
first trace or after prepare(), trains exactly once complete, and is refused, naming what is
missing, while it is not."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.io.hf_load import parameters_on_meta
from tests import models
from tests.e2e.harness import clone


def _ids():
    return models.batch(96, 2, 16)


def _parts(state: dict, n: int = 3) -> list[dict]:
    keys = list(state)
    return [{k: state[k] for k in keys[i::n]} for i in range(n)]


def _real_and_meta_engine():
    torch.manual_seed(0)
    real = models.NanoGPT(vocab=96, d=32, layers=2)
    with torch.device("meta"):
        meta = models.NanoGPT(vocab=96, d=32, layers=2)
    return real, megacompile.compile(meta, hbm_budget=1.0, device="cpu")


def _eager_loss(real) -> float:
    expected = clone(real)
    opt = torch.optim.AdamW(expected.parameters())
    _, loss = expected(_ids(), _ids())
    loss.backward()
    opt.step()
    return loss.item()


@pytest.mark.parametrize("when", ["before the trace", "after prepare"])
def test_a_meta_model_loads_one_part_at_a_time_and_trains_exactly(when):
    real, engine = _real_and_meta_engine()
    if when == "after prepare":
        engine.prepare(idx=_ids(), targets=_ids())    # host state first: each part goes straight in
    parts = _parts(real.state_dict())
    for part in parts[:-1]:
        engine.load_state_dict(part, strict=False)
    with pytest.raises(megacompile.MegacompileError, match="missing .*strict=True: the dict must hold them all"):
        engine.load_state_dict(parts[-1])                # strict: this call's dict alone must be whole
    engine.load_state_dict(parts[-1], strict=False)
    assert engine.step(idx=_ids(), targets=_ids()) == _eager_loss(real)


@pytest.mark.parametrize("before", ["nothing", "a whole load", "a part"])
def test_strict_requires_every_weight_in_the_call_itself(before):
    """strict=True is torch's: the call's dict is whole, whatever earlier calls loaded."""
    real, engine = _real_and_meta_engine()
    state = real.state_dict()
    if before == "a whole load":
        engine.load_state_dict(state)
    elif before == "a part":
        engine.load_state_dict({"transformer.ln_f.bias": state["transformer.ln_f.bias"]}, strict=False)
    with pytest.raises(megacompile.MegacompileError, match=r"missing \['transformer.ln_f.bias'\]"):
        engine.load_state_dict({k: v for k, v in state.items() if k != "transformer.ln_f.bias"})


def test_strict_false_skips_unknown_keys_and_returns_torchs_incompatible_keys():
    real, engine = _real_and_meta_engine()
    state = real.state_dict()
    result = engine.load_state_dict({**state, "head.extra": torch.zeros(3)}, strict=False)
    assert result.unexpected_keys == ["head.extra"] and result.missing_keys == []
    part = {k: v for k, v in state.items() if k != "transformer.ln_f.bias"}
    result = engine.load_state_dict(part, strict=False)
    assert result.missing_keys == ["transformer.ln_f.bias"] and result.unexpected_keys == []
    assert repr(engine.load_state_dict(state)) == "<All keys matched successfully>"
    with pytest.raises(megacompile.MegacompileError, match=r"unexpected \['head.extra'\]"):
        engine.load_state_dict({**state, "head.extra": torch.zeros(3)})
    assert engine.step(idx=_ids(), targets=_ids()) == _eager_loss(real)


def test_an_incomplete_meta_model_is_refused_at_its_first_step_naming_what_is_missing():
    real, engine = _real_and_meta_engine()
    state = real.state_dict()
    engine.load_state_dict({k: v for k, v in state.items() if k != "transformer.ln_f.bias"}, strict=False)
    with pytest.raises(megacompile.MegacompileError, match="never loaded: transformer.ln_f.bias"):
        engine.step(idx=_ids(), targets=_ids())
    with pytest.raises(megacompile.MegacompileError, match=r"wrong shapes.*transformer.ln_f.bias.*nothing was loaded"):
        engine.load_state_dict({"transformer.ln_f.bias": torch.zeros(3)}, strict=False)
    with pytest.raises(megacompile.MegacompileError, match=r"unexpected \['ln_g.bias'\]"):
        engine.load_state_dict({"ln_g.bias": torch.zeros(32)})
    engine.load_state_dict({"transformer.ln_f.bias": state["transformer.ln_f.bias"]}, strict=False)
    assert engine.step(idx=_ids(), targets=_ids()) == _eager_loss(real)


def test_a_hugging_face_model_on_meta_names_its_rotary_buffer_or_keeps_its_own():
    torch.manual_seed(0)
    real = models.hf_llama(layers=2, d=32)
    with torch.device("meta"):                      # inv_freq too: no values, and not in state_dict
        meta = models.hf_llama(layers=2, d=32)
    engine = megacompile.compile(meta, hbm_budget=1.0, device="cpu")
    with pytest.raises(megacompile.MegacompileError, match="missing .*inv_freq.*non-persistent buffers"):
        engine.load_state_dict(real.state_dict())
    with parameters_on_meta():                      # parameters on meta, buffers computed as eagerly
        meta = models.hf_llama(layers=2, d=32)
    engine = megacompile.compile(meta, hbm_budget=1.0, device="cpu")
    for part in _parts(real.state_dict()):
        engine.load_state_dict(part, strict=False)
    ids = _ids()
    expected = real(input_ids=ids, labels=ids).loss.item()
    assert engine(input_ids=ids, labels=ids).loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("how", ["prepare", "a refused first step"])
def test_a_meta_model_with_host_state_but_no_weights_reads_and_saves_nothing(how, tmp_path):
    """prepare() (or a first step refused for want of weights) builds the host state of a model
    built on meta: its buffers hold no weights until they are loaded, and nothing reads them."""
    torch.manual_seed(0)
    real = models.hf_llama(layers=2, d=32)
    with parameters_on_meta():
        meta = models.hf_llama(layers=2, d=32)
    engine = megacompile.compile(meta, hbm_budget=1.0, device="cpu")
    ids = _ids()
    if how == "prepare":
        engine.prepare(input_ids=ids, labels=ids)
    else:
        with pytest.raises(megacompile.MegacompileError, match="has no weights: load them"):
            engine.step(input_ids=ids, labels=ids)
    assert engine.host is not None
    state = real.state_dict()
    for loaded in ({}, {k: v for k, v in state.items() if k != "lm_head.weight"}):
        engine.load_state_dict(loaded, strict=False)
        with pytest.raises(megacompile.MegacompileError, match=r"no weights yet: the model was built on the meta "
                                                               r"device; load them"):
            engine.state_dict()
        with pytest.raises(megacompile.MegacompileError, match=r"no weights for lm_head.weight.* yet \(built on "
                                                               r"meta\): load them .*before saving"):
            engine.save_checkpoint(str(tmp_path / "ck"))
        with pytest.raises(megacompile.MegacompileError, match=r"no weights for lm_head.weight.* yet"):
            engine.save_pretrained(str(tmp_path / "hf"))
        assert list(tmp_path.iterdir()) == []
    engine.load_state_dict({"lm_head.weight": state["lm_head.weight"]}, strict=False)
    assert torch.equal(engine.state_dict()["model.layers.1.mlp.down_proj.weight"],
                       state["model.layers.1.mlp.down_proj.weight"])
    engine.save_checkpoint(str(tmp_path / "ck"))


@pytest.mark.parametrize("when", ["before the trace", "after a step"])
def test_both_names_of_a_tied_weight_with_different_values_are_refused_naming_both(when):
    torch.manual_seed(0)
    model = models.NanoGPT(vocab=96, d=32, layers=2)      # transformer.wte.weight is lm_head.weight
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    if when == "after a step":
        engine.step(idx=_ids(), targets=_ids())
    before = engine.state_dict()
    w = torch.randn(96, 32)
    with pytest.raises(megacompile.MegacompileError, match=r"transformer.wte.weight and lm_head.weight name one tied "
                                                           r"tensor.*different values; nothing was loaded"):
        engine.load_state_dict({"transformer.wte.weight": w, "lm_head.weight": w + 1}, strict=False)
    after = engine.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    engine.load_state_dict({"transformer.wte.weight": w, "lm_head.weight": w.clone()}, strict=False)  # one value: fine
    assert torch.equal(engine.state_dict()["lm_head.weight"], w)
