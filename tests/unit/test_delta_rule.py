"""megacompile::chunk_gated_delta_rule: transformers' gated delta rule as one operator, eager's bit for bit.

Odd shapes: 100 tokens (not a multiple of the 64-token chunk: the rule pads), value heads wider
than key heads. (Grouped value heads are the model's own business: some transformers releases
repeat the key heads in the layer, others in the rule.)
"""
from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import megacompile.linear_attention.delta_rule  # noqa: F401 - registers the operators
from megacompile.capture.hf_delta_rule import delta_rule_as_op
from megacompile.linear_attention.delta_rule import reference_rule, rule_flops

QWEN3_NEXT = "transformers.models.qwen3_next.modeling_qwen3_next"
B, S, HK, HV, DK, DV = 2, 100, 4, 4, 8, 16


def inputs(dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, S, HK, DK, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(B, S, HV, DV, generator=g).to(dtype)
    decay = -torch.rand(B, S, HV, generator=g)                        # log-space, <= 0, float32 as the layers make it
    beta = torch.rand(B, S, HV, generator=g).to(dtype)
    return [q, k, v, decay, beta]


def eager(q, k, v, g, beta):
    out, _ = reference_rule(QWEN3_NEXT)(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return out


def test_the_operator_gives_eagers_output_and_gradients_bit_for_bit():
    xs = [x.requires_grad_() for x in inputs()]
    out = eager(*xs)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, xs, do)
    ys = [x.detach().clone().requires_grad_() for x in xs]
    ours = torch.ops.megacompile.chunk_gated_delta_rule(*ys, QWEN3_NEXT, True)
    assert torch.equal(ours, out)
    for theirs, mine in zip(grads, torch.autograd.grad(ours, ys, do)):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fake_results_are_the_real_ones_shapes_and_dtypes(dtype):
    xs = inputs(dtype)
    out = torch.ops.megacompile.chunk_gated_delta_rule(*xs, QWEN3_NEXT, True)
    grads = torch.ops.megacompile.chunk_gated_delta_rule_backward(torch.ones_like(out), *xs, QWEN3_NEXT, True)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in xs]
        fake_out = torch.ops.megacompile.chunk_gated_delta_rule(*fakes, QWEN3_NEXT, True)
        fake_grads = torch.ops.megacompile.chunk_gated_delta_rule_backward(torch.ones_like(fake_out), *fakes,
                                                                           QWEN3_NEXT, True)
    for real, fake in zip([out, *grads], [fake_out, *fake_grads]):
        assert (real.shape, real.dtype, real.stride()) == (fake.shape, fake.dtype, fake.stride())


def _traced(fn, xs):
    def joint(q, k, v, g, beta, do):
        out = fn(q, k, v, g, beta)
        return [out, *torch.autograd.grad(out, [q, k, v, g, beta], do)]
    fakes = [x.requires_grad_() for x in xs]
    return make_fx(joint, tracing_mode="fake")(*fakes, torch.randn(B, S, HV, DV))


def test_a_traced_layer_holds_one_operator_and_its_backward_instead_of_the_chunk_loop():
    import transformers.models.qwen3_next.modeling_qwen3_next as module
    model = torch.nn.Module()
    model.net = type("Qwen3NextGatedDeltaNet", (torch.nn.Module,), {"__module__": QWEN3_NEXT})()
    with delta_rule_as_op(model):
        routed = _traced(lambda *a: module.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4],
                                                                        use_qk_l2norm_in_kernel=True)[0], inputs())
    ops = [str(n.target) for n in routed.graph.nodes if n.op == "call_function"]
    assert ops == ["megacompile.chunk_gated_delta_rule.default", "megacompile.chunk_gated_delta_rule_backward.default",
                   "<built-in function getitem>"] + ["<built-in function getitem>"] * 4
    assert module.torch_chunk_gated_delta_rule is reference_rule(QWEN3_NEXT)      # given back
    unrouted = _traced(eager, inputs())
    assert len(unrouted.graph.nodes) > 20 * len(routed.graph.nodes)


def test_a_call_with_a_recurrent_state_packed_lengths_or_other_keywords_runs_the_models_function():
    import transformers.models.qwen3_next.modeling_qwen3_next as module
    model = torch.nn.Module()
    model.net = type("Qwen3NextGatedDeltaNet", (torch.nn.Module,), {"__module__": QWEN3_NEXT})()
    q, k, v, g, beta = inputs()
    state, lengths = torch.zeros(B, HV, DK, DV), torch.tensor([0, S, 2 * S])
    calls = {"a recurrent state": lambda *a: dict(initial_state=a[5]),
             "a final state": lambda *a: dict(output_final_state=True),
             "a keyword the operator does not carry": lambda *a: dict(chunk_size=32)}
    with delta_rule_as_op(model):
        for what, given in calls.items():
            traced = make_fx(lambda *a: module.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4], **given(*a))[0],
                             tracing_mode="fake")(q, k, v, g, beta, state, lengths)
            assert not any("megacompile" in str(n.target) for n in traced.graph.nodes), what
        routed = _outcome(lambda: module.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, cu_seqlens=lengths))
    # packed documents: what the model's own function does with them (5.24's refuses them without
    # flash-linear-attention; 5.17's ignores the lengths), as eagerly
    assert routed == _outcome(lambda: module.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta,
                                                                          cu_seqlens=lengths))


