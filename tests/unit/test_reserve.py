"""The device reserve: what a plan for a real GPU keeps free for memory its ledger cannot see."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megacompile
from megacompile.cost import get_profile
from megacompile.cost.hardware import replace
from megacompile.cost.reserve import attention_backward_scratch

GiB, MiB = 2 ** 30, 2 ** 20
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256}
# A vocabulary small enough that attention's backward, not the embedding's, is the largest scratch (the
# embedding's backward holds a float32 partial per token row, as large as attention's dq accumulator).
ATTENTION_FIRST = dict(LLAMA, vocab_size=32)


def test_flash_attention_backward_reserves_its_fp32_dq_accumulator():
    """16 x 4096 tokens, 40 heads of 128: a float32 dq is 1.25 GiB, plus one float per query row."""
    query = torch.empty(16, 40, 4096, 128, dtype=torch.bfloat16, device="meta")
    node = SimpleNamespace(op="call_function", target="aten._scaled_dot_product_flash_attention_backward.default",
                           args=(None, SimpleNamespace(meta={"val": query})))
    assert attention_backward_scratch(node) == int(1.25 * GiB) + 16 * 40 * 4096 * 4
    node.target = "aten.mm.default"
    assert attention_backward_scratch(node) == 0


def test_flash_attention_backward_under_gqa_reserves_its_per_query_head_dk_and_dv():
    """Qwen2.5-14B's heads (40 for queries, 8 for keys and values, 128 wide), 4 x 4096 tokens: FlashAttention-2's
    backward makes dk and dv for all 40 heads before it sums each group of 5: 160 MiB each in bf16."""
    def node(target, heads=40, kv_heads=8, layout=lambda h: (4, h, 4096, 128)):
        val = [SimpleNamespace(meta={"val": torch.empty(layout(h), dtype=torch.bfloat16, device="meta")})
               for h in (heads, heads, kv_heads, kv_heads)]
        return SimpleNamespace(op="call_function", target=target, args=tuple(val))
    accumulator = 4 * 40 * 4096 * 128 * 4 + 4 * 40 * 4096 * 4
    expanded = 2 * 4 * 4096 * 40 * 128 * 2
    assert expanded == 320 * MiB
    for target in ("aten._scaled_dot_product_flash_attention_backward.default",
                   "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"):
        assert attention_backward_scratch(node(target)) == accumulator + expanded
        assert attention_backward_scratch(node(target, kv_heads=40)) == accumulator     # MHA: none
    packed = node("aten._flash_attention_backward.default", layout=lambda h: (4 * 4096, h, 128))
    assert attention_backward_scratch(packed) == accumulator + expanded
    # the memory-efficient kernel takes no GQA (SDPA repeats the heads before it): the accumulator alone
    assert attention_backward_scratch(node("aten._scaled_dot_product_efficient_attention_backward.default",
                                           kv_heads=40)) == accumulator


def test_a_gqa_plan_reserves_more_than_the_same_model_with_a_head_per_query():
    """Unfused, torch's flash ops run attention (fused, kernels/attention.py does: the next test)."""
    mha = megacompile.plan(dict(ATTENTION_FIRST, num_key_value_heads=4), 1.0, hardware="h100", batch=2, seq=64, fuse=False)
    gqa = megacompile.plan(ATTENTION_FIRST, 1.0, hardware="h100", batch=2, seq=64, fuse=False)
    query = 2 * 64 * 128 * 2       # [B, H, S, D] bf16 bytes of the query (4 heads of 32)
    # dk and dv expanded to the query's heads, less the half-size dk and dv it returns (copied in)
    assert gqa.reserve.scratch_bytes - mha.reserve.scratch_bytes == 2 * query - 2 * query // 2


def test_a_fused_plan_reserves_no_attention_scratch_and_places_the_kernels_temporary():
    """Fused, attention writes its results into the arena and its backward's one temporary (delta,
    a float per query row) is a planned result: nothing of attention is left to the reserve, GQA or
    not, and the arena holds what the unfused plan reserved less the copies and accumulators."""
    for config in (ATTENTION_FIRST, dict(ATTENTION_FIRST, num_key_value_heads=4)):
        fused = megacompile.plan(config, 1.0, hardware="h100", batch=2, seq=64)
        unfused = megacompile.plan(config, 1.0, hardware="h100", batch=2, seq=64, fuse=False)
        assert "attention" not in fused.reserve.scratch_op and "attention" in unfused.reserve.scratch_op
        assert fused.reserve.scratch_bytes < unfused.reserve.scratch_bytes
        block = next(s.template for s in fused.captured.stages if s.template.kind == "block")
        kernel, = [n for n in block.backward.gm.graph.nodes if n.meta.get("kernel") == "attention_backward"]
        delta = kernel.meta["val"][3]
        assert delta.dtype == torch.float32 and tuple(delta.shape) == (2, 4, 64)
        assert fused.minimum_budget_bytes < unfused.minimum_budget_bytes


