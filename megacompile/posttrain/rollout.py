"""Rollouts behind one interface: `generate(prompts, n, max_new_tokens, temperature)` -> completions
with their token ids. `EngineGenerator` samples from the policy the engine trains, by its
forward-only pass at a fixed row length (prompt + max_new_tokens): a causal model's logits at a
position do not depend on what follows it, so each new token is one forward of the same shape,
planned once, under the same budget, with no second copy of the weights. It is slow (no key-value
cache: every token recomputes the row) and works at any size. Each token is drawn through the
sampling filters (sampling_filters.py).

A vision-language policy's rows carry their images: `inputs(rows, input_ids)` gives the image
inputs of a call's rows (the generation's row numbers), made once per call and handed to every
forward of it. The tokens that stand for image features (`never`) are never drawn: a completion
holding one would ask the model for an image it was not shown, in this forward and in every
training forward of the completion."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ..errors import ArgumentError
from .sampling_filters import Filters, seen_tokens


@dataclass(frozen=True)
class Completion:
    prompt_index: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]        # the completion, up to and including a stop token (stop_ids)
    # the sampler's log-probability of each token, where it reports them (vLLM); None for a token
    # it did not score (a stop token it left out of its reply)
    logprobs: tuple[float | None, ...] | None = None


class Generator(Protocol):
    def generate(self, prompts: list[list[int]], n: int, max_new_tokens: int, temperature: float) -> list[Completion]:
        """n completions of each prompt, consecutive (prompt 0's n first)."""


def stop_ids(eos_id) -> tuple[int, ...]:
    """The ids a completion ends at: `eos_id` one id, several (as a generation config's
    eos_token_id: Gemma's <eos> and <end_of_turn>), or None (none: max_new_tokens ends it)."""
    if eos_id is None:
        return ()
    return (eos_id,) if isinstance(eos_id, int) else tuple(sorted(set(eos_id)))


def check_request(prompts, n, max_new_tokens, temperature) -> None:
    if not prompts or n < 1 or max_new_tokens < 1:
        raise ArgumentError(f"generate needs prompts, n >= 1 and max_new_tokens >= 1; got {len(prompts)} prompts, "
                            f"n={n}, max_new_tokens={max_new_tokens}")
    if temperature < 0:
        raise ArgumentError(f"temperature must be >= 0 (0: greedy); got {temperature}")


class EngineGenerator:
    def __init__(self, engine, eos_id: int | tuple[int, ...] | None = None, pad_id: int = 0, seed: int = 0,
                 filters: Filters = Filters(), never: tuple[int, ...] = ()):
        """filters: top_k, top_p, min_p and repetition_penalty (sampling_filters.py); never: token
        ids no completion holds (a vision-language model's image tokens)."""
        self.engine, self.stops, self.pad_id, self.filters = engine, stop_ids(eos_id), pad_id, filters
        self.never = torch.tensor(sorted(set(never)), dtype=torch.long)
        self.rng = torch.Generator().manual_seed(seed)

    def state(self) -> torch.Tensor:
        """The sampler's state, for a checkpoint: generation resumes where it stopped."""
        return self.rng.get_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.rng.set_state(state)

    def generate(self, prompts, n, max_new_tokens, temperature=1.0, width: int | None = None,
                 rows_per_call: int | None = None, inputs=None) -> list[Completion]:
        """width: the rows' length (at least the longest prompt + max_new_tokens); one width for
        every call plans generation once (the padding after a row's end does not change its logits).
        rows_per_call: the rows each forward takes (a divisor of len(prompts) x n; all of them by
        default), so that a larger rollout batch is sampled in the shape of one micro-batch.
        inputs(rows, input_ids) -> the other inputs of a call over these rows (range(start, stop)
        of the len(prompts) x n, prompt 0's n first), given its first input_ids; None: none."""
        check_request(prompts, n, max_new_tokens, temperature)
        rows = [list(p) for p in prompts for _ in range(n)]
        longest = max(len(r) for r in rows) + max_new_tokens
        if width is not None and width < longest:
            raise ArgumentError(f"generate: rows of width {width} cannot hold a prompt of {longest - max_new_tokens} "
                                f"tokens and {max_new_tokens} new ones")
        width = longest if width is None else width
        step = len(rows) if rows_per_call is None else rows_per_call
        if step < 1 or len(rows) % step:
            raise ArgumentError(f"generate: {len(rows)} rows do not split into calls of rows_per_call={rows_per_call}")
        out = [t for start in range(0, len(rows), step)
               for t in self._sample(rows[start:start + step], width, max_new_tokens, temperature,
                                     None if inputs is None else lambda ids, s=start: inputs(range(s, s + step), ids))]
        return [Completion(i // n, tuple(prompts[i // n]), tuple(tokens)) for i, tokens in enumerate(out)]

    def _sample(self, rows: list[list[int]], width: int, max_new_tokens: int, temperature: float,
                inputs=None) -> list[list[int]]:
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, :len(row)] = torch.tensor(row)
        # the prompts' image inputs, the same for each new token: the new tokens are text
        more = {} if inputs is None else inputs(ids)
        length = torch.tensor([len(r) for r in rows])
        done = torch.zeros(len(rows), dtype=torch.bool)
        out: list[list[int]] = [[] for _ in rows]
        seen = None
        for _ in range(max_new_tokens):
            logits = torch.as_tensor(self.engine(input_ids=ids, last=length - 1, **more)).float()
            if len(self.never):     # out of place: the engine's output is its own
                logits = logits.index_fill(1, self.never, float("-inf"))
            if seen is None and self.filters.repetition_penalty != 1.0:
                seen = seen_tokens(rows, logits.shape[-1])
            token = self.filters.draw(logits, seen, temperature, self.rng)
            for r in range(len(rows)):
                if done[r]:
                    continue
                t = int(token[r])
                if seen is not None:
                    seen[r, t] = True
                out[r].append(t)
                ids[r, length[r]] = t
                length[r] += 1
                done[r] = t in self.stops
            if bool(done.all()):
                break
        return out
