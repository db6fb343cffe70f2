"""finetuning_type lora on a vision-language model, as LlamaFactory's LoRA chooses its modules:
with freeze_vision_tower false the tower's Linear modules take adapters too (`lora_target: all`
adds their names, LlamaFactory's find_all_linear_modules), and they train; the projector takes
adapters only where freeze_multi_modal_projector is false and lora_target names its modules (`all`
leaves it out); freeze_language_model true leaves the language model without. The adapter exports
(io/lora_save.py) load with PEFT and merge into the tower's weights."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import megacompile
from megacompile.errors import ArgumentError
from megacompile.train.methods import vision_freeze
from tests import vlm
from tests.vlm_families import model as family_model
from tests.vlm_families import qwen_batch

peft = pytest.importorskip("peft")

TOWER, PROJECTOR, LANGUAGE = vision_freeze.KEYS


def _keys(**given) -> SimpleNamespace:
    return SimpleNamespace(**{k: given.get(k) for k in vision_freeze.KEYS})


def _wrapped(model, target, **keys):
    from megacompile.train.methods.lora import with_adapters
    return with_adapters(model, 2, 4.0, 0.0, target, parts=vision_freeze.adapted(_keys(**keys)))


def _adapted(wrapped) -> set[str]:
    """The modules holding adapters, by their names in the base model."""
    return {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}


def test_an_unfrozen_tower_takes_adapters_on_every_linear_and_the_merger_none():
    """`all` adds the tower's Linear names (qkv, proj, gate_proj, up_proj, down_proj): every tower
    module of those names takes adapters, as PEFT matches them (the patch embedding's Conv3d `proj`
    too, as under LlamaFactory), the merger none."""
    base = family_model("qwen2_5_vl")
    names = {n.rsplit(".", 1)[-1] for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)
             and ".visual.blocks." in n}
    assert names == {"qkv", "proj", "gate_proj", "up_proj", "down_proj"}
    tower = {n for n, _ in base.named_modules() if ".visual." in n and ".merger." not in n
             and n.rsplit(".", 1)[-1] in names}
    assert "model.visual.patch_embed.proj" in tower
    decoder = {n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear) and ".language_model." in n}
    assert _adapted(_wrapped(family_model("qwen2_5_vl"), "all")) == decoder      # the default: the decoder's alone
    for projector in (None, True, False):       # `all` leaves the merger out whatever its key says
        wrapped = _wrapped(family_model("qwen2_5_vl"), "all", freeze_vision_tower=False,
                           freeze_multi_modal_projector=projector)
        assert _adapted(wrapped) == tower | decoder
    # named: the tower's modules of those names beside the decoder's; the tower alone without the decoder
    named = _adapted(_wrapped(family_model("qwen2_5_vl"), ["gate_proj", "qkv"], freeze_vision_tower=False))
    assert named == {n for n in tower | decoder if n.endswith((".gate_proj", ".qkv"))}
    alone = _adapted(_wrapped(family_model("qwen2_5_vl"), "all", freeze_vision_tower=False, freeze_language_model=True))
    assert alone == tower


def test_the_projector_takes_adapters_where_its_key_is_false_and_lora_target_names_it():
    """LLaVA's projector is linear_1 and linear_2: named in lora_target, they take adapters with
    freeze_multi_modal_projector false, as LlamaFactory's patch_target_modules keeps them; not otherwise."""
    target = ["q_proj", "linear_1"]
    projector = {"model.multi_modal_projector.linear_1"}
    free = _adapted(_wrapped(vlm.llava(), target, freeze_multi_modal_projector=False))
    assert projector <= free and not any(".vision_tower." in n for n in free)
    for keys in ({}, {"freeze_multi_modal_projector": True}):
        assert not projector & _adapted(_wrapped(vlm.llava(), target, **keys))
    assert projector == _adapted(_wrapped(vlm.llava(), ["linear_1"], freeze_multi_modal_projector=False,
                                          freeze_language_model=True))


def test_no_part_left_to_adapt_is_refused_naming_the_keys():
    with pytest.raises(ArgumentError, match=r"freeze_language_model: true under finetuning_type lora leaves no part "
                                            r"to put adapters on: set freeze_vision_tower: false"):
        vision_freeze.check(_keys(freeze_language_model=True), adapters=True)
    with pytest.raises(ArgumentError, match=r"lora_target: linear_1 name no Linear module of the language model and "
                                            r"the vision tower, the parts that take adapters here"):
        _wrapped(vlm.llava(), ["linear_1"], freeze_vision_tower=False)


@pytest.mark.slow   # 6-20 s: a capture of the tower with adapters, two steps, two exports
def test_the_towers_adapters_train_and_export_with_peft_and_merged(tmp_path):
    """Two steps of a tiny Qwen2.5-VL with images, adapters on its tower and decoder: the tower's
    adapters move (their B starts at zero); the adapter save_pretrained writes loads with PEFT,
    holding the engine's masters, and the merged model gives the loaded adapter's loss, its tower's
    weights the base's plus the adapters'."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    wrapped = _wrapped(family_model("qwen2_5_vl"), "all", freeze_vision_tower=False)
    engine = megacompile.compile(wrapped, 2.0, device="cpu", optimizer=megacompile.AdamW(lr=1e-2))
    try:
        for seed in range(2):
            engine.step(**qwen_batch(seed, (1, 2)))
        trained = {k.removeprefix("base_model.model."): t for k, t in engine.state_dict().items() if ".lora_" in k}
        tower_b = [k for k in trained if ".visual." in k and ".lora_B." in k]
        assert tower_b and all(trained[k].abs().max() > 0 for k in tower_b)
        engine.save_pretrained(tmp_path / "adapter")
        engine.save_pretrained(tmp_path / "merged", merge_adapter=True)
    finally:
        engine.close()
    loaded = peft.PeftModel.from_pretrained(family_model("qwen2_5_vl"), str(tmp_path / "adapter"))
    assert _adapted(loaded) == _adapted(wrapped)
    held = {n.removeprefix("base_model.model.").replace(".default.", "."): p
            for n, p in loaded.named_parameters() if ".lora_" in n}
    assert held.keys() == {k.replace(".default.", ".") for k in trained}
    assert all(torch.equal(held[k.replace(".default.", ".")], t) for k, t in trained.items())
    merged = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(tmp_path / "merged"))
    qkv = "model.visual.blocks.0.attn.qkv.weight"
    start = dict(family_model("qwen2_5_vl").named_parameters())[qkv]
    assert not torch.equal(dict(merged.named_parameters())[qkv], start)
    batch = qwen_batch(5, (1, 2))
    with torch.no_grad():
        assert merged(**batch).loss.item() == pytest.approx(loaded(**batch).loss.item(), abs=1e-5)