def test_a_gpu_plan_keeps_the_reserve_free_and_says_so():
    h100 = get_profile("h100")
    plan = megacompile.plan(ATTENTION_FIRST, 1.0, hardware=h100, batch=2, seq=64, fuse=False)
    r = plan.reserve
    assert r.workspace_bytes == h100.workspace_bytes
    # the caching allocator serves only what the arena does not hold: its share is of those bytes
    assert r.fragmentation_bytes == int(h100.fragmentation * (r.workspace_bytes + r.scratch_bytes))
    assert plan.arena.size + r.workspace_bytes + r.scratch_bytes <= plan.budget_bytes
    assert r.scratch_bytes > 0 and "attention" in r.scratch_op
    assert plan.predicted_peak_bytes + r.total <= plan.budget_bytes
    assert plan.to_json()["reserve_bytes"] == r.total
    line, = [x for x in plan.summary().splitlines() if x.lstrip("# ").startswith("reserve")]
    assert "5% of what the caching allocator still serves beside the arena" in line and "of the budget;" not in line
    # the smallest fit includes the reserve: planning there succeeds, just below it fails
    smallest = megacompile.plan(ATTENTION_FIRST, plan.minimum_budget_bytes / GiB, hardware=h100, batch=2, seq=64, fuse=False)
    assert smallest.fits and smallest.predicted_peak_bytes + smallest.reserve.total <= smallest.budget_bytes
    with pytest.raises(megacompile.BudgetTooSmallError, match="device reserve"):
        megacompile.plan(ATTENTION_FIRST, plan.minimum_budget_bytes * 0.99 / GiB, hardware=h100, batch=2, seq=64, fuse=False)


def test_the_reserve_is_calibratable_and_the_simulated_device_has_none():
    h100 = get_profile("h100")
    bigger = replace(h100, workspace_bytes=256 * MiB, fragmentation=0.1)
    base = megacompile.plan(LLAMA, 1.0, hardware=h100, batch=2, seq=64)
    more = megacompile.plan(LLAMA, 1.0, hardware=bigger, batch=2, seq=64)
    scratch = base.reserve.scratch_bytes
    assert more.reserve.total - base.reserve.total == (192 * MiB + int(0.1 * (256 * MiB + scratch))
                                                       - int(0.05 * (64 * MiB + scratch)))
    assert more.minimum_budget_bytes > base.minimum_budget_bytes
    simulated = megacompile.plan(LLAMA, 1.0, hardware="cpu", batch=2, seq=64)
    assert simulated.reserve.total == 0


def test_an_out_form_torch_generates_is_told_from_one_with_a_kernel_of_its_own():
    """An autogen out= form runs the op and copies its result in: the result is allocated beside out."""
    from megacompile.ir.stage_ops import allocates_inside
    aten = torch.ops.aten
    for overload in (aten.embedding_dense_backward.out, aten.clone.out, aten.native_layer_norm_backward.out,
                     aten.masked_fill.Scalar_out):
        assert allocates_inside(overload), overload
    for overload in (aten.mm.out, aten.silu_backward.grad_input, aten.nll_loss_backward.grad_input, aten.add.out,
                     aten._log_softmax_backward_data.out):
        assert not allocates_inside(overload), overload


def test_a_tied_embeddings_backward_is_reserved_as_the_scratch_it_allocates():
    """embedding_dense_backward.out allocates the whole [vocab, hidden] gradient and copies it in (on the
    H100 a 3B model's 752 MiB of it ran out of the smallest budget): the reserve holds it."""
    vocab, hidden = 8192, 128
    config = dict(LLAMA, vocab_size=vocab, tie_word_embeddings=True)
    plan = megacompile.plan(config, 1.0, hardware="h100", batch=2, seq=64, fuse=False)
    assert plan.reserve.scratch_bytes >= vocab * hidden * 2
    assert "embedding_dense_backward" in plan.reserve.scratch_op
    # Fused, the kernel (kernels/embedding.py) writes the gradient into the arena: no such scratch.
    fused = megacompile.plan(config, 1.0, hardware="h100", batch=2, seq=64)
    assert "embedding_dense_backward" not in fused.reserve.scratch_op
    assert fused.reserve.scratch_bytes < vocab * hidden * 2 and fused.minimum_budget_bytes < plan.minimum_budget_bytes


