"""The forms transformers 5.17 gives the vision-language methods capture reads or replaces, given to
the tiny models of whatever transformers is installed: they train and run as eagerly.

Each form below is 5.17's own lines (its cache arguments left out): the Idefics3 / SmolVLM vision
embeddings writing the patch positions by a boolean mask, and bucketing the coordinates in the
pixels' dtype (capture/patch_positions.py); Qwen3-VL's get_image_features handing on the deepstack
features whole, and its forward reading them so, joining images' and videos' by boolean indexing,
and taking no precomputed features (capture/deepstack.py, capture/grid_media.py); Qwen2.5-VL's
output carrying the step's rope deltas (capture/rope_positions.py). Installed as the classes'
methods, eager runs them too, so eager and megacompile compute the same model.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.modeling_outputs import ModelOutput
from transformers.utils import can_return_tuple

import megacompile
from megacompile.capture.patch_positions import placed as positions, static_positions
from megacompile.errors import CaptureError
from tests.e2e.harness import clone
from tests.e2e.test_vlm import STEPS, assert_parity
from tests.e2e.test_vlm_videos import MIXED as MEDIA_ROWS, video_batch
from tests.vlm_families import batch, idefics3, qwen2_5_vl, qwen3_vl, qwen_batch

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


@can_return_tuple
def qwen3_vl_image_features(self, pixel_values, image_grid_thw=None, **kwargs):
    """Qwen3VLModel.get_image_features of transformers 5.17: the deepstack features not split."""
    pixel_values = pixel_values.type(self.visual.dtype)
    vision_output = self.visual(pixel_values, grid_thw=image_grid_thw, return_dict=True, **kwargs)
    image_embeds = vision_output.pooler_output
    split_sizes = (image_grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
    image_embeds = torch.split(image_embeds, split_sizes)
    vision_output.pooler_output = image_embeds
    return vision_output


@dataclasses.dataclass
class ModelOutputs(ModelOutput):
    """What the lm-head wrapper of either release reads of its model's output."""
    last_hidden_state: torch.Tensor | None = None
    past_key_values: object = None
    cache: object = None
    hidden_states: object = None
    attentions: object = None
    image_outputs: object = None
    video_outputs: object = None
    rope_deltas: torch.Tensor | None = None


def qwen3_vl_forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                     pixel_values=None, pixel_values_videos=None, image_grid_thw=None, video_grid_thw=None,
                     mm_token_type_ids=None, **kwargs):
    """Qwen3VLModel.forward of transformers 5.17: no precomputed features; deepstack features read
    as get_image_features gives them."""
    kwargs.pop("mm_encoder_outputs", None)    # None: what a later release's lm-head wrapper passes on
    if inputs_embeds is None:
        inputs_embeds = self.get_input_embeddings()(input_ids)
    image_mask = None
    video_mask = None
    if pixel_values is not None:
        image_outputs = self.get_image_features(pixel_values, image_grid_thw, return_dict=True, **kwargs)
        image_embeds = image_outputs.pooler_output
        deepstack_image_embeds = image_outputs.deepstack_features
        image_embeds = torch.cat(image_embeds, dim=0).to(inputs_embeds.device, inputs_embeds.dtype)
        image_mask, _ = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds, image_features=image_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(image_mask, image_embeds)
    if pixel_values_videos is not None:
        video_outputs = self.get_video_features(pixel_values_videos, video_grid_thw, return_dict=True, **kwargs)
        video_embeds = video_outputs.pooler_output
        deepstack_video_embeds = video_outputs.deepstack_features
        video_embeds = torch.cat(video_embeds, dim=0).to(inputs_embeds.device, inputs_embeds.dtype)
        _, video_mask = self.get_placeholder_mask(input_ids, inputs_embeds=inputs_embeds, video_features=video_embeds)
        inputs_embeds = inputs_embeds.masked_scatter(video_mask, video_embeds)
    visual_pos_masks = None
    deepstack_visual_embeds = None
    if image_mask is not None and video_mask is not None:
        image_mask = image_mask[..., 0]
        video_mask = video_mask[..., 0]
        visual_pos_masks = image_mask | video_mask
        deepstack_visual_embeds = []
        image_mask_joint = image_mask[visual_pos_masks]
        video_mask_joint = video_mask[visual_pos_masks]
        for img_embed, vid_embed in zip(deepstack_image_embeds, deepstack_video_embeds):
            embed_joint = img_embed.new_zeros(visual_pos_masks.sum(), img_embed.shape[-1]).to(img_embed.device)
            embed_joint[image_mask_joint, :] = img_embed
            embed_joint[video_mask_joint, :] = vid_embed
            deepstack_visual_embeds.append(embed_joint)
    elif image_mask is not None:
        image_mask = image_mask[..., 0]
        visual_pos_masks = image_mask
        deepstack_visual_embeds = deepstack_image_embeds
    elif video_mask is not None:
        video_mask = video_mask[..., 0]
        visual_pos_masks = video_mask
        deepstack_visual_embeds = deepstack_video_embeds
    if position_ids is None:
        position_ids = self.compute_3d_position_ids(input_ids=input_ids, image_grid_thw=image_grid_thw,
                                                    video_grid_thw=video_grid_thw, inputs_embeds=inputs_embeds,
                                                    attention_mask=attention_mask, mm_token_type_ids=mm_token_type_ids)
    outputs = self.language_model(input_ids=None, position_ids=position_ids, attention_mask=attention_mask,
                                  inputs_embeds=inputs_embeds, visual_pos_masks=visual_pos_masks,
                                  deepstack_visual_embeds=deepstack_visual_embeds, **kwargs)
    return ModelOutputs(last_hidden_state=outputs.last_hidden_state)


