"""What transformers' `generate` holds while it samples a rollout batch, besides the copy's weights
and its key-value cache: tensors that pass (the prefill's largest layer, each step's logits and
sampling), freed before the engine runs again, yet held beside its arena while they live.

The prefill runs in chunks of the prompts' positions (generate's `prefill_chunk_size`) of about
PREFILL_TOKENS tokens over all the rows: enough rows for a GPU's matmuls to run near their peak,
and a bound on what a chunk passes through, where the whole prompt at once would hold (a 70B's
32 rows of 512 tokens) 4.6 GiB. The completions are the same either way.

The figure is a bound, from the model's Hugging Face config, made of the larger of two moments:

- a prefill chunk: its tokens through one decoder layer at a time, per token the MLP's
  intermediates (gate, up and their product: 3 x intermediate_size; a mixture of experts' routed
  copies, 5 x k x moe_intermediate_size, beside its shared experts'), about eight hidden-size
  tensors (the residual, the norm's float32 pass, attention's query, rotated keys and output) and
  one element per key (up to the prompt's length) of the attention mask of left-padded rows, which
  a chunk takes in the copy's dtype;
- a sampling step: each row's logits in the copy's dtype, their float32 copy, and the sampling
  filters' passes over them (sort values and int64 indices, softmax, cumulative sum, masks): at
  most 48 bytes a vocabulary entry with top-k, top-p, min-p and a repetition penalty all on.

The prefill's figure is any forward-only pass's: a reward model scoring completions
(posttrain/reward_models.py) passes the same through its layers, `forward_transient_bytes`.

Measured by counting the live storages ops create inside `generate` and a reward model's forward on
the cpu (a dispatch mode, tests/posttrain/test_generation_memory.py): dense and mixture-of-experts
configs, short and long prompts, small and large vocabularies, bfloat16 and float32 each stay under
the bound, within 25%.

Prompts with images (a vision-language copy) are prefilled whole (a chunk of positions would part an
image's features from its tokens), and a third moment comes first: the vision tower's pass over the
batch's images, its patch tokens through one tower layer at a time as a prefill's tokens go through
a decoder layer (the tower's config), each attending to at most its own image's patches; the images'
pixel values, in the copy's dtype, are held through the whole generate beside the larger moment.
Measured so on Qwen2.5-VL copies whose tower or decoder dominates: 53-89% of the bound (a float32
copy's full-attention tower layer over large images is where it overcounts most).
"""
from __future__ import annotations

PREFILL_TOKENS = 4096   # the tokens of all rows a prefill chunk takes
PER_HIDDEN = 8        # hidden-size tensors alive at once in a layer's prefill, in the copy's dtype
PER_VOCAB = 48        # bytes a vocabulary entry of a sampling step takes beyond its logits
PER_ROUTED = 5        # a routed expert's intermediates, per token and its k experts


def _text(config):
    return getattr(config, "get_text_config", lambda: config)()


def mlp_width(config) -> int:
    """The intermediate elements a token holds at the peak of a decoder layer's MLP: a dense layer's
    three (gate, up, their product), or a mixture's shared experts' three beside its routed
    copies'."""
    text = _text(config)
    dense = 3 * (getattr(text, "intermediate_size", 0) or 0)
    k = getattr(text, "num_experts_per_tok", None)
    if not k:
        return dense
    expert = getattr(text, "moe_intermediate_size", None) or getattr(text, "intermediate_size", 0) or 0
    shared = (getattr(text, "shared_expert_intermediate_size", None)
              or (getattr(text, "n_shared_experts", 0) or 0) * expert)
    return max(dense, 3 * shared + PER_ROUTED * k * expert)


def prefill_chunk(rows: int) -> int:
    """The prompt positions a prefill chunk of `rows` rows takes."""
    return max(1, PREFILL_TOKENS // rows)


def forward_transient_bytes(config, rows: int, tokens: int, dtype_bytes: int, keys: int | None = None) -> int | None:
    """What a forward-only pass of `rows` x `tokens` passes through one decoder layer at a time (no
    cache, no logits over a vocabulary: a prefill chunk, a reward model's scoring), attending to
    `keys` positions (default `tokens`); None where the config does not say its hidden size."""
    hidden = getattr(_text(config), "hidden_size", None)
    if not isinstance(hidden, int):
        return None
    return rows * tokens * dtype_bytes * (mlp_width(config) + PER_HIDDEN * hidden + (tokens if keys is None else keys))


def generate_transient_bytes(config, rows: int, prompt: int, dtype_bytes: int,
                             images: tuple[int, int] | None = None) -> int | None:
    """The bound above for `rows` rows of prompts up to `prompt` tokens, generated at once by a copy
    in a dtype of `dtype_bytes`; None where the config does not say its hidden or vocabulary size.
    `images`: the rows' images, (their pixel values' elements, the largest image's)."""
    vocab = getattr(_text(config), "vocab_size", None)
    chunk = prompt if images else min(prompt, prefill_chunk(rows))
    prefill = forward_transient_bytes(config, rows, chunk, dtype_bytes, keys=prompt)
    if prefill is None or not isinstance(vocab, int):
        return None
    sampling = rows * vocab * (dtype_bytes + PER_VOCAB)
    if not images:
        return max(prefill, sampling)
    pixels, largest = images
    return max(prefill, sampling, tower_transient_bytes(config, pixels, largest, dtype_bytes)) + pixels * dtype_bytes


def tower_transient_bytes(config, pixels: int, largest: int, dtype_bytes: int) -> int:
    """What a vision tower's pass over images of `pixels` pixel values (the largest image's
    `largest`) passes through one tower layer at a time: its patch tokens (the pixels over channels
    x patch_size^2 x temporal_patch_size) as a forward's tokens (0 where the config names no tower)."""
    vision = getattr(config, "vision_config", None)
    patch = getattr(vision, "patch_size", None)
    if not isinstance(patch, int):
        return 0
    channels = next((getattr(vision, k) for k in ("num_channels", "in_channels", "in_chans")
                     if isinstance(getattr(vision, k, None), int)), 3)
    each = channels * patch * patch * (getattr(vision, "temporal_patch_size", None) or 1)
    return forward_transient_bytes(vision, 1, -(-pixels // each), dtype_bytes, keys=-(-largest // each)) or 0
