"""finetuning_type: freeze trains the parameters LlamaFactory's _setup_freeze_tuning trains: each
freeze_* name matched as a substring of the parameter names (`norm` trains every block's norms, the
frozen blocks' too), its names checked as LlamaFactory checks them, and what the substring rule
trains beyond the named modules said in a note. The expected sets come from `their_rule` below, the
rule of LlamaFactory's _setup_freeze_tuning written out on its own, not megacompile's code."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, LlavaConfig, LlavaForConditionalGeneration, Qwen3Config

from megacompile.errors import ArgumentError
from megacompile.train.methods.freeze import freeze

SMALL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
             head_dim=8, tie_word_embeddings=False)


def _qwen3(layers: int = 4):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(Qwen3Config(num_hidden_layers=layers, **SMALL))


class _Experts(nn.Module):
    """A mixture-of-experts model whose experts are a numbered list (as transformers' older MoE
    models and many remote-code ones hold them): model.layers.N.mlp.experts.M.down_proj."""

    def __init__(self, layers: int = 4, experts: int = 4):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=layers)
        block = lambda: nn.ModuleDict(dict(  # noqa: E731
            self_attn=nn.ModuleDict(dict(q_proj=nn.Linear(2, 2, bias=False))),
            mlp=nn.ModuleDict(dict(experts=nn.ModuleList(nn.ModuleDict(dict(down_proj=nn.Linear(2, 2, bias=False)))
                                                         for _ in range(experts))))))
        self.model = nn.ModuleDict(dict(embed_tokens=nn.Embedding(4, 2),
                                        layers=nn.ModuleList(block() for _ in range(layers)), norm=nn.LayerNorm(2)))


def their_rule(model, layers: int, modules: str, extra: str | None, forbidden=(), projector=()) -> set[str]:
    """The names LlamaFactory's freeze tuning leaves trainable, by its rule."""
    names = [n for n, _ in model.named_parameters()]
    config = getattr(model.config, "text_config", model.config)
    num_layers = config.num_hidden_layers
    if layers > 0:
        ids = range(max(0, num_layers - layers), num_layers)
    else:
        ids = range(min(-layers, num_layers))
    hidden, non_hidden = set(), set()
    for name in names:
        if ".0." in name:
            hidden.add(name.split(".0.")[-1].split(".")[0])
        elif ".1." in name:
            hidden.add(name.split(".1.")[-1].split(".")[0])
        if re.search(r"\.\d+\.", name) is None:
            non_hidden.add(name.split(".")[-2])
    trainable_layers = []
    for module_name in [m.strip() for m in modules.split(",")]:
        assert module_name == "all" or module_name in hidden, module_name
        for idx in ids:
            trainable_layers.append(".{:d}.{}".format(idx, module_name if module_name != "all" else ""))
    for module_name in ([m.strip() for m in extra.split(",")] if extra else []):
        assert module_name in non_hidden, module_name
        trainable_layers.append(module_name)
    trainable_layers.extend(projector)
    return {n for n in names if any(t in n for t in trainable_layers) and not any(f in n for f in forbidden)}


def _trained(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def _split(value):
    return "all" if value == "all" else [m.strip() for m in value.split(",")]


@pytest.mark.parametrize("layers, modules, extra", [
    (2, "all", "embed_tokens,norm"),
    (-1, "all", "norm"),
    (2, "self_attn", "lm_head"),
    (1, "mlp,input_layernorm", None),
    (-3, "self_attn", "embed_tokens"),
    (4, "all", None),
])
def test_freeze_trains_what_llamafactory_trains_on_a_tiny_qwen3(layers, modules, extra):
    model = _qwen3()
    freeze(model, layers, _split(modules), _split(extra) if extra else [])
    assert _trained(model) == their_rule(model, layers, modules, extra)


def test_norm_trains_every_norm_as_in_llamafactory_and_a_note_says_so():
    model = _qwen3()
    notes = freeze(model, 2, "all", ["embed_tokens", "norm"])
    trained = _trained(model)
    for i in (0, 1):          # the frozen blocks' norms train too
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            assert f"model.layers.{i}.{norm}.weight" in trained
        assert f"model.layers.{i}.self_attn.q_proj.weight" not in trained
    assert {"model.norm.weight", "model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight"} <= trained
    assert "lm_head.weight" not in trained
    said = [n for n in notes if "freeze_extra_modules norm" in n]
    assert len(said) == 1 and "8 besides norm's own" in said[0] and "model.layers.0.input_layernorm.weight" in said[0]
    assert "a path (model.norm)" in said[0]            # the path that names the final norm alone

    alone = _qwen3()
    assert any("LlamaFactory refuses" in n for n in freeze(alone, 2, "all", ["model.norm"]))
    assert {n for n in _trained(alone) if ".layers." not in n} == {"model.norm.weight"}


def test_the_layer_patterns_reach_numbered_experts_as_in_llamafactory_and_a_note_says_so():
    model = _Experts()
    assert not freeze(model, 1, ["self_attn"], [])
    assert _trained(model) == their_rule(model, 1, "self_attn", None) == {"model.layers.3.self_attn.q_proj.weight"}
    notes = freeze(model, 2, "all", [])
    assert _trained(model) == their_rule(model, 2, "all", None)
    beyond = {n for n in _trained(model) if not re.match(r"model\.layers\.[23]\.", n)}
    assert beyond == {f"model.layers.{i}.mlp.experts.{j}.down_proj.weight" for i in (0, 1) for j in (2, 3)}
    said = [n for n in notes if "freeze_trainable_layers 2" in n]
    assert len(said) == 1 and "4 parameters outside the chosen blocks' modules" in said[0]


def test_names_llamafactory_refuses_are_refused_naming_the_ones_it_takes():
    with pytest.raises(ArgumentError, match=r"freeze_extra_modules: layers names no parameter of Qwen3ForCausalLM "
                                            r"outside its decoder blocks; modules outside the blocks are "
                                            r"embed_tokens, lm_head, norm"):
        freeze(_qwen3(), 2, "all", ["layers"])
    with pytest.raises(ArgumentError, match="freeze_trainable_modules: q_norm names no parameter of the decoder "
                                            "blocks; their modules are input_layernorm, mlp, post_attention_layernorm, "
                                            "self_attn"):
        freeze(_qwen3(), 2, ["q_norm"], [])
    with pytest.raises(ArgumentError, match="freeze_trainable_layers 5: Qwen3ForCausalLM has 4 decoder blocks"):
        freeze(_qwen3(), 5, "all", [])


def test_a_vision_language_model_keeps_its_tower_frozen_unless_told_as_llamafactory_does():
    config = LlavaConfig(vision_config=dict(model_type="clip_vision_model", hidden_size=16, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4),
                         text_config=dict(model_type="qwen3", num_hidden_layers=2, **SMALL), image_token_index=3)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    tower, proj = ["vision_tower"], ["multi_modal_projector"]
    freeze(model, 1, "all", ["norm"])        # LlamaFactory's defaults: tower and projector frozen
    assert _trained(model) == their_rule(model, 1, "all", "norm", forbidden=tower + proj)
    assert not any("vision_tower" in n for n in _trained(model))
    freeze(model, 1, "all", ["norm"], tower=False, projector=False)
    assert _trained(model) == their_rule(model, 1, "all", "norm", projector=proj)
    assert any("vision_tower" in n for n in _trained(model))
    assert any("multi_modal_projector" in n for n in _trained(model))
