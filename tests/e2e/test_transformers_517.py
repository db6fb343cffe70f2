"""The forms transformers 5.17 gives the vision-language methods capture reads or replaces, given to
the tiny models of whatever transformers is installed: they train and run as eagerly.

Each form below is 5.17's own lines: the Idefics3 / SmolVLM vision embeddings writing the patch
positions by a boolean mask, and bucketing the coordinates in the pixels' dtype
(capture/patch_positions.py). Installed as the classes' methods, eager runs them too, so eager and
megacompile compute the same model.
"""
from __future__ import annotations

import pytest
import torch

import megacompile
from megacompile.capture.patch_positions import placed as positions, static_positions
from megacompile.errors import CaptureError
from tests.e2e.test_vlm import STEPS, assert_parity
from tests.vlm_families import batch, idefics3

MIXED = (0, 1, 2)     # images per row


def embeddings_forward(self, pixel_values, patch_attention_mask):
    """Idefics3VisionEmbeddings.forward (and SmolVLM's) of transformers 5.17."""
    batch_size, _, max_im_h, max_im_w = pixel_values.shape
    patch_embeds = self.patch_embedding(pixel_values)
    embeddings = patch_embeds.flatten(2).transpose(1, 2)
    max_nb_patches_h, max_nb_patches_w = max_im_h // self.patch_size, max_im_w // self.patch_size
    boundaries = torch.arange(1 / self.num_patches_per_side, 1.0, 1 / self.num_patches_per_side,
                              device=pixel_values.device)
    position_ids = torch.full(size=(batch_size, max_nb_patches_h * max_nb_patches_w), fill_value=0,
                              device=pixel_values.device)
    nb_patches_h = patch_attention_mask[:, :, 0].sum(dim=1)
    nb_patches_w = patch_attention_mask[:, 0, :].sum(dim=1)
    step_h = 1.0 / nb_patches_h
    step_w = 1.0 / nb_patches_w
    max_patches_h = patch_attention_mask.size(1)
    max_patches_w = patch_attention_mask.size(2)
    h_indices = torch.arange(max_patches_h, device=position_ids.device, dtype=torch.float32)
    w_indices = torch.arange(max_patches_w, device=position_ids.device, dtype=torch.float32)
    fractional_coords_h = h_indices[None, :] * step_h[:, None]
    fractional_coords_w = w_indices[None, :] * step_w[:, None]
    fractional_coords_h = torch.clamp(fractional_coords_h, max=(1.0 - 1e-6))
    fractional_coords_w = torch.clamp(fractional_coords_w, max=(1.0 - 1e-6))
    fractional_coords_h = fractional_coords_h.to(pixel_values.dtype)
    fractional_coords_w = fractional_coords_w.to(pixel_values.dtype)
    bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
    bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)
    pos_ids = bucket_coords_h[:, :, None] * self.num_patches_per_side + bucket_coords_w[:, None, :]
    pos_ids = pos_ids.reshape(batch_size, -1)
    position_ids[patch_attention_mask.view(batch_size, -1)] = pos_ids[patch_attention_mask.view(batch_size, -1)]
    embeddings = embeddings + self.position_embedding(position_ids)
    return embeddings


def embeddings_class():
    from transformers.models.idefics3.modeling_idefics3 import Idefics3VisionEmbeddings
    return Idefics3VisionEmbeddings


def test_patch_positions_written_by_a_boolean_mask_train_as_eagerly(monkeypatch):
    monkeypatch.setattr(embeddings_class(), "forward", embeddings_forward)
    assert_parity(idefics3(), [batch("idefics3", seed=i, images=MIXED) for i in range(STEPS)], weights=2.0,
                  then_smallest=False, block_path="model.text_model.layers")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_patch_positions_are_the_installed_forwards_in_the_pixels_dtype(dtype):
    """6 patches a side, where bucketing in bfloat16 or float16 moves some positions: for each
    count of real patch rows and columns, the static positions are 5.17's under its forward and
    the installed release's under its own."""
    from transformers import Idefics3VisionConfig
    cls = embeddings_class()
    torch.manual_seed(0)
    emb = cls(Idefics3VisionConfig(hidden_size=8, image_size=24, patch_size=4)).to(dtype)
    masks = torch.zeros(36, 6, 6, dtype=torch.bool)
    for k in range(36):
        masks[k, :k // 6 + 1, :k % 6 + 1] = True
    pixels = torch.randn(36, 3, 24, 24).to(dtype)
    placed = {}
    for name, forward in (("5.17", embeddings_forward), ("installed", cls.forward)):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cls, "forward", forward)
            expected = emb(pixels, masks)
            with static_positions(emb, "embeddings"):
                placed[name] = emb(pixels, masks)
        assert torch.equal(placed[name], expected), name
    if dtype != torch.float32:      # the two forms differ here
        assert not torch.equal(positions(emb, pixels, masks, cast=True), positions(emb, pixels, masks, cast=False))


def test_patch_positions_placed_otherwise_are_refused(monkeypatch):
    def transposed(self, pixel_values, patch_attention_mask):
        return embeddings_forward(self, pixel_values, patch_attention_mask.transpose(1, 2).contiguous())
    monkeypatch.setattr(embeddings_class(), "forward", transposed)
    engine = megacompile.compile(idefics3(), hbm_budget=1.0, device="cpu")
    with pytest.raises(CaptureError, match=r"Idefics3VisionEmbeddings \('model.vision_model.embeddings'\) places "
                                           r"its patches' positions otherwise than the forms megacompile traces"):
        engine.step(**batch("idefics3", images=MIXED))
