"""How stage kto fits an example (prompt, completion) into rows of seq tokens (TRL's max_length),
as TRL's KTOTrainer fits it, whose keys differ in meaning from DPOTrainer's (truncation.py):

    default                a row longer than seq keeps its first seq tokens, and an example whose
                           prompt alone fills seq is dropped before the KL rows are paired (TRL 0.29
                           and later: KTOConfig has no truncation_mode, max_prompt_length or
                           max_completion_length)
    max_prompt_length      (KTOConfig's key up to TRL 0.26) only where prompt + completion is longer
                           than seq: the prompt is cut to max_prompt_length tokens, and if the row is
                           still too long, the completion keeps its first seq - max_prompt_length
                           tokens, whatever the prompt's own length
    truncation_mode        (likewise) which end of the prompt that cut keeps: keep_end, 0.26's
                           default and the one taken where max_prompt_length is given alone, its last
                           tokens; keep_start its first. It cuts nothing without max_prompt_length,
                           so keep_end is refused without it

max_completion_length cuts nothing, with a note: KTOConfig's cut only an encoder-decoder's completions. An example
left with no completion token (a prompt filling seq, or max_prompt_length at seq or above) is dropped,
as TRL drops it. A KL row (a prompt with another example's completion) is fitted by the same rule.
TRL up to 0.26 counted a BOS and an EOS it added into max_length; rows here hold what the template
writes, and nothing is added. A prompt with images is never cut (truncation.py)."""
from __future__ import annotations

from ...errors import ArgumentError
from .checks import note
from .truncation import Cuts


def check(c, mode_given: bool) -> None:
    """Stage kto's max_prompt_length, max_completion_length and truncation_mode, in place (their
    defaults already filled in; `mode_given`: run.yaml gave truncation_mode)."""
    if c.max_prompt_length is not None and not mode_given:
        c.truncation_mode = "keep_end"      # KTOConfig's default where it had max_prompt_length (up to TRL 0.26)
    if c.max_completion_length is not None:      # a KTOConfig of TRL 0.26 or before runs as written
        note(f"stage kto: max_completion_length {c.max_completion_length} cuts nothing, as TRL's KTOTrainer cut only "
             "an encoder-decoder's completions by it (up to TRL 0.26; later ones have no such key): a decoder's row "
             "of prompt + completion keeps its first seq tokens (max_length)")
        c.max_completion_length = None
    if c.truncation_mode == "keep_end" and c.max_prompt_length is None:
        raise ArgumentError("stage kto: truncation_mode keep_end keeps the last max_prompt_length tokens of a prompt "
                            "whose row is longer than seq (KTOConfig's meaning up to TRL 0.26, whose "
                            "max_prompt_length was 512), and cuts nothing without it: give max_prompt_length, or "
                            "leave truncation_mode out (a row keeps its first seq tokens, as TRL's KTOTrainer cuts it)")


def fitted(prompt: tuple, completion: tuple, seq: int, most_prompt: int | None, mode: str) -> tuple[tuple, tuple]:
    """(prompt, completion) cut by KTO's rule (above); the row may still pass seq where no
    max_prompt_length is given: it keeps its first seq tokens when packed."""
    if most_prompt is None or len(prompt) + len(completion) <= seq:
        return prompt, completion
    prompt = prompt[:most_prompt] if mode == "keep_start" else prompt[-most_prompt:]
    if len(prompt) + len(completion) > seq:
        completion = completion[:max(0, seq - most_prompt)]
    return prompt, completion


class ExampleCuts(Cuts):
    """Stage kto's cuts and how many examples each touched."""

    def __init__(self, c):
        super().__init__(c, "example")

    def fit(self, prompt: tuple, completions: tuple, where: str, shown: bool) -> tuple | None:
        """(prompt, (completion,)) fitted by KTO's rule, or None where the example is dropped;
        `shown`: its prompt holds images, which no cut may reach."""
        (completion,) = completions
        if self.most_prompt is not None and len(prompt) + len(completion) > self.seq:
            if shown and len(prompt) > self.most_prompt:
                raise ArgumentError(f"{where}: the prompt is {len(prompt)} tokens with its images, and its row is "
                                    f"longer than seq {self.seq}: max_prompt_length {self.most_prompt} would cut its "
                                    "images' tokens; raise max_prompt_length or seq (max_length), or scale the images "
                                    "down (image_max_pixels)")
            cut, short = fitted(prompt, completion, self.seq, self.most_prompt, self.mode)
            self.prompts += len(cut) < len(prompt)
            self.completions += len(short) < len(completion)
            prompt, completion = cut, short
        if len(prompt) >= self.seq or not completion:
            if shown:
                raise ArgumentError(f"{where}: the prompt is {len(prompt)} tokens with its images, which fills rows "
                                    f"of seq {self.seq} and leaves no room for its completion (a cut would cut its "
                                    "images' tokens); raise seq (max_length), or scale the images down "
                                    "(image_max_pixels)")
            self.dropped += 1
            return None
        self.rows += len(prompt) + len(completion) > self.seq
        return prompt, (completion,)

    def kl_row(self, prompt: tuple, completion: tuple, shown: bool) -> tuple[tuple, tuple]:
        """A KL row's (prompt, completion) fitted by the same rule (a prompt with images left whole:
        the row keeps its first seq tokens)."""
        return (prompt, completion) if shown else fitted(prompt, completion, self.seq, self.most_prompt, self.mode)

    def lines(self) -> list[str]:
        said = []
        if self.prompts:
            said.append(f"the prompts of {self._count(self.prompts)} longer than seq {self.seq} cut to their "
                        f"{'first' if self.mode == 'keep_start' else 'last'} {self.most_prompt} tokens "
                        f"(max_prompt_length, truncation_mode {self.mode})")
        if self.completions:
            said.append(f"the completions of {self._count(self.completions)} cut to their first "
                        f"{self.seq - self.most_prompt} tokens (seq - max_prompt_length)")
        if self.dropped:
            said.append(f"{self._count(self.dropped)} dropped, no completion token left in rows of seq {self.seq} "
                        "(as TRL drops it)")
        if self.rows:
            said.append(f"{self._count(self.rows)} longer than seq {self.seq}, cut to their first {self.seq} tokens")
        return [f"truncation     {'; '.join(said)}"] if said else []

    def none_left(self) -> str:
        if not self.dropped:
            return ""
        return (f": its {self._count(self.dropped)} each leave no completion token in rows of seq {self.seq}, and "
                "are dropped as TRL drops them; raise seq (max_length), or give max_prompt_length below it")
