"""The bound of what transformers' generate holds besides the copy and its cache
(cost/generation_memory.py) holds: the copy's generate, as HFGenerator calls it, is run under a
dispatch mode that counts the live storages its ops make (tests/posttrain/live_bytes.py); its peak
less the key-value cache stays under the bound and within 25% of it, over dense and mixture-of-
experts configs, prefill-bound (whole and in chunks) and sampling-bound shapes, bfloat16 and
float32; prompts with images, prefilled whole, under the bound and above half of it (the tower's pass
or the decoder's prefill dominating). A chunked prefill gives the completions of a whole one. A run
counts the bound beside the copy (train/beside.py) and so does the stage's plan
(planner/posttrain_step.py)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from megacompile import AdamW, compile
from megacompile.cost import generation_memory
from megacompile.cost.generation_memory import generate_transient_bytes
from megacompile.posttrain import GRPOLoss, GRPOObjective
from megacompile.posttrain.hf_generator import HFGenerator
from megacompile.posttrain.sampling_filters import Filters
from tests.posttrain.live_bytes import PeakLiveBytes

EVERY_FILTER = Filters(top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1)


def _dense(vocab, hidden, intermediate):
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        use_cache=False))


def _moe(k, expert):
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=128, moe_intermediate_size=expert,
        shared_expert_intermediate_size=256, num_experts=8, num_experts_per_tok=k, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False))


CASES = {   # name: (policy, rows of prompts, prompt length, copy dtype)
    "dense-prefill": (lambda: _dense(512, 256, 1024), 8, 192, torch.bfloat16),
    "dense-sampling": (lambda: _dense(32000, 64, 128), 8, 32, torch.bfloat16),
    "dense-float32": (lambda: _dense(512, 128, 512), 4, 128, torch.float32),
    "dense-chunked": (lambda: _dense(512, 128, 512), 4, 2048, torch.bfloat16),        # 2 chunks of 1024
    "moe": (lambda: _moe(4, 256), 8, 128, torch.bfloat16),
}


def _engine(policy):
    return compile(GRPOObjective(policy, GRPOLoss()), hbm_budget=0.05, device="cpu", compute_dtype=torch.float32,
                   optimizer=AdamW(lr=1e-3))


def _prompts(rows, prompt):
    """Half the rows left-padded to half the width: the attention mask is made."""
    return [[3 + (r * 7 + i) % 500 for i in range(prompt if r % 2 else prompt // 2)] for r in range(rows)]


@pytest.mark.parametrize("case", list(CASES))
def test_what_generate_holds_besides_the_copy_and_its_cache_stays_within_the_bound(case):
    build, rows, prompt, dtype = CASES[case]
    torch.manual_seed(0)
    policy = build()
    engine = _engine(policy)
    copy = HFGenerator(engine, eos_id=None, seed=0, dtype=dtype, filters=EVERY_FILTER)
    prompts = _prompts(rows, prompt)
    new = 4
    weights = list(copy.model.parameters()) + list(copy.model.buffers())
    with PeakLiveBytes(existing=weights) as seen:
        copy.generate(prompts, 1, new, temperature=1.0)
    text = policy.config
    head = text.hidden_size // text.num_attention_heads
    cache = rows * (prompt + new) * 2 * text.num_hidden_layers * text.num_key_value_heads * head * dtype.itemsize
    bound = generate_transient_bytes(text, rows, prompt, dtype.itemsize)
    measured = seen.peak - cache
    assert 0.75 * bound <= measured <= bound, (measured, bound)
    engine.close()


def test_a_prefill_in_chunks_gives_the_completions_of_a_whole_one(monkeypatch):
    torch.manual_seed(0)
    engine = _engine(_dense(512, 64, 128))
    copy = HFGenerator(engine, eos_id=None, seed=0, dtype=torch.float32)
    prompts = _prompts(4, 96)
    whole = copy.generate(prompts, 1, 6, temperature=0)
    monkeypatch.setattr(generation_memory, "PREFILL_TOKENS", 4 * 20)      # 5 chunks of 20 positions
    assert generation_memory.prefill_chunk(4) == 20
    assert copy.generate(prompts, 1, 6, temperature=0) == whole
    engine.close()


@pytest.mark.parametrize("rows,tokens,dtype", [(16, 128, torch.bfloat16), (4, 512, torch.bfloat16),
                                               (8, 256, torch.float32)])
def test_what_a_reward_models_forward_passes_through_stays_within_the_bound(rows, tokens, dtype):
    """A reward model scores a batch of right-padded completions in one forward (posttrain/
    reward_models.py): the prefill's bound, forward_transient_bytes, holds it too."""
    from transformers import LlamaForSequenceClassification
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    scorer = LlamaForSequenceClassification(config).to(dtype).eval()
    ids = torch.randint(3, 512, (rows, tokens))
    mask = torch.ones_like(ids)
    mask[::2, tokens // 2:] = 0                 # every other completion half as long: padded on the right
    with torch.inference_mode(), PeakLiveBytes(existing=list(scorer.parameters()) + list(scorer.buffers())) as seen:
        scorer(input_ids=ids, attention_mask=mask)
    bound = generation_memory.forward_transient_bytes(config, rows, tokens, dtype.itemsize)
    assert 0.75 * bound <= seen.peak <= bound, (seen.peak, bound)


def _qwen_vl(tower: int, hidden: int):
    """A Qwen2.5-VL of 2 tower layers (one windowed, one full) `tower` wide and 2 decoder layers
    `hidden` wide, 4 x 4 pixel patches merged 2 x 2."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    text = dict(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, use_cache=False,
                bos_token_id=None, eos_token_id=None,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [hidden // 32, 3 * hidden // 64, 3 * hidden // 64]})
    vision = dict(depth=2, hidden_size=tower, intermediate_size=4 * tower, num_heads=4, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=32, out_hidden_size=hidden,
                  fullatt_block_indexes=[1])
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=text, vision_config=vision, image_token_id=500, video_token_id=503, vision_start_token_id=501,
        vision_end_token_id=502, use_cache=False))


# (tower width, decoder width, image side in patches, rows, dtype): the tower's pass dominates, the
# decoder's prefill does, a float32 copy of few rows over large images
IMAGE_CASES = {"tower": (256, 128, 32, 4, torch.bfloat16), "decoder": (64, 256, 16, 8, torch.bfloat16),
               "float32": (256, 128, 48, 2, torch.float32)}


@pytest.mark.parametrize("case", list(IMAGE_CASES))
def test_what_generate_holds_for_prompts_with_images_stays_within_the_bound(case):
    """Prompts with an image each, prefilled whole by the copy: the tower's pass or the decoder's
    prefill, whichever is larger, and the pixels the images hold stay under the bound, and above half
    of it."""
    tower, hidden, side, rows, dtype = IMAGE_CASES[case]
    policy = _qwen_vl(tower, hidden)
    engine = _engine(policy)
    copy = HFGenerator(engine, eos_id=None, seed=0, dtype=dtype, filters=EVERY_FILTER, never=(500, 503))
    patches, grid = side * side, torch.tensor([[1, side, side]])
    prompts = [[3, 501] + [500] * (patches // 4) + [502] + [5 + r, 6, 7][:1 + r % 3] for r in range(rows)]

    def inputs(chosen, ids):
        n = len(chosen)
        return {"pixel_values": torch.randn(n * patches, 3 * 2 * 4 * 4), "image_grid_thw": grid.repeat(n, 1),
                "mm_token_type_ids": (ids == 500).long()}
    weights = list(copy.model.parameters()) + list(copy.model.buffers())
    new = 4
    with PeakLiveBytes(existing=weights) as seen:
        copy.generate(prompts, 1, new, temperature=1.0, inputs=inputs)
    width = max(len(p) for p in prompts)
    text = policy.config.text_config
    head = text.hidden_size // text.num_attention_heads
    cache = rows * (width + new) * 2 * text.num_hidden_layers * text.num_key_value_heads * head * dtype.itemsize
    pixels = patches * 3 * 2 * 4 * 4
    bound = generate_transient_bytes(policy.config, rows, width, dtype.itemsize, images=(rows * pixels, pixels))
    measured = seen.peak - cache
    assert 0.5 * bound <= measured <= bound, (measured, bound)
    engine.close()
