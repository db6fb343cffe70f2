"""The forms transformers 5.17 gives the vision-language methods capture reads or replaces, given to
the tiny models of whatever transformers is installed: they train and run as eagerly.

Each stand-in below computes what 5.17's method computes, in the way that matters to the capture:
the Idefics3 / SmolVLM vision embeddings writing the patch positions through a boolean mask and
bucketing the coordinates in the pixels' dtype (capture/patch_positions.py); Qwen3-VL's
get_image_features handing on the deepstack features whole, and a forward reading them so, joining
images' and videos' by boolean indexing, and taking no precomputed features (capture/deepstack.py,
capture/grid_media.py); Qwen2.5-VL's output carrying the step's rope deltas
(capture/rope_positions.py). Installed as the classes' methods, eager runs them too, so eager and
megacompile compute the same model.
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
    """An Idefics3 / SmolVLM vision embeddings forward in 5.17's form: each real patch's grid
    position written through a boolean mask (a gather whose length is read from the mask), its
    fractional coordinates rounded to the pixels' dtype before they are bucketed."""
    images = pixel_values.shape[0]
    side = self.num_patches_per_side
    edges = torch.arange(1 / side, 1.0, 1 / side, device=pixel_values.device)

    def buckets(count: int, real: torch.Tensor) -> torch.Tensor:          # [images, count]
        at = torch.arange(count, dtype=torch.float32, device=real.device)[None, :] * (1.0 / real)[:, None]
        return torch.bucketize(torch.clamp(at, max=(1.0 - 1e-6)).to(pixel_values.dtype), edges, right=True)
    rows = buckets(patch_attention_mask.size(1), patch_attention_mask[:, :, 0].sum(dim=1))
    cols = buckets(patch_attention_mask.size(2), patch_attention_mask[:, 0, :].sum(dim=1))
    grid = (rows[:, :, None] * side + cols[:, None, :]).reshape(images, -1)
    real = patch_attention_mask.view(images, -1)
    positions = torch.zeros_like(grid)
    positions[real] = grid[real]
    return self.patch_embedding(pixel_values).flatten(2).transpose(1, 2) + self.position_embedding(positions)


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
    """Qwen3-VL's get_image_features in 5.17's form: the pooled features split per image, the
    deepstack features handed on whole (one tensor a merger)."""
    out = self.visual(pixel_values.type(self.visual.dtype), grid_thw=image_grid_thw, return_dict=True, **kwargs)
    per_image = (image_grid_thw.prod(-1) // self.visual.spatial_merge_size ** 2).tolist()
    out.pooler_output = torch.split(out.pooler_output, per_image)
    return out


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
    """Qwen3-VL's model forward in 5.17's form: no precomputed features (it asks
    get_<media>_features for each kind it is given, images first), the deepstack features read as
    get_image_features gives them, and the two kinds' joined by boolean indexing over the tokens
    of either."""
    kwargs.pop("mm_encoder_outputs", None)    # None: what a later release's lm-head wrapper passes on
    embeds = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
    masks, deep = {}, {}
    for kind, pixels, grid, features in (("image", pixel_values, image_grid_thw, self.get_image_features),
                                         ("video", pixel_values_videos, video_grid_thw, self.get_video_features)):
        if pixels is None:
            continue
        out = features(pixels, grid, return_dict=True, **kwargs)
        flat = torch.cat(out.pooler_output, dim=0).to(embeds.device, embeds.dtype)
        mask = self.get_placeholder_mask(input_ids, inputs_embeds=embeds,
                                         **{f"{kind}_features": flat})[0 if kind == "image" else 1]
        embeds = embeds.masked_scatter(mask, flat)
        masks[kind], deep[kind] = mask[..., 0], out.deepstack_features
    visual, stacked = None, None
    if len(masks) == 2:
        visual = masks["image"] | masks["video"]
        stacked = []
        for of_images, of_videos in zip(deep["image"], deep["video"]):
            joined = of_images.new_zeros(int(visual.sum()), of_images.shape[-1])
            joined[masks["image"][visual]] = of_images
            joined[masks["video"][visual]] = of_videos
            stacked.append(joined)
    elif masks:
        (kind,) = masks
        visual, stacked = masks[kind], deep[kind]
    if position_ids is None:
        position_ids = self.compute_3d_position_ids(input_ids=input_ids, image_grid_thw=image_grid_thw,
                                                    video_grid_thw=video_grid_thw, inputs_embeds=embeds,
                                                    attention_mask=attention_mask, mm_token_type_ids=mm_token_type_ids)
    outputs = self.language_model(input_ids=None, position_ids=position_ids, attention_mask=attention_mask,
                                  inputs_embeds=embeds, visual_pos_masks=visual, deepstack_visual_embeds=stacked,
                                  **kwargs)
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
