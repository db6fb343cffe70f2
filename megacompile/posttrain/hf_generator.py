"""Rollouts from a copy of the policy in bf16, sampled by transformers' `generate` with its key-value
cache: one forward per new token over the new token alone, where `EngineGenerator` recomputes
whole rows. The copy costs the policy's size in `dtype` (2 bytes a parameter in bf16) on `device`,
beside the engine's plans (a run takes it and the cache out of its hbm_budget first:
train/beside.py).

The copy is the policy's architecture (its own class: a vision-language model's keeps its tower)
built from its config with its parameters on the meta device, then given its weights tensor by
tensor from the engine's fp32 masters, each cast alone (policy_weights.py; a LoRA policy's adapters
merged into them); tied weights stay tied. `sync()` after each optimizer step copies the masters in
again, tensor by tensor, into the same memory.

The prompts' prefill runs in chunks of their positions, about 4096 tokens of all the rows each
(cost/generation_memory.py): what it passes through stays bounded beside the engine's arena.

Sampling: at temperature t > 0 each token is drawn from softmax(logits / t), through the sampling
filters (top-k, top-p, min-p, repetition penalty: sampling_filters.py), by `torch.multinomial` with
the generator's own seeded torch.Generator, as `EngineGenerator` draws it, inside transformers'
loop as a logits processor that keeps only the drawn token (generate's greedy step then takes
it); at t = 0 the argmax (after the repetition penalty). The global random state is never read or moved, and `state()` /
`set_state()` save and restore the sampler for a checkpoint.

Prompts with images (a vision-language policy): `inputs(rows, input_ids)` gives the rows' image
inputs for the left-padded prompts, handed to `generate`, whose prefill then runs whole (chunks of
positions would part an image's features from its tokens), and the image tokens (`never`) are
suppressed, as the engine generator never draws them.
"""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..cost.generation_memory import prefill_chunk
from ..errors import ArgumentError
from .policy_weights import policy_of, policy_weights, tied_names
from .rollout import Completion, check_request, stop_ids
from .sampling_filters import Filters, seen_tokens


class _Draw:
    """A logits processor: one token per row drawn as `EngineGenerator` draws it (sampling_filters.py,
    greedy at temperature 0) with `rng`; every other token's score set to -inf, so the greedy step
    picks the drawn one. `starts`: where each row's tokens begin after the left padding, which the
    repetition penalty does not count."""

    def __init__(self, temperature: float, rng: torch.Generator, filters: Filters, starts: list[int]):
        self.temperature, self.rng, self.filters, self.starts = temperature, rng, filters, starts
        self.seen = None        # [rows, V]: the tokens each row holds, kept up to date call by call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.filters.repetition_penalty != 1.0:
            if self.seen is None:
                rows = [ids[start:] for ids, start in zip(input_ids.tolist(), self.starts)]
                self.seen = seen_tokens(rows, scores.shape[-1], scores.device)
            else:                           # the token drawn last call is the row's newest
                self.seen[torch.arange(len(input_ids), device=scores.device), input_ids[:, -1]] = True
        token = self.filters.draw(scores.float(), self.seen, self.temperature, self.rng)
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)


