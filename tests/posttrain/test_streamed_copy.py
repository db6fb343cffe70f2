"""The streamed generation copy (posttrain/streamed_copy.py): its completions equal the resident
copy's (and so the engine's) in fp32, it follows the masters on sync(), and the layer weights on
the device at once never exceed two layers, counted by a stand-in for the host-to-device copy that
makes real copies and watches them freed. The cuda path (pinned host memory, the side stream's
prefetch and its events) runs against tests/runtime/fake_gpu.py's stand-in."""

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain.hf_generator import HFGenerator
from megacompile.posttrain.rollout import EngineGenerator
from megacompile.posttrain.rollout_batch import rollout_batch
from megacompile.posttrain.streamed_copy import CudaHostToDevice, HostToDevice, StreamedHFGenerator
from tests.posttrain.test_hf_generator import EOS, PROMPTS, _engine, _policy_masters
from tests.runtime.fake_gpu import FakeGpu


class _Counted:
    """Every host-to-device copy a real new tensor (the stand-in device), counted; and, seen from
    hooks on each layer beside the streamer's, the bytes of layer parameters off their host
    tensors (on the device) at once, and the most."""

    def __init__(self, monkeypatch):
        self.copies, self.seen = 0, []
        monkeypatch.setattr(HostToDevice, "copy", lambda moves, host: self.copy(host))

    def copy(self, host: torch.Tensor) -> torch.Tensor:
        self.copies += 1
        return host.clone()

    def watch(self, generator) -> None:
        layers = list(generator.model.model.layers)
        hosts = [(p, p.data_ptr()) for layer in layers for p in layer.parameters()]

        def look(*_):
            self.seen.append(self.on_device(hosts))
        self.on_device = lambda hosts: sum(p.numel() * p.element_size() for p, ptr in hosts if p.data_ptr() != ptr)
        self.hosts = hosts
        for layer in layers:
            layer.register_forward_pre_hook(look)
            layer.register_forward_hook(look)

    @property
    def live(self) -> int:
        return self.on_device(self.hosts)

    @property
    def most(self) -> int:
        return max(self.seen)


def _layer_bytes(generator) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in generator.model.model.layers]


