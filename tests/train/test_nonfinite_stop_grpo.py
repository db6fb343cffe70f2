"""A run of stage grpo stopped by a step whose loss is inf or NaN (on_nonfinite: raise) names the
records of the prompts whose completions the micro-batch that failed held, by file and line, in
the words the other stages name theirs (test_nonfinite_stop_preference.py): its rows followed back
to their prompts, the rollout batch shuffled into micro-batches or not."""
from __future__ import annotations

import json
import re

import pytest

from megacompile.errors import NonFiniteError
from megacompile.runtime import executor
from megacompile.train import load, run
from tests.train import files

POISONED = 8        # the line of the poisoned record
TIMES = 4           # its prompt ends in this many poison words: more than a completion's tokens


def _poison_rows_holding(monkeypatch, token: int) -> None:
    """A training micro-batch with a row holding `token` TIMES times has a NaN loss: the rows of the
    poisoned prompt, and no row whose completion alone drew the token (max_completion_length 3)."""
    ran = executor.Executor.run

    def poisoned(self, inputs, seed=1.0, context=None, check_loss=False):
        out = ran(self, inputs, seed, context, check_loss)
        if check_loss and any(getattr(t, "dtype", None) is not None and not t.is_floating_point() and t.dim() == 2
                              and ((t == token).sum(-1) >= TIMES).any()
                              for t in (inputs if isinstance(inputs, list) else [inputs])):
            raise executor.NonFiniteLoss(float("nan"), out)
        return out
    monkeypatch.setattr(executor.Executor, "run", poisoned)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = files.tokenizer(words=["poison"])
    return files.model_dir(str(tmp_path_factory.mktemp("model")), layers=1, dim=32, tok=tok), \
        tok.convert_tokens_to_ids("poison")


# A rollout batch of 2 prompts x 2 completions, one micro-batch of 4 rows; or of 4 prompts, shuffled
# into 4 micro-batches of 2 rows, one or two a step: a micro-batch holds 1 or 2 of its 4 prompts.
# `steps` draw every one of the 10 prompts.
@pytest.mark.parametrize("batch, steps_per_generation, grad_accum, steps", [(4, 1, 1, 5), (2, 4, 1, 12),
                                                                             (2, 4, 2, 6)])
def test_a_poisoned_prompt_of_grpo_is_named(tmp_path, monkeypatch, model, batch, steps_per_generation, grad_accum,
                                            steps):
    folder, poison = model
    data = str(tmp_path / "prompts.jsonl")
    with open(data, "w") as f:
        f.writelines(json.dumps({"prompt": s + " poison" * TIMES * (i + 1 == POISONED)}) + "\n"
                     for i, s in enumerate(files.SENTENCES))
    _poison_rows_holding(monkeypatch, poison)
    with pytest.raises(NonFiniteError) as caught:
        run(load(files.run_yaml(str(tmp_path / "run.yaml"), model=folder, stage="grpo", data=data, batch=batch,
                                num_generations=2, steps_per_generation=steps_per_generation, grad_accum=grad_accum,
                                max_prompt_length=10, max_completion_length=3, reward_funcs=["format_check"],
                                steps=steps, device="cpu", hbm_budget=1, run_dir=str(tmp_path / "run"),
                                on_nonfinite="raise"), []))
    message = str(caught.value)
    assert re.match(r"step \d+ failed: the loss is nan, and on_nonfinite: raise stops the run", message), message
    # the micro-batch alone, the prompts its rows complete, and the poisoned prompt's record among them
    said = re.search(rf"; the micro-batch that failed \(completions of (prompt \d+|prompts \d+ (to|and) \d+) of the "
                     rf"run\) held the records? {re.escape(data)}(:(\d+)|( \(lines ([0-9, ]+)\)));", message)
    assert said, message
    lines = [int(said[4])] if said[4] else [int(n) for n in said[6].split(", ")]
    assert POISONED in lines and len(lines) <= 2, message      # its rows complete 2 prompts at most
    if steps_per_generation == 1:       # unshuffled: each prompt's 2 completions side by side
        first, last = map(int, re.fullmatch(r"prompts (\d+) to (\d+)", said[1]).groups())
        assert last == first + 1, message
    assert message.endswith("or look at the records named, mend or drop the bad one, and start a new run_dir (a "
                            "resume refuses changed data)")
