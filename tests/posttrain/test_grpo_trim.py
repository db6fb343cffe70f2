"""Stage grpo cuts a step's rollout rows after their longest completion, to seq/8, seq/4, seq/2 or
seq (train/stages/rollout_trim.py), and the old policy's and the reference's forward-only passes
too: short prompts in rows of a long max_prompt_length log the losses, rewards and clip fractions
of whole rows (trim_padding: false)."""
from __future__ import annotations

import pytest
import torch

from megacompile.posttrain import IGNORE
from megacompile.train.stages import rollout_trim
from tests.posttrain import stage_files

PROMPT, COMPLETION = 56, 8      # rows of 64: the prompts are a sentence each, a fifth of the row or less
FIGURES = ("loss", "reward", "reward_std", "kl", "clip_ratio", "completions/mean_length")


def _run(tmp_path, monkeypatch, name: str, **more) -> tuple[list[dict], dict[str, list[int]]]:
    """The run's log rows and the widths of the input_ids handed to engine.step and to the
    forward-only passes that read labels (the old policy's, the reference's)."""
    work = stage_files.workspace(tmp_path / name)
    settings = stage_files.grpo(work, str(tmp_path / name / "run"), max_prompt_length=PROMPT,
                                max_completion_length=COMPLETION, grad_accum=2, steps_per_generation=2, steps=2,
                                beta=0.04, **more)
    # the forwards given labels: not a sampling forward, whose rows are always whole
    return stage_files.run_counting_widths(monkeypatch, settings, str(tmp_path / f"{name}.yaml"),
                                           str(tmp_path / name / "run"), labelled_only=True)


@pytest.mark.slow        # two grpo runs, 14 s
@pytest.mark.filterwarnings("error::megacompile.errors.RetraceWarning")      # the run's own few lengths
def test_short_rollouts_in_long_rows_train_on_cut_rows_as_on_whole_ones(tmp_path, monkeypatch):
    whole, whole_widths = _run(tmp_path, monkeypatch, "whole", trim_padding=False)
    cut, widths = _run(tmp_path, monkeypatch, "cut")
    assert len(cut) == len(whole) == 2
    for s, (a, b) in enumerate(zip(cut, whole)):
        for figure in FIGURES:
            assert float(a[figure]) == pytest.approx(float(b[figure]), rel=1e-5, abs=1e-6), (s, figure)
    seq = PROMPT + COMPLETION
    assert set(whole_widths["step"]) == set(whole_widths["forward"]) == {seq}
    assert len(widths["step"]) == len(whole_widths["step"]) == 4
    assert len(widths["forward"]) == len(whole_widths["forward"]) > 0
    assert max(widths["step"] + widths["forward"]) <= seq // 2
    assert set(widths["step"] + widths["forward"]) <= {seq // 8, seq // 4, seq // 2, seq}
    for a, b in zip(widths["step"][::2], widths["step"][1::2]):
        assert a == b       # a step's micro-batches at one length: one program


def test_a_step_is_cut_after_its_longest_completion_and_its_per_token_inputs_with_it():
    labels = torch.full((2, 64), IGNORE)
    labels[0, 3:9] = 5          # the longest completion's last target at column 8: 9 columns, cut to 16
    labels[1, 2:4] = 5
    part = {"input_ids": torch.arange(128).view(2, 64), "labels": labels, "old_logps": torch.randn(2, 64),
            "ref_logps": torch.randn(2, 64), "advantages": torch.tensor([1.0, -1.0]), "token_count": torch.tensor(8.)}
    other = {k: v.clone() for k, v in part.items()}
    other["labels"][1, 20] = 5  # the step's other micro-batch reaches column 20: both cut to 32
    cut = rollout_trim.step_parts([part], True)[0]
    assert {k: tuple(v.shape) for k, v in cut.items()} == {"input_ids": (2, 16), "labels": (2, 16),
                                                           "old_logps": (2, 16), "ref_logps": (2, 16),
                                                           "advantages": (2,), "token_count": ()}
    assert torch.equal(cut["old_logps"], part["old_logps"][:, :16])
    assert [p["input_ids"].shape[1] for p in rollout_trim.step_parts([part, other], True)] == [32, 32]
    assert rollout_trim.step_parts([part], False)[0]["input_ids"].shape[1] == 64


def test_a_forward_only_pass_on_cut_rows_is_padded_back_with_zeros():
    labels = torch.full((2, 32), IGNORE)
    labels[:, 1:5] = 3
    seen = []

    def engine(input_ids, labels, **media):
        seen.append(input_ids.shape[1])
        return torch.where(labels != IGNORE, 1.0, 0.0)
    out = rollout_trim.forward_logps(engine, torch.zeros(2, 32, dtype=torch.long), labels, {}, True)
    assert seen == [8] and out.shape == (2, 32) and torch.equal(out, torch.where(labels != IGNORE, 1.0, 0.0))
    rollout_trim.forward_logps(engine, torch.zeros(2, 32, dtype=torch.long), labels, {"pixel_values": 0}, True)
    assert seen == [8, 32]      # rows with images stay whole