@pytest.fixture
def qwen3_vl_517(monkeypatch):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
    monkeypatch.setattr(Qwen3VLModel, "get_image_features", qwen3_vl_image_features)
    monkeypatch.setattr(Qwen3VLModel, "forward", qwen3_vl_forward)


def test_deepstack_features_handed_on_whole_train_as_eagerly(qwen3_vl_517):
    assert_parity(qwen3_vl(), [qwen_batch(seed=i, images=MIXED) for i in range(STEPS)], weights=2.0,
                  then_smallest=False)


def test_images_and_videos_through_a_forward_without_precomputed_features_give_eagers_logits(qwen3_vl_517):
    """The tower runs once over the images and videos, and the forward, which takes no precomputed
    features, asks for them: the logits are eager's, whose forward joins the deepstack features by
    boolean indexing."""
    m, b = qwen3_vl(), video_batch("qwen3_vl", MEDIA_ROWS["qwen3_vl"])
    inference = {k: v for k, v in b.items() if k != "labels"}
    with torch.no_grad():
        expected = m(**inference).logits
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    assert (engine(**inference).logits - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_deepstack_features_handed_on_otherwise_are_refused(monkeypatch):
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    @can_return_tuple
    def reads_its_config(self, pixel_values, image_grid_thw=None, **kwargs):
        assert self.config.vision_config.deepstack_visual_indexes
        return qwen3_vl_image_features(self, pixel_values, image_grid_thw, **kwargs)
    monkeypatch.setattr(Qwen3VLModel, "get_image_features", reads_its_config)
    engine = megacompile.compile(qwen3_vl(), hbm_budget=1.0, device="cpu")
    with pytest.raises(CaptureError, match=r"Qwen3VLModel \('model'\)'s get_image_features hands on its deepstack "
                                           r"features otherwise than"):
        engine.step(**qwen_batch(images=MIXED))


@dataclasses.dataclass
class WithRopeDeltas(ModelOutput):
    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    rope_deltas: torch.Tensor | None = None


def test_the_rope_deltas_an_output_returns_are_the_steps(monkeypatch):
    """transformers 5.17's Qwen2.5-VL returns the rope deltas its model holds, which the step's 3D
    positions set: each forward's output holds its own step's, not the captured step's (two
    batches of the same shapes and grids, their images in other rows: one capture)."""
    from transformers import Qwen2_5_VLForConditionalGeneration
    original = Qwen2_5_VLForConditionalGeneration.forward

    def forward(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if "rope_deltas" in out:    # the installed release returns them itself
            return out
        return WithRopeDeltas(loss=out.loss, logits=out.logits, rope_deltas=self.model.rope_deltas)
    monkeypatch.setattr(Qwen2_5_VLForConditionalGeneration, "forward", forward)
    m = qwen2_5_vl()
    engine = megacompile.compile(clone(m), hbm_budget=1.0, device="cpu")
    deltas = []
    for images in ((1, 2, 0), (0, 1, 2)):
        inference = {k: v for k, v in qwen_batch(images=images).items() if k != "labels"}
        with torch.no_grad():
            expected = m(**inference)
        out = engine(**inference)
        assert torch.equal(out.rope_deltas, expected.rope_deltas)
        assert (out.logits - expected.logits).abs().max() <= 1e-5 * expected.logits.abs().max()
        deltas.append(out.rope_deltas)
    assert not torch.equal(*deltas)
