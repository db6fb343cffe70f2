"""Planning's captures log few blocks: the first logs the first two and the last of each group
built alike (capture/alike.py), later sizes (plan_global_batch) one block per group."""
from __future__ import annotations

import types

import torch

import megacompile.capture.top as top
from megacompile.capture import capture
from tests import models


def _capture(model, batch):
    ids = torch.empty(batch, 8, dtype=torch.long, device="meta")
    return capture(model, (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                   compute_dtype=torch.float32)


def _logging_record(monkeypatch, model) -> list[int]:
    logged: list[int] = []
    real = top.record

    def counting(block, *a, **k):
        logged.append(next(i for i, b in enumerate(model.model.layers) if b is block))
        return real(block, *a, **k)
    monkeypatch.setattr(top, "record", counting)
    return logged


def _block_templates(captured) -> list[int]:
    return [id(st.template) for st in captured.stages if st.template.kind == "block"]


def test_later_sizes_log_one_block_per_group_and_keep_the_groups(monkeypatch):
    model = models.hf_llama(layers=4, d=32).to("meta")
    model.model.layers[2].mlp.act_fn = torch.nn.GELU()     # block 2 computes something else
    logged = _logging_record(monkeypatch, model)
    with top.blocks_grouped_once():
        first = _capture(model, 4)
        n_first, logged[:] = list(logged), []
        second = _capture(model, 2)
    assert n_first == [0, 1, 2, 3] and logged == [0, 2]
    for c in (first, second):
        templates = [id(st.template) for st in c.stages if st.template.kind == "block"]
        assert templates[0] == templates[1] == templates[3] != templates[2]
    assert second.inputs[0].shape[0] == 2
    # Outside the context every capture logs every block again.
    logged[:] = []
    _capture(model, 2)
    assert logged == [0, 1, 2, 3]


def test_planning_logs_the_first_two_and_the_last_block_of_each_group_built_alike(monkeypatch):
    model = models.hf_llama(layers=8, d=32).to("meta")
    model.model.layers[3].mlp.act_fn = torch.nn.GELU()     # its modules differ: a group of its own
    logged = _logging_record(monkeypatch, model)
    with top.blocks_grouped_once():
        captured = _capture(model, 2)
    assert logged == [0, 1, 3, 7]
    t = _block_templates(captured)
    assert len({t[i] for i in (0, 1, 2, 4, 5, 6, 7)}) == 1 and t[3] != t[0]
    # A training capture logs every block.
    logged[:] = []
    _capture(model, 2)
    assert logged == list(range(8))


def test_a_sampled_block_that_computes_otherwise_makes_planning_log_every_block(monkeypatch):
    from transformers.models.llama import modeling_llama
    model = models.hf_llama(layers=6, d=32).to("meta")
    forward = modeling_llama.LlamaMLP.forward
    last = model.model.layers[5].mlp

    def doubled_in_the_last(self, x):      # alike in every module; the last block computes otherwise
        out = forward(self, x)
        return out * 2 if self is last else out
    monkeypatch.setattr(modeling_llama.LlamaMLP, "forward", doubled_in_the_last)
    logged = _logging_record(monkeypatch, model)
    with top.blocks_grouped_once():
        captured = _capture(model, 2)
    assert logged == [0, 1, 5] + list(range(6))
    t = _block_templates(captured)
    assert len(set(t[:5])) == 1 and t[5] != t[0]


def test_mixture_of_experts_blocks_built_alike_are_grouped_while_their_experts_are_patched(monkeypatch):
    """Capturing gives every experts module a forward of its own (capture/experts.py); blocks whose
    experts all run the one function still group, so planning logs the first two and the last."""
    import transformers
    config = transformers.Qwen3MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=32, use_cache=False)
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(config)
    logged = _logging_record(monkeypatch, model)
    with top.blocks_grouped_once():
        captured = _capture(model, 2)
    assert logged == [0, 1, 5]
    assert len(set(_block_templates(captured))) == 1


def test_a_block_whose_own_forward_is_another_function_is_its_own_group():
    from megacompile.capture.alike import structure_key
    model = models.hf_llama(layers=3, d=32).to("meta")
    a, b, c = model.model.layers

    def doubled(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)

    def doubled_too(self, *args, **kwargs):
        return type(self).forward(self, *args, **kwargs)
    for block, f in ((a, doubled), (b, doubled), (c, doubled_too)):
        block.mlp.forward = types.MethodType(f, block.mlp)
    assert structure_key(a) == structure_key(b) != structure_key(c)


def test_blocks_whose_forwards_one_factory_wrapped_are_alike_unless_what_it_holds_differs():
    """Capturing wraps some modules' forwards in a closure of their own (the vision attention:
    capture/vision_chunks.py); blocks so wrapped by one factory over values alike still group."""
    from megacompile.capture.alike import structure_key
    model = models.hf_llama(layers=4, d=32).to("meta")

    def scaled(forward, scale):
        def run(*args, **kwargs):
            return forward(*args, **kwargs) * scale
        return run

    def other(forward, scale):
        def run(*args, **kwargs):
            return forward(*args, **kwargs) * scale
        return run
    a, b, c, d = model.model.layers
    for block, factory, scale in ((a, scaled, 1.0), (b, scaled, 1.0), (c, scaled, 2.0), (d, other, 1.0)):
        block.mlp.forward = factory(block.mlp.forward, scale)
    keys = [structure_key(block) for block in (a, b, c, d)]
    assert keys[0] == keys[1] and keys[2] != keys[0] and keys[3] != keys[0]
    b.mlp.forward = scaled(a.mlp.forward, 1.0)     # wraps another block's module: not alike
    assert structure_key(b) != keys[0]
