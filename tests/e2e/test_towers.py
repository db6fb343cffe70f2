"""A vision tower's layers stream as blocks of their own templates, beside the decoder's.

The stages run prologue (the tower's patch embedding), the tower's blocks, the bridge (its last
norm, the projector, the token embedding and the merge of the image features), the decoder's
blocks, the epilogue. A tower larger than the budget then trains, its layers fetched, evicted,
offloaded and recomputed like the decoder's, exactly as eagerly (capture/segment.py).
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.errors import CaptureError
from tests.e2e.harness import clone
from tests.e2e.test_vlm import STEPS, assert_parity
from tests.models import hf_llama
from tests.vlm import batch, llava
from tests.vlm_families import qwen2_5_vl, qwen_batch

TOWER = "model.vision_tower.encoder.layers"
DECODER = "model.language_model.layers"


def stage_layout(captured) -> list[str]:
    """Each stage as its kind and, for a block, the list it belongs to."""
    return [st.origin.rsplit(".", 1)[0] if st.template.kind == "block" else st.name for st in captured.stages]


@pytest.mark.slow     # 12 s
def test_a_tower_larger_than_the_budget_streams_its_layers_and_trains_as_eagerly():
    model = llava(tower_width=128, tower_layers=4)
    tower_bytes = 4 * sum(p.numel() for p in model.model.vision_tower.encoder.layers.parameters())
    assert tower_bytes > 4 * sum(p.numel() for p in model.model.language_model.layers.parameters())
    plan = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu").prepare(**batch())
    captured = plan.captured
    assert stage_layout(captured) == ["prologue"] + [TOWER] * 4 + ["bridge"] + [DECODER] * 8 + ["epilogue"]
    assert captured.towers == (TOWER,) and captured.block_path == DECODER
    tower_templates = {id(st.template) for st in captured.stages if st.origin.startswith(TOWER + ".")}
    decoder_templates = {id(st.template) for st in captured.stages if st.origin.startswith(DECODER + ".")}
    assert len(tower_templates) == 1 and len(decoder_templates) == 1 and not tower_templates & decoder_templates
    assert f"8 blocks of {DECODER} and 4 of {TOWER}" in plan.summary()
    # The smallest budget holds less than the tower's weights: its layers come and go.
    assert plan.minimum_budget_bytes < tower_bytes
    assert_parity(model, [batch(seed=i) for i in range(STEPS)], smallest_only=True)


def test_a_tower_layer_whose_output_nothing_reads_is_no_stage_and_keeps_its_weights():
    """LLaVA-1.5 projects the second-to-last tower layer's output: the last layer runs for nothing
    eagerly and gets no gradient, so torch.optim.AdamW leaves it as it was; capture drops it."""
    model = llava(feature_layer=-2)
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    captured = engine.prepare(**batch()).captured
    assert [st.origin for st in captured.stages if st.origin.startswith(TOWER)] == [f"{TOWER}.0"]
    last = {n: t.clone() for n, t in model.state_dict().items() if n.startswith(f"{TOWER}.1.")}
    assert_parity(model, [batch(seed=i) for i in range(STEPS)], weights=2.0, then_smallest=False)
    engine.step(**batch())
    engine.synchronize()
    state = engine.state_dict()
    assert all(torch.equal(state[n], t) for n, t in last.items())


@pytest.mark.long   # the LLaVA tower above is the slow tier's; this one trains a Qwen2.5-VL: 20-35 s
def test_windowed_and_full_attention_tower_layers_run_two_templates():
    """Qwen2.5-VL's windowed layers split their attention by the windows' lengths, its full ones
    by the images': arrays of numbers handed to each layer, compared by value, so the layers of
    each kind share one template however deep the tower is."""
    model = qwen2_5_vl(depth=4, full_attention=(1, 3))
    batches = [qwen_batch(seed=i) for i in range(STEPS)]
    captured = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu").prepare(**batches[0]).captured
    tower = [st for st in captured.stages if st.origin.startswith("model.visual.blocks.")]
    assert len(tower) == 4
    assert tower[0].template is tower[2].template and tower[1].template is tower[3].template
    assert tower[0].template is not tower[1].template
    assert_parity(model, batches, smallest_only=True)


def test_a_forward_hook_on_a_block_runs_once_as_eagerly():
    """The block's own hooks run around its call in the top-level trace, not in its template: a
    hook that shifts the last block's output is applied once, as eagerly. On a block in the middle
    its ops would run between two blocks: refused, by name."""
    torch.manual_seed(0)
    model = hf_llama(layers=4)

    def shift(module, args, output):
        return output + 0.5 if isinstance(output, torch.Tensor) else (output[0] + 0.5, *output[1:])
    hook = model.model.layers[3].register_forward_hook(shift)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(input_ids=ids, labels=ids).loss.item()
    assert expected != pytest.approx(_unhooked(model, ids), rel=1e-3)      # the hook changes the step
    engine = megacompile.compile(clone(model), hbm_budget=1.0, device="cpu")
    assert engine.step(input_ids=ids, labels=ids) == pytest.approx(expected, rel=1e-5)
    hook.remove()
    model.model.layers[1].register_forward_hook(shift)
    with pytest.raises(CaptureError, match="computed between two blocks of one stack"):
        megacompile.compile(model, hbm_budget=1.0, device="cpu").step(input_ids=ids, labels=ids)


def _unhooked(model, ids) -> float:
    plain = clone(model)
    for layer in plain.model.layers:
        layer._forward_hooks.clear()
    return plain(input_ids=ids, labels=ids).loss.item()


def test_a_deep_tower_plans_the_text_path_without_images():
    """Planning logs a few blocks of each group built alike (capture/alike.py) and checks the
    others against them; a tower the model does not call, given no image, checks nothing."""
    with torch.device("meta"):
        model = llava(tower_layers=6)
    plan = megacompile.plan(model, batch=2, seq=40, hbm_budget=1.0)
    assert stage_layout(plan.captured) == ["prologue"] + [DECODER] * 8 + ["epilogue"]