def test_an_embeddings_backward_reserves_its_float32_partial_sums_and_index_arrays_beside_its_result():
    """ATen's CUDA embedding backward sums each token row's gradient into a float32 partial before it
    scatters them into the [vocab, hidden] result: 8192 tokens 3072 wide hold 96 MiB more."""
    from megacompile.cost.reserve import embedding_backward_scratch
    grad = SimpleNamespace(meta={"val": torch.empty(4, 2048, 3072, dtype=torch.bfloat16, device="meta")})
    ids = SimpleNamespace(meta={"val": torch.empty(4, 2048, dtype=torch.int64, device="meta")})
    node = SimpleNamespace(op="call_function", target="aten.embedding_dense_backward.default",
                           args=(grad, ids, 128256, -1, False))
    assert embedding_backward_scratch(node) == 8192 * 3072 * 4 + 7 * 8192 * 8
    node.target = "aten.mm.default"
    assert embedding_backward_scratch(node) == 0
    vocab, hidden, tokens = 8192, 128, 2 * 64
    plan = megacompile.plan(dict(LLAMA, vocab_size=vocab), 1.0, hardware="h100", batch=2, seq=64, fuse=False)
    assert plan.reserve.scratch_bytes >= vocab * hidden * 2 + tokens * hidden * 4 + 7 * tokens * 8
    # The fused kernel's node: its sorted ids beside the arena, nothing of [N, H].
    from megacompile.fusion.launchers import embedding_bwd
    node.target = embedding_bwd
    assert embedding_backward_scratch(node) == 4 * 8192 * 8


def test_an_embeddings_lookup_is_made_in_its_arena_tensor_through_index_select():
    """embedding.out is generated (it would allocate the [tokens, H] rows and copy them in: 4 GiB at
    512k tokens 4096 wide); index_select.out gathers straight into the arena's tensor, the same values."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from megacompile.ir.stage_ops import copied_result_bytes, in_place_form
    weight, ids = torch.randn(11, 6), torch.randint(0, 11, (2, 5))
    node = next(n for n in make_fx(lambda i, w: torch.nn.functional.embedding(i, w), tracing_mode="fake")(
        ids, weight).graph.nodes if n.op == "call_function")
    assert node.target is torch.ops.aten.embedding.default and copied_result_bytes(node) == 0
    slot = torch.full((2, 5, 6), 9.0)
    in_place_form(node)(slot, (weight, ids), {})
    assert torch.equal(slot, torch.nn.functional.embedding(ids, weight))
    fused = megacompile.plan(dict(LLAMA, vocab_size=8192), 1.0, hardware="h100", batch=2, seq=64)
    assert "aten.embedding" not in fused.reserve.scratch_op     # at most the backward kernel's sorted ids
    assert fused.reserve.scratch_bytes <= 4 * 2 * 64 * 8 + 64 + 2 * 64 * 128 * 2


def test_a_clone_and_a_slices_backward_are_made_in_their_arena_tensors():
    """Both out= forms are generated (clone.out clones, then copies: 128 MiB beside the arena at the
    Llama-2-7B shape's 4 x 4096 tokens); made in place, they hold nothing beside it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from megacompile.ir.stage_ops import copied_result_bytes, in_place_form
    x, g = torch.randn(4, 9).t(), torch.randn(3, 5)

    def ops(x, g):
        return (torch.ops.aten.clone.default(x), torch.ops.aten.slice_backward.default(g, [7, 5], 0, 2, 5, 1),
                torch.ops.aten.slice_backward.default(g, [3, 12], 1, -9, 2 ** 62, 2)[..., :5])
    nodes = [n for n in make_fx(ops, tracing_mode="fake")(x, g).graph.nodes if n.op == "call_function"
             and n.target in (torch.ops.aten.clone.default, torch.ops.aten.slice_backward.default)]
    assert len(nodes) == 3
    for node in nodes:
        assert copied_result_bytes(node) == 0
        args = tuple({"x_1": x, "g_1": g}.get(getattr(a, "name", None), a) for a in node.args)
        meta = node.meta["val"]
        slot = torch.full_like(torch.empty_strided(meta.shape, meta.stride()), 9.0)
        in_place_form(node)(slot, args, {})
        assert torch.equal(slot, node.target(*args))
