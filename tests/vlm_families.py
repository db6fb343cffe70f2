"""Tiny Gemma 3 and Idefics3 / SmolVLM models (random init, nothing downloaded) and their batches.

Each family lays its images out its own way, as its processor writes them:
- Gemma 3: pixel_values hold one image per image in the batch, [images, 3, H, W]; each image fills
  `mm_tokens_per_image` image tokens between a begin- and an end-of-image token, and token_type_ids
  mark the image tokens (1), over which attention is bidirectional within each image.
- Idefics3 / SmolVLM: pixel_values are padded per row, [rows, most images in a row, 3, H, W], a
  missing image all zeros; each image fills (patches / scale_factor^2) image tokens between two
  `fake_token_around_image` tokens; pixel_attention_mask marks the real pixels.
- Qwen2-VL, Qwen2.5-VL: pixel_values hold the batch's patches flattened, image_grid_thw each image's grid of
  patches, of two sizes here (see QWEN_GRIDS); mm_token_type_ids mark the image tokens.
`images` gives the number of images of each row (0, 1 or 2).
"""
from __future__ import annotations

import torch

VOCAB = 128
IMAGE_TOKEN = VOCAB - 1
AROUND = VOCAB - 2              # begin / end of an image (Gemma 3), the token around an image (Idefics3)
END_OF_IMAGE = VOCAB - 3
SEQ = 48
IMAGE = 16                      # pixels per side, in 4 x 4 patches: 16 patches per image
GEMMA3_TOKENS = 4               # Gemma 3 pools the 16 patches 2 x 2: 4 image tokens per image
IDEFICS3_TOKENS = 4             # Idefics3 shuffles 2 x 2 patches into one: 4 image tokens per image
FAMILIES = ("gemma3", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")
QWEN = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"}     # the families of Qwen's inputs (qwen_batch)


def _text(config_cls, **extra):
    return config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=256, num_hidden_layers=6,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      use_cache=False, **extra)


def gemma3(seed: int = 0):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig
    torch.manual_seed(seed)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                image_size=IMAGE, patch_size=4)
    text = _text(Gemma3TextConfig, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_TOKENS,
                          image_token_index=IMAGE_TOKEN, boi_token_index=AROUND, eoi_token_index=END_OF_IMAGE)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():   # zero-initialised in transformers: random, so that the features carry gradient
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(std=1.0)
    return model


def idefics3(seed: int = 0, family: str = "idefics3"):
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3VisionConfig, LlamaConfig,
                              SmolVLMConfig, SmolVLMForConditionalGeneration, SmolVLMVisionConfig)
    config_cls, vision_cls, model_cls = ((Idefics3Config, Idefics3VisionConfig, Idefics3ForConditionalGeneration)
                                         if family == "idefics3" else
                                         (SmolVLMConfig, SmolVLMVisionConfig, SmolVLMForConditionalGeneration))
    torch.manual_seed(seed)
    vision = vision_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        image_size=IMAGE, patch_size=4)
    config = config_cls(text_config=_text(LlamaConfig).to_dict(), vision_config=vision.to_dict(),
                        image_token_id=IMAGE_TOKEN, scale_factor=2, use_cache=False)
    return model_cls(config)


def model(family: str, seed: int = 0):
    if family in QWEN:
        builders = {"qwen2_vl": qwen2_vl, "qwen2_5_vl": qwen2_5_vl, "qwen3_vl": qwen3_vl, "qwen3_5": qwen3_5_vl}
        return builders[family](seed)
    return gemma3(seed) if family == "gemma3" else idefics3(seed, family)


