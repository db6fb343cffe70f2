"""megacompile's peers in the bench (bench/peer_systems.py): FSDP2 steps its host parameters with
torch's fused AdamW, and DeepSpeed builds its model under zero.Init and starts its fp32 masters
from the fp32 weights every system starts from. DeepSpeed is a stand-in module here."""
import sys
import types
from contextlib import contextmanager
from dataclasses import replace

import pytest
import torch

from megacompile.bench import peer_systems, weights
from megacompile.bench.workload import Workload

TINY = Workload(shape="tiny", device="cpu", batch=2, seq=32, steps=2, warmup=1)


class Built(Exception):
    """Stops a system once its optimizer is made."""


@pytest.fixture
def no_rank_environment(monkeypatch):
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.setenv(key, "")     # recorded as it was, so what the one-rank group sets goes with the test
        monkeypatch.delenv(key)


@pytest.mark.parametrize("fused", [True, False])
def test_fsdp2_steps_its_host_parameters_with_the_adamw_asked_for(monkeypatch, no_rank_environment, fused):
    made = []

    def adamw(params, **kwargs):
        made.append(kwargs)
        raise Built
    monkeypatch.setattr(torch.optim, "AdamW", adamw)
    with pytest.raises(Built):
        peer_systems.run_fsdp2(TINY, fused=fused)
    assert made[0]["fused"] is fused and made[0]["lr"] == TINY.lr
    assert peer_systems.run_fsdp2.__defaults__ == (True,)       # the row the table compares with


class FakeDeepSpeed:
    """What run_deepspeed calls of deepspeed, recording the order of events and the masters set."""

    def __init__(self):
        self.inside_init, self.events, self.masters, self.gathered, self.rates = False, [], {}, [], []
        zero = types.SimpleNamespace(Init=self.Init, GatheredParameters=self.GatheredParameters)
        self.modules = {
            "deepspeed": types.SimpleNamespace(zero=zero, initialize=self.initialize),
            "deepspeed.utils": types.SimpleNamespace(safe_set_full_fp32_param=self.set_master),
            "deepspeed.ops": types.SimpleNamespace(),
            "deepspeed.ops.op_builder": types.SimpleNamespace(CPUAdamBuilder=lambda: types.SimpleNamespace(
                load=lambda: self.events.append("cpu adam op built"))),
        }

    @contextmanager
    def Init(self, config_dict_or_path=None, **kwargs):
        self.events.append("zero.Init")
        self.config = config_dict_or_path
        self.inside_init = True
        try:
            yield
        finally:
            self.inside_init = False

    @contextmanager
    def GatheredParameters(self, params, modifier_rank=None):
        self.gathered += list(params)
        yield

    def set_master(self, param, value):
        self.masters[id(param)] = value.clone()

    def initialize(self, model, model_parameters, config):
        self.events.append("initialize")
        self.model, self.initialized_with = model, config
        fake = self

        class Engine:
            module, device = model, torch.device("cpu")

            def __call__(self, ids, labels):
                return model(ids, labels)

            def backward(self, loss):
                loss.backward()

            optimizer = types.SimpleNamespace(param_groups=[{"lr": config["optimizer"]["params"]["lr"]}])

            def step(self):
                fake.events.append("step")
                fake.rates.append(self.optimizer.param_groups[0]["lr"])
        return Engine(), None, None, None


def test_deepspeed_builds_its_model_under_zero_init_and_its_masters_from_fp32_weights(monkeypatch, tmp_path):
    fake = FakeDeepSpeed()
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(peer_systems, "_one_rank_group", lambda backend: None)
    folder = weights.write(TINY, tmp_path)
    built_inside = []
    model = Workload.model
    monkeypatch.setattr(Workload, "model", lambda self: built_inside.append(fake.inside_init) or model(self))

    out = peer_systems.run_deepspeed(TINY, str(folder))
    assert built_inside == [True]
    assert fake.config["zero_optimization"]["offload_param"]["device"] == "cpu"
    # DeepSpeed clips at a total norm of 1.0 when the config says nothing (since 0.19.3); the other
    # systems do not clip, and the losses are compared step by step
    assert fake.initialized_with.get("gradient_clipping", 1.0) == 0.0
    assert fake.events[:3] == ["cpu adam op built", "zero.Init", "initialize"]
    reference = model(TINY).state_dict()
    params = dict(fake.model.named_parameters())
    assert set(params) == set(reference) and {id(p) for p in fake.gathered} == {id(p) for p in params.values()}
    for name, p in params.items():
        assert fake.masters[id(p)].dtype == torch.float32
        assert torch.equal(fake.masters[id(p)], reference[name]), name
    assert len(out["losses"]) == 3 and out["cpu_adam_op_s"] >= 0
    assert fake.rates == [TINY.lr] * 3      # no warmup asked: lr from the first step


def test_deepspeed_steps_at_the_workloads_rates(monkeypatch, tmp_path):
    fake = FakeDeepSpeed()
    for name, module in fake.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(peer_systems, "_one_rank_group", lambda backend: None)
    warm = replace(TINY, lr_warmup=4)
    peer_systems.run_deepspeed(warm, str(weights.write(warm, tmp_path)))
    assert fake.rates == [warm.lr / 4, warm.lr / 2, 3 * warm.lr / 4]


def test_fsdp2_steps_at_the_workloads_rates(monkeypatch, no_rank_environment):
    """A real run on the cpu: the fused AdamW reads its group's lr as each step starts."""
    rates = []

    class Recording(torch.optim.AdamW):
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)
    monkeypatch.setattr(torch.optim, "AdamW", Recording)
    warm = replace(TINY, lr_warmup=3)
    peer_systems.run_fsdp2(warm)
    assert rates == [warm.lr / 3, 2 * warm.lr / 3, warm.lr]