class HFGenerator:
    def __init__(self, engine, eos_id: int | tuple[int, ...] | None = None, pad_id: int = 0, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                 filters: Filters = Filters(), never: tuple[int, ...] = ()):
        from ..io.hf_load import parameters_on_meta
        from transformers import GenerationConfig
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ArgumentError(f"HFGenerator dtype is a floating torch dtype (torch.bfloat16, torch.float32); "
                                f"got {dtype!r}")
        policy, self.prefix = policy_of(engine)
        self.engine, self.stops, self.pad_id, self.dtype = engine, stop_ids(eos_id), pad_id, dtype
        self.filters, self.never = filters, sorted(set(never))
        self.device = torch.device(device if device is not None else
                                   "cuda" if getattr(engine.backend, "name", "cpu") == "cuda" else "cpu")
        self.rng = torch.Generator(self.device).manual_seed(seed)
        config = copy.deepcopy(policy.config)
        config.use_cache = True                 # the engine's copy turned it off for training
        with parameters_on_meta():
            self.model = type(policy)._from_config(config, dtype=dtype)
        # generate's settings are these alone: no eos, temperature or top-k from the model's own files
        self.model.generation_config = GenerationConfig(eos_token_id=list(self.stops) or None, pad_token_id=pad_id)
        self._fill()
        self._place()

    def _tensor(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The memory parameter `name` lives in: the device, for the whole copy."""
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _place(self) -> None:
        self.model.to(self.device).eval()      # the buffers (rotary inv_freq), built real on the host

    def _fill(self) -> None:
        """Each parameter its own tensor on the device, the master copied in; tied aliases share it."""
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buffers = dict(self.model.named_buffers())
        given = {}
        with torch.no_grad():
            for name, master in policy_weights(self.engine, self.prefix):
                if name in params:
                    t = self._tensor(name, master.shape,
                                     self.dtype if master.is_floating_point() else master.dtype)
                    given[name] = nn.Parameter(t.copy_(master), requires_grad=False)
                    _set(self.model, name, given[name])
                elif name in buffers:
                    buffers[name].copy_(master)
            for alias, name in tied_names(self.engine, self.prefix).items():
                if alias in params and name in given:
                    _set(self.model, alias, given[name])
        empty = [n for n, p in self.model.named_parameters() if p.is_meta]
        if empty:
            raise ArgumentError(f"the engine holds no weights for {len(empty)} of the generation copy's parameters "
                                f"({', '.join(empty[:4])}): its model and the copy built from its config differ")

    def sync(self) -> None:
        """Copy the engine's current masters into the copy, tensor by tensor (after each optimizer step)."""
        params = dict(self.model.named_parameters())
        buffers = dict(self.model.named_buffers())
        with torch.no_grad():
            for name, master in policy_weights(self.engine, self.prefix):
                target = params.get(name, buffers.get(name))
                if target is not None:
                    target.copy_(master)

    def state(self) -> torch.Tensor:
        """The sampler's state, for a checkpoint: generation resumes where it stopped."""
        return self.rng.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)

    @torch.no_grad()
    def generate(self, prompts, n, max_new_tokens, temperature=1.0, inputs=None) -> list[Completion]:
        """inputs(rows, input_ids) -> the other inputs of these rows (range over len(prompts) x n,
        prompt 0's n first), given their left-padded input_ids: a vision-language policy's images."""
        from transformers import LogitsProcessorList
        check_request(prompts, n, max_new_tokens, temperature)
        rows = [list(p) for p in prompts for _ in range(n)]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, row in enumerate(rows):          # padded on the left: every row's next token at the end
            ids[r, width - len(row):] = torch.tensor(row)
            mask[r, width - len(row):] = 1
        starts = [width - len(r) for r in rows]
        drawn = temperature > 0 or self.filters.repetition_penalty != 1.0
        processors = LogitsProcessorList([_Draw(temperature, self.rng, self.filters, starts)] if drawn else [])
        more = {} if inputs is None else {
            k: v.to(self.device, self.dtype if v.is_floating_point() else v.dtype)
            for k, v in inputs(range(len(rows)), ids).items()}
        # the prompts' prefill in chunks: what it passes stays bounded (whole with images)
        chunk = prefill_chunk(len(rows)) if not more else width
        out = self.model.generate(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), **more,
                                  do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                                  logits_processor=processors, use_cache=True, suppress_tokens=self.never or None,
                                  prefill_chunk_size=chunk if width > chunk else None)
        completions = []
        for i, tokens in enumerate(out[:, width:].tolist()):
            stopped = next((k for k, t in enumerate(tokens) if t in self.stops), None)
            if stopped is not None:
                tokens = tokens[:stopped + 1]       # what follows is generate's padding
            completions.append(Completion(i // n, tuple(prompts[i // n]), tuple(tokens)))
        return completions


def _set(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner, _, attr = name.rpartition(".")
    model.get_submodule(owner)._parameters[attr] = param
