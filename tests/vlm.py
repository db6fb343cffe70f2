"""A tiny LLaVA (CLIP vision tower, two-layer projector, Llama), random init (nothing is
downloaded), and its batches: token ids with image placeholders, pixel values, labels.

Images are 16 x 16 pixels in 4 x 4 patches: 16 patches and a class token, of which LLaVA's
default feature strategy keeps the 16 patches, so each image fills 16 image tokens. The text model
has no learned positions; the vision tower's 17-entry position table is the one learned table.
The text model is deep and wide for its width (8 layers, MLP 256) so that its weights outweigh what
one step needs at once: the smallest budget lies below the weights' bytes, and the blocks stream.
"""
from __future__ import annotations

import torch

VOCAB = 128
IMAGE_TOKEN = VOCAB - 1
IMAGE = 16                      # pixels per side
PATCHES = (IMAGE // 4) ** 2     # image tokens per image
SEQ = 40                        # tokens per sequence: more than the vision tower's 17 positions


def llava(seed: int = 0, tower_width: int = 32, tower_layers: int = 2, feature_layer: int = -1):
    """tower_width: the vision tower's hidden size (its MLP twice that); at 128 its layers hold more
    parameters than the text model's. feature_layer: the tower layer whose output the projector
    takes (LLaVA-1.5 takes the second-to-last, -2)."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=tower_width, intermediate_size=2 * tower_width, num_hidden_layers=tower_layers,
                              num_attention_heads=4,
                              image_size=IMAGE, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=256, num_hidden_layers=8,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=feature_layer, vision_feature_select_strategy="default")
    return LlavaForConditionalGeneration(config)


def batch(seed: int = 0, images: tuple[bool, ...] = (True, True)) -> dict[str, torch.Tensor]:
    """One row per entry of `images`; a row with an image holds its 16 image tokens at a place
    that moves with the seed; pixel_values hold one image per such row, in row order."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, IMAGE_TOKEN, (len(images), SEQ), generator=g)
    for row, has in enumerate(images):
        if has:
            start = int(torch.randint(1, SEQ - PATCHES, (1,), generator=g))
            ids[row, start:start + PATCHES] = IMAGE_TOKEN
    labels = ids.masked_fill(ids == IMAGE_TOKEN, -100)
    pixels = torch.randn(sum(images), 3, IMAGE, IMAGE, generator=g)
    return {"input_ids": ids, "pixel_values": pixels, "labels": labels}


def vipllava(seed: int = 0):
    """VipLlava: LLaVA's shape with features from several vision layers; not trained with images yet."""
    from transformers import CLIPVisionConfig, LlamaConfig, VipLlavaConfig, VipLlavaForConditionalGeneration
    torch.manual_seed(seed)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=IMAGE, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return VipLlavaForConditionalGeneration(VipLlavaConfig(vision_config=vision, text_config=text,
                                                           image_token_index=IMAGE_TOKEN,
                                                           vision_feature_layers=[-2, -1]))