def test_streamed_copy_generates_what_the_resident_copy_does_and_follows_the_masters(monkeypatch):
    engine = _engine()
    resident = HFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    counted = _Counted(monkeypatch)
    streamed = StreamedHFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    counted.watch(streamed)
    greedy = streamed.generate(PROMPTS, 2, 6, temperature=0)
    assert greedy == resident.generate(PROMPTS, 2, 6, temperature=0)
    sampled = streamed.generate(PROMPTS, 3, 6, temperature=1.0)
    assert sampled == resident.generate(PROMPTS, 3, 6, temperature=1.0)
    layers = _layer_bytes(streamed)
    n = len(layers)
    # each forward (a prefill, then one per new token) brought every layer's parameters once
    params = sum(1 for _ in streamed.model.model.layers[0].parameters())
    assert counted.copies >= 2 * 6 * n * params and counted.copies % (n * params) == 0
    assert max(layers) < counted.most <= 2 * max(layers)      # streamed: more than one layer, never three
    assert counted.live == 0                                     # all freed once generate returns

    ours = EngineGenerator(engine, eos_id=EOS, seed=1)
    for _ in range(2):
        batch = rollout_batch(sampled, torch.arange(9.0), 3, width=4 + 6)
        engine.step(**batch, old_logps=torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"])))
    after = ours.generate(PROMPTS, 2, 6, temperature=0)
    assert streamed.generate(PROMPTS, 2, 6, temperature=0) != after
    streamed.sync()
    assert streamed.generate(PROMPTS, 2, 6, temperature=0) == after
    masters = _policy_masters(engine)
    for name, p in streamed.model.state_dict().items():        # the layers' host tensors hold the masters
        assert torch.equal(p, masters[name]), name
    engine.close()


def test_layer_weights_come_back_to_the_host_when_a_forward_fails(monkeypatch):
    engine = _engine()
    counted = _Counted(monkeypatch)
    streamed = StreamedHFGenerator(engine, eos_id=EOS, dtype=torch.float32)
    counted.watch(streamed)
    hosts = [p.data_ptr() for p in streamed.model.model.layers[1].parameters()]

    def fail(module, args):
        raise RuntimeError("out of memory")
    handle = streamed.model.model.layers[1].mlp.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        streamed.generate(PROMPTS, 1, 3, temperature=0)
    assert [p.data_ptr() for p in streamed.model.model.layers[1].parameters()] == hosts
    assert counted.live == 0
    handle.remove()
    assert streamed.generate(PROMPTS, 1, 3, temperature=0) == HFGenerator(engine, eos_id=EOS, dtype=torch.float32) \
        .generate(PROMPTS, 1, 3, temperature=0)
    engine.close()


def test_on_cuda_layers_are_pinned_and_prefetched_on_a_side_stream(monkeypatch):
    engine = _engine()
    expected = HFGenerator(engine, eos_id=EOS, dtype=torch.float32).generate(PROMPTS, 1, 2, temperature=0)
    gpu = FakeGpu().install(monkeypatch)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t: pinned.append(t.shape) or t)
    monkeypatch.setattr(StreamedHFGenerator, "_moves", lambda self: CudaHostToDevice(self.device))
    streamed = StreamedHFGenerator(engine, eos_id=EOS, dtype=torch.float32)
    layer_params = [list(layer.parameters()) for layer in streamed.model.model.layers]
    assert sorted(pinned) == sorted(p.shape for params in layer_params for p in params)   # the layers' alone
    gpu.log.clear()
    assert streamed.generate(PROMPTS, 1, 2, temperature=0) == expected
    log = gpu.log
    records = [e for e in log if e[0] == "record" and e[1] == "side0"]
    assert len(records) == 2           # layer 1 prefetched in each of the two forwards (prefill, one decode)
    for record in records:
        at = log.index(record)
        # the side stream waited for the compute stream before copying, and compute waits for the copy
        assert log[at - 1][:2] == ("wait", "side0") and log[at - 2] == ("record", "compute", log[at - 1][2])
        assert ("wait", "compute", record[2]) in log[at:]
    # each device copy is marked used by the compute stream before it is dropped
    assert sum(e[0] == "record_stream" and e[1] == "compute" for e in log) == 2 * sum(map(len, layer_params))
    engine.close()


def test_a_model_that_names_no_decoder_layers_is_refused(monkeypatch):
    from transformers.models.llama.modeling_llama import LlamaPreTrainedModel
    monkeypatch.setattr(LlamaPreTrainedModel, "_no_split_modules", [])
    engine = _engine()
    with pytest.raises(ArgumentError, match="names none .* use generator hf"):
        StreamedHFGenerator(engine)
    engine.close()


def test_a_prefill_in_chunks_streams_the_layers_once_a_chunk_and_gives_the_same_completions(monkeypatch):
    from megacompile.cost import generation_memory
    engine = _engine()
    resident = HFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    whole = resident.generate(PROMPTS, 1, 4, temperature=0)
    counted = _Counted(monkeypatch)
    streamed = StreamedHFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32)
    counted.watch(streamed)
    monkeypatch.setattr(generation_memory, "PREFILL_TOKENS", 3 * 2)     # 3 rows: chunks of 2 of the 4 positions
    assert streamed.generate(PROMPTS, 1, 4, temperature=0) == whole
    n, params = len(streamed.model.model.layers), sum(1 for _ in streamed.model.model.layers[0].parameters())
    # two prefill chunks, then a forward for each new token after the first: the layers brought each time
    assert counted.copies == (2 + 3) * n * params and counted.live == 0
    engine.close()