def _outcome(call):
    """A call's result as comparable bytes, or its error's type and message."""
    try:
        out, _ = call()
    except Exception as e:  # noqa: BLE001 - the error itself is the outcome compared
        return type(e), str(e)
    return out.numpy().tobytes()


def test_the_flops_count_the_chunked_forward():
    q, k, v, g, beta = inputs()
    # 2 x (2 C Dk + C (Dk + Dv) / 2 + 3 Dk Dv + C Dv) per (batch, value head, token)
    assert rule_flops(q, v) == 2.0 * B * HV * S * (2 * 64 * DK + 64 * (DK + DV) / 2 + 3 * DK * DV + 64 * DV)


def test_the_backward_operators_scratch_holds_at_least_what_the_rule_saves_for_its_backward():
    """The planner reserves the backward operator's inside (cost/reserve.py): the rule run again
    under autograd holds every tensor it saves for its backward at once, and then its gradients."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from megacompile.cost.delta_rule import backward_scratch as delta_rule_scratch
    xs = [x.requires_grad_() for x in inputs()]
    saved = {}

    def pack(t):
        saved[StorageWeakRef(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        eager(*xs)
    inputs_bytes = sum(x.untyped_storage().nbytes() for x in xs)
    kept = sum(saved.values()) - inputs_bytes
    model = torch.nn.Module()
    model.net = type("Qwen3NextGatedDeltaNet", (torch.nn.Module,), {"__module__": QWEN3_NEXT})()
    import transformers.models.qwen3_next.modeling_qwen3_next as module
    with delta_rule_as_op(model):
        graph = _traced(lambda *a: module.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4],
                                                                       use_qk_l2norm_in_kernel=True)[0], inputs())
    node = next(n for n in graph.graph.nodes if "chunk_gated_delta_rule_backward" in str(n.target))
    scratch = delta_rule_scratch(node)
    assert kept > 0 and kept <= scratch <= 4 * kept + inputs_bytes


def test_each_operator_pays_the_per_op_overhead_of_every_op_the_rule_runs_inside_it():
    """The fallback launches its ops one by one (2 chunks of 64 here): the plan counts them, the
    forward's as eager's own trace of the rule has them, and the backward's as more than twice as many."""
    from megacompile.cost.delta_rule import inner_ops
    import transformers.models.qwen3_next.modeling_qwen3_next as module
    model = torch.nn.Module()
    model.net = type("Qwen3NextGatedDeltaNet", (torch.nn.Module,), {"__module__": QWEN3_NEXT})()
    with delta_rule_as_op(model):
        graph = _traced(lambda *a: module.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4],
                                                                       use_qk_l2norm_in_kernel=True)[0], inputs())
    forward, backward = (next(n for n in graph.graph.nodes if str(n.target) == f"megacompile.{op}.default")
                         for op in ("chunk_gated_delta_rule", "chunk_gated_delta_rule_backward"))
    with torch.no_grad():
        eager_ops = make_fx(eager, tracing_mode="fake")(*inputs())
    assert inner_ops(forward) == sum(n.op == "call_function" for n in eager_ops.graph.nodes) > 20
    assert inner_ops(backward) > 2 * inner_ops(forward)
    assert inner_ops(next(n for n in graph.graph.nodes if n.op == "call_function" and "getitem" in str(n.target))) == 1
    from megacompile.cost.estimate import node_seconds
    from megacompile.cost.hardware import PROFILES
    h100 = PROFILES["h100"]
    assert node_seconds(forward, h100, torch.float32) >= h100.op_overhead_s * inner_ops(forward) > 0


def test_a_rule_that_cannot_run_on_meta_tensors_gets_dense_fake_results():
    """flash-linear-attention's rule is a Triton kernel: no run on meta tensors tells its layouts."""
    from megacompile.linear_attention.delta_rule import remember

    def kernel_like(q, k, v, g, beta, **kwargs):
        if q.is_meta:
            raise NotImplementedError("a Triton kernel takes no meta tensors")
        return reference_rule(QWEN3_NEXT)(q, k, v, g=g, beta=beta, **kwargs)
    remember("tests.unit.kernel_like_rule", kernel_like)
    xs = inputs()
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in xs]
        out = torch.ops.megacompile.chunk_gated_delta_rule(*fakes, "tests.unit.kernel_like_rule", True)
        grads = torch.ops.megacompile.chunk_gated_delta_rule_backward(torch.ones_like(out), *fakes,
                                                                      "tests.unit.kernel_like_rule", True)
    assert out.shape == (B, S, HV, DV) and out.is_contiguous()
    assert all(d.shape == x.shape and d.is_contiguous() for d, x in zip(grads, xs))
    real = torch.ops.megacompile.chunk_gated_delta_rule(*xs, "tests.unit.kernel_like_rule", True)
    assert torch.equal(real, eager(*xs))


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_the_models_own_layers_are_captured_onto_the_operator(family):
    """The keywords the real layers pass (use_cache, output_router_logits, ...) keep the routing."""
    from megacompile.capture import capture
    from tests.families import FAMILIES, batch
    torch.manual_seed(0)
    ids = batch(b=1, t=16)
    captured = capture(FAMILIES[family](), (), {"input_ids": ids, "labels": ids}, device=torch.device("cpu"),
                       compute_dtype=torch.float32)
    targets = {str(n.target) for st in captured.stages for prog in (st.template.forward, st.template.backward)
               if prog is not None for n in prog.gm.graph.nodes}
    assert {"megacompile.chunk_gated_delta_rule.default",
            "megacompile.chunk_gated_delta_rule_backward.default"} <= targets
