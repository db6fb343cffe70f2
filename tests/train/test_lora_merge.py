"""methods.merged, the merge a reward model's export uses, is PEFT's merge_and_unload: on Linear
weights held (out, in) and on GPT-2's Conv1D weights held (in, out), with LoRA and with DoRA."""
from __future__ import annotations

import pytest
import torch

from megacompile.train.methods import merged, scaling, transposed


def _gpt2(dora: bool):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=32, n_layer=2, n_head=4, n_positions=32))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                        use_dora=dora)
    model = get_peft_model(base, config)
    with torch.no_grad():       # B starts at zero: trained adapters and magnitudes moved off their start
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model, config


@pytest.mark.parametrize("dora", [False, True])
def test_merged_is_peft_merge_on_conv1d_weights(dora):
    model, config = _gpt2(dora)
    flipped = transposed(model.base_model.model)
    assert "transformer.h.0.attn.c_proj" in flipped and len(flipped) == 8      # c_attn, attn and mlp c_proj, c_fc
    ours = merged(model.base_model.model.state_dict(), scaling(config), flipped)
    theirs = model.merge_and_unload().state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert ours[name].shape == t.shape, name
        assert (ours[name] - t).abs().max() <= 1e-5 * t.abs().max(), name


def test_without_the_transposed_layers_a_square_conv1d_merge_is_wrong():
    """What the names are for: attn.c_proj is square, so B A adds without a shape error, transposed."""
    model, config = _gpt2(False)
    state = model.base_model.model.state_dict()
    flat = {k: v for k, v in state.items() if "c_proj" in k and ".attn." in k}
    ours = merged(flat, scaling(config))
    theirs = model.merge_and_unload().state_dict()
    name = "transformer.h.0.attn.c_proj.weight"
    assert (ours[name] - theirs[name]).abs().max() > 1e-3 * theirs[name].abs().max()
