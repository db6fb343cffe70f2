"""Qwen's vision attention run once per chunk length while capturing (capture/vision_chunks.py):
the tower's outputs and gradients are those of transformers' own chunk-by-chunk attention, on
windows of uneven lengths lying apart and on images of one size side by side; the attention
function is called once per distinct length in a layer, not once per chunk; anything else (a
mask, a tensor of cumulative lengths) runs as given."""
from __future__ import annotations

import copy

import numpy
import pytest
import torch

from megacompile.capture.grid_constants import _vision_tables
from megacompile.capture.vision_chunks import _one_call_per_length, batched_chunks, by_length, chunk_lengths
from megacompile.errors import CaptureError
from tests.vlm_families import VOCAB, qwen3_vl

# Qwen2.5-VL's windows of 2 x 2 merged patches (16 x 16 pixels): an image of 6 x 10 patches (3 x 5
# merged) has windows of 16, 16, 8 / 8, 8, 4 patches; one of 4 x 4 patches a window of 16.
UNEVEN = ((1, 6, 10), (1, 4, 4), (1, 6, 10))


def _qwen2_5_vl(depth: int = 2, full_attention: tuple[int, ...] = (1,), layers: int = 1):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, use_cache=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=16, out_hidden_size=32, fullatt_block_indexes=list(full_attention))
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(text_config=text, vision_config=vision))


def _encode(model, grids, pixels):
    """The tower over its precomputed tables, as the capture hands them (grid_constants.GridTower):
    the cumulative lengths as host arrays of numbers."""
    visual = model.model.visual
    grid = torch.tensor(grids)
    tables = {k: numpy.asarray(v.tolist()) if k.startswith("cu_") else v
              for k, v in _vision_tables(visual, grid).items()}
    return visual(pixels, grid_thw=grid, **tables), tables


