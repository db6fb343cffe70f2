"""A gradient lands in its final host buffer: with one micro-batch per step the device copy goes
straight into the owner's grad slot (page-locked on cuda), and the host adds nothing."""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.runtime.host import HostState


def _engine(grad_accum: int, tie: bool = False):
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64))
    if tie:
        model.lm_head.weight = model.embed.weight
    return megacompile.compile(model, hbm_budget=1.0, device="cpu", grad_accum=grad_accum)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_gradients_land_in_place_only_with_one_micro_batch(monkeypatch, grad_accum):
    landed: dict[str, bool] = {}
    real = HostState.accumulate_grad

    def spy(self, name, g):
        slot = self.slots[name]
        grad = self.owners[slot.owner].grad
        landed[name] = grad.data_ptr() <= g.data_ptr() < grad.data_ptr() + grad.numel() * grad.element_size()
        real(self, name, g)
    monkeypatch.setattr(HostState, "accumulate_grad", spy)
    engine = _engine(grad_accum)
    ids = torch.randint(0, 64, (2, 8))
    for _ in range(grad_accum):
        engine.step(input_ids=ids, labels=ids)
    engine.synchronize()
    assert landed and all(landed.values()) == (grad_accum == 1), landed
    engine.close()


def test_a_tied_weight_is_summed_first_not_landed_in_place(monkeypatch):
    engine = _engine(1, tie=True)
    ids = torch.randint(0, 64, (2, 8))
    engine.prepare(input_ids=ids, labels=ids)
    host = engine.host
    g = torch.zeros(host.slots["embed.weight"].shape)
    assert host.landing_view("embed.weight", g) is None
    name = next(n for n, u in host.uses.items() if u == 1)
    view = host.landing_view(name, torch.zeros(host.slots[name].shape))
    assert view is not None and view.untyped_storage().data_ptr() == host.owners[host.slots[name].owner].grad.data_ptr()
    # a gradient of another dtype than the buffer's is staged and converted, never landed
    assert host.landing_view(name, torch.zeros(host.slots[name].shape, dtype=torch.bfloat16)) is None
    engine.close()