def batch(family: str, seed: int = 0, images: tuple[int, ...] = (1, 2)) -> dict[str, torch.Tensor]:
    """One row per entry of `images`, each row holding that many images at places that move with
    the seed; labels ignore the image tokens."""
    if family in QWEN:
        return qwen_batch(seed, images)
    g = torch.Generator().manual_seed(seed)
    per_image = GEMMA3_TOKENS if family == "gemma3" else IDEFICS3_TOKENS
    ids = torch.randint(2, END_OF_IMAGE, (len(images), SEQ), generator=g)
    span = per_image + 2
    for row, n in enumerate(images):
        slots = torch.randperm((SEQ - 1) // span, generator=g)[:n].sort().values
        for slot in slots.tolist():
            start = 1 + slot * span
            ids[row, start] = AROUND
            ids[row, start + 1:start + 1 + per_image] = IMAGE_TOKEN
            ids[row, start + 1 + per_image] = END_OF_IMAGE if family == "gemma3" else AROUND
    out = {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100)}
    if family == "gemma3":
        out["pixel_values"] = torch.randn(sum(images), 3, IMAGE, IMAGE, generator=g)
        out["token_type_ids"] = (ids == IMAGE_TOKEN).long()
        return out
    most = max(max(images), 1)
    pixels = torch.zeros(len(images), most, 3, IMAGE, IMAGE)
    mask = torch.zeros(len(images), most, IMAGE, IMAGE, dtype=torch.long)
    for row, n in enumerate(images):
        pixels[row, :n] = torch.randn(n, 3, IMAGE, IMAGE, generator=g)
        mask[row, :n] = 1
    out["pixel_values"], out["pixel_attention_mask"] = pixels, mask
    return out


def idefics2(seed: int = 0):
    """Idefics2: pixel_values padded as Idefics3's, features resampled by a perceiver; not trained
    with images yet."""
    from transformers import Idefics2Config, Idefics2ForConditionalGeneration, MistralConfig
    torch.manual_seed(seed)
    text = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  image_size=IMAGE, patch_size=4)
    perceiver = dict(hidden_size=32, resampler_n_latents=IDEFICS3_TOKENS, resampler_depth=1, resampler_n_heads=2,
                     resampler_head_dim=8, num_key_value_heads=1)
    return Idefics2ForConditionalGeneration(Idefics2Config(text_config=text.to_dict(), vision_config=vision,
                                                           perceiver_config=perceiver, image_token_id=IMAGE_TOKEN,
                                                           use_cache=False))


# Qwen2.5-VL: pixel_values hold every image's patches flattened, [patches, 3 * 2 * 4 * 4] (each 4 x 4
# patch repeated over the 2 frames a still image fills); image_grid_thw gives each image's
# (frames, rows, columns) of patches, which the tower reads as values. Each image fills
# rows * columns / 4 image tokens (2 x 2 patches merge into one) between a vision-start and a
# vision-end token, and mm_token_type_ids mark them (1) for the 3D positions `get_rope_index` builds.
QWEN_GRIDS = ((1, 4, 4), (1, 2, 4))   # two image sizes, 16 x 16 and 8 x 16 pixels: 4 and 2 tokens
VISION_START = VOCAB - 4
VIDEO_TOKEN = VOCAB - 5


def _qwen2_text() -> dict:
    """Qwen2-VL's and Qwen2.5-VL's decoder: 4 layers of 32, 3D rotary sections of 1, 1 and 2."""
    return dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                bos_token_id=None, eos_token_id=None, num_key_value_heads=2, max_position_embeddings=64,
                use_cache=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [1, 1, 2]})


def qwen2_5_vl(seed: int = 0, depth: int = 2, full_attention: tuple[int, ...] = (1,), window: int = 8):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    text = _qwen2_text()
    # windows of 8 x 8 pixels (one merged token; `window`) in the first tower layer, full attention in the second
    vision = dict(depth=depth, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, window_size=window, out_hidden_size=32,
                  fullatt_block_indexes=list(full_attention))
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                              video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                              vision_end_token_id=END_OF_IMAGE, use_cache=False)
    return Qwen2_5_VLForConditionalGeneration(config)