def _calls(monkeypatch) -> list[int]:
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, *args, **kwargs):
        calls.append(query.shape[0])
        return sdpa(query, *args, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    return calls


def _lengths(tables: dict, key: str) -> list[int]:
    return chunk_lengths(tables[key])


@pytest.mark.parametrize("make, grids", [(_qwen2_5_vl, UNEVEN),
                                         (qwen3_vl, ((1, 4, 4), (1, 4, 4), (1, 2, 4), (1, 4, 4)))],
                         ids=["qwen2_5_vl-uneven-windows", "qwen3_vl-images-of-one-size"])
def test_the_tower_is_transformers_chunk_by_chunk_with_one_call_per_length(make, grids, monkeypatch):
    model = make().float()
    width = 3 * 2 * 4 * 4
    patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(patches, width, generator=torch.Generator().manual_seed(1))
    calls = _calls(monkeypatch)
    results = []
    for batched in (False, True):
        model.zero_grad()
        given = pixels.clone().requires_grad_(True)
        calls.clear()
        with batched_chunks(model) if batched else torch.enable_grad():
            out, tables = _encode(model, grids, given)
        (out.pooler_output * torch.linspace(-1, 1, out.pooler_output.numel()).view_as(out.pooler_output)).sum() \
            .backward()
        results.append((out.pooler_output.detach(), out.last_hidden_state.detach(), given.grad,
                        {n: p.grad.clone() for n, p in model.model.visual.named_parameters() if p.grad is not None},
                        list(calls)))
    (pooled, hidden, grad, grads, theirs), (pooled2, hidden2, grad2, grads2, ours) = results
    torch.testing.assert_close(pooled2, pooled, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hidden2, hidden, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad2, grad, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads2.keys() and grads
    for name in grads:
        torch.testing.assert_close(grads2[name], grads[name], rtol=1e-5, atol=1e-6)
    # one call per chunk eagerly; here one per distinct length, over all chunks of it
    layers = [("cu_window_seqlens" if "cu_window_seqlens" in tables and i not in
               getattr(model.config.vision_config, "fullatt_block_indexes", ()) else "cu_seqlens")
              for i in range(model.config.vision_config.depth)]
    each = [_lengths(tables, key) for key in layers]
    assert theirs == [1] * sum(len(lengths) for lengths in each)
    assert sorted(ours) == sorted(sum(([lengths.count(n) for n in dict.fromkeys(lengths)] for lengths in each), []))
    assert len(ours) < len(theirs)


def test_a_mask_other_shapes_or_lengths_given_as_a_tensor_run_as_given():
    seen = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        seen.append((tuple(query.shape), attention_mask is not None))
        return query.transpose(1, 2), None
    run = by_length(attention, [2, 3, 2])
    q = torch.randn(1, 2, 7, 4)
    run(None, q, q, q, torch.ones(7, 7, dtype=torch.bool))
    run(None, q[:, :, :6], q[:, :, :6], q[:, :, :6], None)
    assert seen == [((1, 2, 7, 4), True), ((1, 2, 6, 4), False)]
    seen.clear()
    out, _ = run(None, q, q, q, None)
    assert sorted(seen) == [((1, 2, 3, 4), False), ((2, 2, 2, 4), False)]
    assert torch.equal(out, q.transpose(1, 2))          # every position back in its place
    assert chunk_lengths(torch.tensor([0, 4, 6])) is None
    assert chunk_lengths(numpy.array([0, 4, 4, 6])) == [4, 2]      # an empty chunk left out


def test_an_attention_module_that_does_not_call_its_function_once_over_its_patches_is_refused():
    """Handed its patches as one chunk, a module that masks instead (or calls nothing) would attend
    across the chunks: a CaptureError, not a wrong trace."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    class Masking(torch.nn.Module):
        def forward(self, hidden_states, cu_seqlens):
            q = hidden_states.view(1, 1, -1, 4)
            mask = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool)
            return ALL_ATTENTION_FUNCTIONS.get_interface("sdpa", None)(self, q, q, q, mask)[0]

    class Silent(torch.nn.Module):
        def forward(self, hidden_states, cu_seqlens):
            return hidden_states

    h = torch.randn(6, 4)
    for module in (Masking(), Silent()):
        with pytest.raises(CaptureError, match="did not call its attention function once over its patches"):
            _one_call_per_length(module.forward)(h, cu_seqlens=numpy.array([0, 2, 6]))
    assert torch.equal(_one_call_per_length(Silent().forward)(h, cu_seqlens=numpy.array([0, 6])), h)  # one chunk


def test_the_towers_blocks_stay_built_alike_while_their_attention_is_batched():
    """Planning logs few blocks of a group built alike (capture/alike.py): wrapping each attention
    module's forward must not set every block of the tower apart."""
    from megacompile.capture.alike import structure_key
    model = _qwen2_5_vl()
    blocks = model.model.visual.blocks
    config = blocks[0].attn.config
    blocks.append(copy.deepcopy(blocks[0], memo={id(config): config}))      # a third block, on the tower's config
    with batched_chunks(model):
        assert all(type(b.attn).forward is not b.attn.forward for b in blocks)
        keys = [structure_key(b) for b in blocks]
    assert len(set(keys)) == 1


def test_planning_logs_the_first_two_and_the_full_attention_blocks_of_the_tower(monkeypatch):
    """The last block of the tower attends over whole images where the first attends within
    windows: called otherwise, it is logged for itself and does not make planning log every block."""
    import megacompile
    import megacompile.capture.top as top
    model = _qwen2_5_vl(depth=6, full_attention=(2, 5), layers=2).to("meta")
    tower = list(model.model.visual.blocks)
    logged: list[int] = []
    real = top.record

    def counting(block, *a, **k):
        logged.extend(i for i, b in enumerate(tower) if b is block)
        return real(block, *a, **k)
    monkeypatch.setattr(top, "record", counting)
    megacompile.plan(model, 1, batch=1, seq=64, images_per_row=1, image_size=32, hardware="h100")
    assert logged == [0, 1, 2, 5]
