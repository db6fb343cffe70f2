"""How stage dpo and stage kto fit a pair (or an example) into rows of seq tokens (TRL's max_length),
with TRL's keys and meanings:

    max_prompt_length      a longer prompt keeps its last tokens (DPOConfig and KTOConfig up to TRL
                           0.28; none by default, as TRL 0.29 and later have no such key)
    max_completion_length  a longer completion keeps its first tokens (likewise)
    truncation_mode        keep_start (TRL's default since 0.29): prompt + completion keeps its first
                           seq tokens, and a pair whose prompt alone fills seq is dropped, as TRL drops
                           it (no completion token would be left to score); keep_end: its last seq
                           tokens, nothing dropped (the row's first token, read with no context before
                           it, is not scored)

The prompt is cut before the completions, and the row at seq after both, as TRL up to 0.28 cut them
(tokenize_row, then max_length). A prompt with images is never cut: the processor's pixels fill its
image tokens one for one, so a pair whose prompt with its images is longer than max_prompt_length or
fills seq, or whose row keep_end would cut, is refused by its record. The tally counts the pairs each
rule touched, for the stage's start lines."""
from __future__ import annotations

from ...errors import ArgumentError
from ..config_values import integer

MODES = ("keep_start", "keep_end")


def check(c) -> None:
    """truncation_mode, max_prompt_length and max_completion_length of stage dpo or kto, in place
    (their defaults already filled in)."""
    if c.truncation_mode not in MODES:
        raise ArgumentError(f"truncation_mode must be one of {', '.join(MODES)} (TRL's: which end of a row longer "
                            f"than seq, max_length, is kept; keep_start, the default, drops a pair whose prompt alone "
                            f"fills the row); got {c.truncation_mode!r}")
    for key in ("max_prompt_length", "max_completion_length"):
        if getattr(c, key) is not None:
            setattr(c, key, integer(key, getattr(c, key)))


class Cuts:
    """One stage's cuts (the keys above) and how many pairs each touched; `unit`: what the stage
    calls a pair ("pair", "example")."""

    def __init__(self, c, unit: str):
        self.seq, self.mode, self.unit = c.seq, c.truncation_mode, unit
        self.most_prompt, self.most_completion = c.max_prompt_length, c.max_completion_length
        self.prompts = self.completions = self.rows = self.dropped = 0

    def fit(self, prompt: tuple, completions: tuple, where: str, shown: bool) -> tuple | None:
        """(prompt, completions) cut by max_prompt_length and max_completion_length, or None where
        keep_start drops the pair; `shown`: its prompt holds images, which no cut may reach."""
        if self.most_prompt is not None and len(prompt) > self.most_prompt:
            if shown:
                raise ArgumentError(f"{where}: the prompt is {len(prompt)} tokens with its images, past "
                                    f"max_prompt_length {self.most_prompt}: cutting it would cut its images' tokens; "
                                    "raise max_prompt_length, or scale the images down (image_max_pixels)")
            prompt = prompt[-self.most_prompt:]
            self.prompts += 1
        if self.most_completion is not None and any(len(x) > self.most_completion for x in completions):
            completions = tuple(x[:self.most_completion] for x in completions)
            self.completions += 1
        if len(prompt) >= self.seq and self.mode == "keep_start":
            if shown:
                raise ArgumentError(f"{where}: the prompt is {len(prompt)} tokens with its images, which fills rows "
                                    f"of seq {self.seq} and leaves no room for its completions (a cut would cut its "
                                    "images' tokens); raise seq (max_length), or scale the images down "
                                    "(image_max_pixels)")
            self.dropped += 1
            return None
        if any(len(prompt) + len(x) > self.seq for x in completions):
            if shown and self.mode == "keep_end":
                raise ArgumentError(f"{where}: the prompt with its images and a completion are "
                                    f"{len(prompt) + max(map(len, completions))} tokens, past rows of seq {self.seq}, "
                                    "and truncation_mode keep_end would cut the prompt's start, its images' tokens "
                                    "with it (TRL refuses keep_end with images); give truncation_mode keep_start, or "
                                    "raise seq (max_length)")
            self.rows += 1
        return prompt, completions

    def none_left(self) -> str:
        """Why a data file left no pair, where keep_start dropped them all ("" otherwise)."""
        if not self.dropped:
            return ""
        return (f": the prompts of its {self._count(self.dropped)} each fill rows of seq {self.seq}, and "
                "truncation_mode keep_start drops them as TRL does; raise seq (max_length), give max_prompt_length "
                "below it, or truncation_mode keep_end")

    def lines(self) -> list[str]:
        """The start line saying what was cut or dropped (none where nothing was)."""
        said = []
        if self.prompts:
            said.append(f"the prompts of {self._count(self.prompts)} cut to their last {self.most_prompt} tokens "
                        "(max_prompt_length)")
        if self.completions:
            said.append(f"the completions of {self._count(self.completions)} cut to their first "
                        f"{self.most_completion} tokens (max_completion_length)")
        if self.dropped:
            said.append(f"{self._count(self.dropped)} dropped, a prompt filling rows of seq {self.seq} (keep_start "
                        "drops it, as TRL does)")
        if self.rows:
            said.append(f"{self._count(self.rows)} longer than seq {self.seq}, cut to their "
                        f"{'first' if self.mode == 'keep_start' else 'last'} {self.seq} tokens ({self.mode})")
        return [f"truncation     {'; '.join(said)}"] if said else []

    def _count(self, n: int) -> str:
        return f"{n} {self.unit}" + ("" if n == 1 else "s")