def qwen2_vl(seed: int = 0, depth: int = 2):
    """Qwen2-VL: Qwen2.5-VL's inputs; its tower attends over whole images in every layer (no
    windows), with LayerNorms and a GELU MLP, and its merger has a LayerNorm."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    text = _qwen2_text()
    # the tower's width (embed_dim) differs from the decoder's (hidden_size), which the merger maps to
    vision = dict(depth=depth, embed_dim=16, hidden_size=32, mlp_ratio=4, num_heads=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN,
                           video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                           vision_end_token_id=END_OF_IMAGE, use_cache=False)
    return Qwen2VLForConditionalGeneration(config)


def qwen_batch(seed: int = 0, images: tuple[int, ...] = (1, 2), grids=QWEN_GRIDS) -> dict[str, torch.Tensor]:
    """One row per entry of `images`; the k-th image of the batch has grid grids[k % len(grids)]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VIDEO_TOKEN, (len(images), SEQ), generator=g)
    thw, k = [], 0
    span = max(h * w for _, h, w in grids) // 4 + 2
    for row, n in enumerate(images):
        slots = torch.randperm((SEQ - 1) // span, generator=g)[:n].sort().values
        for slot in slots.tolist():
            t, h, w = grids[k % len(grids)]
            tokens = t * h * w // 4
            start = 1 + slot * span
            ids[row, start] = VISION_START
            ids[row, start + 1:start + 1 + tokens] = IMAGE_TOKEN
            ids[row, start + 1 + tokens] = END_OF_IMAGE
            thw.append((t, h, w))
            k += 1
    out = {"input_ids": ids, "labels": ids.masked_fill(ids == IMAGE_TOKEN, -100),
           "mm_token_type_ids": (ids == IMAGE_TOKEN).int()}
    if thw:
        patches = sum(t * h * w for t, h, w in thw)
        out["pixel_values"] = torch.randn(patches, 3 * 2 * 4 * 4, generator=g)
        out["image_grid_thw"] = torch.tensor(thw)
    return out


def qwen3_vl(seed: int = 0, moe: bool = False, patch: int = 4, layers: int = 3):
    """Qwen3-VL: Qwen2.5-VL's inputs; the mergers after both tower layers give deepstack features,
    added to the image tokens' hidden states after the first two of three decoder layers. `moe`:
    Qwen3-VL-MoE, whose decoder layers route over 4 experts, 2 per token."""
    import transformers
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False, bos_token_id=None,
                eos_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "mrope_section": [1, 1, 2], "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    name = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=END_OF_IMAGE)
    return getattr(transformers, f"{name}ForConditionalGeneration")(config)


def qwen3_5_vl(seed: int = 0, moe: bool = False, patch: int = 4):
    """Qwen3.5: Qwen3-VL's tower (without deepstack) and inputs before a hybrid decoder, three gated
    delta-net layers to one full-attention layer; `moe`: Qwen3.5-MoE's decoder (4 experts, 2 a
    token, and a shared expert); `patch`: the tower's patch size in pixels (the released models': 16)."""
    import transformers
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
                linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.5})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=128)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=patch, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16)
    name = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=END_OF_IMAGE)
    return getattr(transformers, f"{name}ForConditionalGeneration")(config)


def mllama(seed: int = 0):
    """Mllama: a tiled vision model whose features the decoder reads in cross-attention layers (here
    layer 1 of 4); refused with images, a decoder without them."""
    from transformers import MllamaConfig, MllamaForConditionalGeneration
    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, cross_attention_layers=[1], max_position_embeddings=64, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=4,
                  image_size=IMAGE, patch_size=4, max_num_tiles=1, vision_output_dim=64,
                  intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1]])
    return MllamaForConditionalGeneration(MllamaConfig(text_config=text, vision_config=vision,
                                                       image_token_index=IMAGE_TOKEN))


def mllama_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Two rows of SEQ tokens, one image (one tile) each, as MllamaProcessor lays them out."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VIDEO_TOKEN, (2, SEQ), generator=g)
    ids[:, 1] = IMAGE_TOKEN
    return dict(input_ids=ids, labels=ids.masked_fill(ids == IMAGE_TOKEN, -100),
                pixel_values=torch.randn(2, 1, 1, 3, IMAGE, IMAGE, generator=g),
                aspect_ratio_ids=torch.tensor([[1], [1]]), aspect_ratio_mask=torch.ones(2, 1, 1, dtype=torch.long),
                cross_attention_mask=torch.ones(2, SEQ, 1, 1, dtype=torch.long))
