"""KTO's loss (TRL's KTOTrainer: kto and apo_zero_unpaired), its KL estimate and TRL's pairing of
each prompt with another completion, and the feedback records stage kto reads."""
from __future__ import annotations

import math

import pytest
import torch

from megacompile.errors import ArgumentError
from megacompile.posttrain import KTOLoss, kl_estimate, kto_loss, token_logprobs
from megacompile.train.data import feedback
from megacompile.train.stages.kto import kl_partners

sigmoid = lambda x: 1 / (1 + math.exp(-x))      # noqa: E731


def test_kto_loss_is_the_papers_value_function_around_the_kl_estimate():
    policy, ref = torch.tensor([-1.0, -2.0, -3.0]), torch.tensor([-1.5, -1.0, -3.25])
    desirable, kl, beta = torch.tensor([1.0, 0.0, 0.0]), 0.2, 0.5
    got = kto_loss(policy, ref, desirable, kl, beta, desirable_weight=1.3, undesirable_weight=0.7)
    want = [1.3 * (1 - sigmoid(beta * (0.5 - kl))), 0.7 * (1 - sigmoid(beta * (kl + 1.0))),
            0.7 * (1 - sigmoid(beta * (kl - 0.25)))]
    assert got.tolist() == pytest.approx(want, rel=1e-6)
    apo = kto_loss(policy, ref, desirable, kl, beta, loss_type="apo_zero_unpaired")     # no KL term
    assert apo.tolist() == pytest.approx([1 - sigmoid(0.25), sigmoid(-0.5), sigmoid(0.125)], rel=1e-6)
    # its gradient raises a desirable completion's log-probability and lowers an undesirable one's
    p = policy.clone().requires_grad_()
    kto_loss(p, ref, desirable, kl, beta).sum().backward()
    assert p.grad[0] < 0 < p.grad[1] and p.grad[2] > 0


def test_the_kl_estimate_is_the_mean_log_ratio_at_least_zero_and_constant():
    policy = torch.tensor([-1.0, -2.0], requires_grad=True)
    assert kl_estimate(policy, torch.tensor([-1.5, -2.1])).item() == pytest.approx(0.3)
    assert kl_estimate(policy, torch.tensor([-0.5, -1.0])).item() == 0.0
    assert not kl_estimate(policy, torch.tensor([-1.5, -2.1])).requires_grad


def test_the_loss_of_logits_is_that_of_their_summed_completion_log_probabilities():
    torch.manual_seed(0)
    logits, labels = torch.randn(3, 6, 11), torch.randint(0, 11, (3, 6))
    labels[:, :2] = -100
    logps, _ = token_logprobs(logits, labels)
    ref, desirable, kl = torch.randn(3), torch.tensor([1.0, 0.0, 1.0]), torch.tensor(0.4)
    loss = KTOLoss(beta=0.3, undesirable_weight=2.0)
    assert loss(logits, labels, ref, desirable, kl).item() == pytest.approx(
        loss.examples(logps.sum(-1), ref, desirable, kl).mean().item(), rel=1e-6)
    with pytest.raises(ArgumentError, match="KTO loss_type must be one of kto, apo_zero_unpaired; got 'sigmoid'"):
        KTOLoss(loss_type="sigmoid")
    with pytest.raises(ArgumentError, match="KTO desirable_weight must be a positive number"):
        KTOLoss(desirable_weight=0)


def test_pref_ftx_adds_the_desirable_nll_per_token_rescaled_as_llamafactory_does():
    """LlamaFactory's KTO trainer: losses.nanmean() + ftx x mean over the desirable completions of
    -log pi(y) / n, divided by their count and times the micro-batch's size; nothing where none is
    desirable."""
    torch.manual_seed(1)
    logits, labels = torch.randn(4, 7, 11), torch.randint(0, 11, (4, 7))
    labels[:, :2] = -100
    labels[0, -3:] = -100                                  # completions of different lengths
    logps, mask = token_logprobs(logits, labels)
    seq, n = logps.sum(-1), mask.sum(-1)
    ref, kl = torch.randn(4), torch.tensor(0.3)
    plain, ftx = KTOLoss(beta=0.3), KTOLoss(beta=0.3, ftx=0.7)
    for desirable in (torch.tensor([1.0, 0.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 1.0, 1.0])):
        chosen = [i for i in range(4) if desirable[i]]
        sft = sum(-seq[i].item() / n[i].item() for i in chosen) / len(chosen)       # sft_loss.nanmean()
        want = plain(logits, labels, ref, desirable, kl).item() + 0.7 * sft / len(chosen) * 4
        assert ftx(logits, labels, ref, desirable, kl).item() == pytest.approx(want, rel=1e-6)   # fp32 logps
    none = torch.zeros(4)
    assert ftx(logits, labels, ref, none, kl).item() == plain(logits, labels, ref, none, kl).item()
    with pytest.raises(ArgumentError, match="KTO pref_ftx .* must be a number >= 0; got -1"):
        KTOLoss(ftx=-1)


def test_each_prompt_takes_the_completion_before_it_in_chunks_of_the_batch():
    assert kl_partners(5, 2) == [1, 0, 3, 2, 4]       # the last chunk of one takes its own
    assert kl_partners(6, 3) == [2, 0, 1, 5, 3, 4]


CHAT = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine"}]


@pytest.mark.parametrize("record, want", [
    ({"prompt": "the cat", "completion": " sat", "label": True}, ("the cat", " sat", True)),
    ({"prompt": CHAT[:1], "completion": CHAT[1:], "label": False}, (CHAT[:1], CHAT[1:], False)),
    # LlamaFactory's kto_tag datasets (the column renamed to label): the last answer is judged
    ({"conversations": [{"from": "human", "value": "hello there"}, {"from": "gpt", "value": "i am fine"}],
      "system": "be kind", "label": True},
     ([{"role": "system", "content": "be kind"}, CHAT[0]], CHAT[1:], True)),
    ({"instruction": "hello", "input": "there", "output": "i am fine", "label": False},
     ([{"role": "user", "content": "hello\nthere"}], CHAT[1:], False)),
])
def test_feedback_records_are_read_as_trls_unpaired_layout(record, want):
    got = feedback.example(record, "x.jsonl line 1")
    assert (got["prompt"], got["completion"], got["label"]) == want


def test_a_paired_record_is_two_examples_the_chosen_one_desirable():
    got = feedback.unpaired({"prompt": "the sky is", "chosen": " blue", "rejected": " green"}, "x.jsonl line 1")
    assert got == [{"prompt": "the sky is", "completion": " blue", "label": True},
                   {"prompt": "the sky is", "completion": " green", "label": False}]


@pytest.mark.parametrize("record, words", [
    ({"prompt": "a", "completion": "b"}, "has no label (kto_tag)"),
    ({"prompt": "a", "completion": "b", "label": "yes"}, "true or false; got 'yes'"),
    ({"messages": CHAT[:1] + [{"role": "user", "content": "and you"}], "label": True},
     "ends with the assistant's answer"),
    ({"prompt": CHAT[:1], "completion": "i am fine", "label": True}, "both text or both lists of messages"),
    ({"prompt": " ", "completion": "b", "label": True}, "the prompt is empty"),
    ({"text": "a", "label": True}, "a KTO record is TRL's unpaired"),
])
def test_a_record_stage_kto_cannot_read_is_refused_by_line(record, words):
    with pytest.raises(ArgumentError, match="x.jsonl line 4") as e:
        feedback.example(record, "x.jsonl line 4")
    assert words in str(e.value)


def test_a_reference_file_the_disk_refuses_leaves_nothing_and_names_the_disk(tmp_path, monkeypatch):
    import errno
    import os

    from megacompile.errors import CheckpointError
    from megacompile.train.stages import reference

    def full(obj, path):
        with open(path, "wb") as f:
            f.write(b"part")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError, match="reference log-probabilities .* the disk is full"):
        reference.keep(str(tmp_path), torch.zeros(4, 2), None, {"train": "x"})
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    reference.keep(str(tmp_path), torch.ones(4, 2), None, {"train": "x"})
    assert reference.kept(str(tmp_path), {"train": "x"}, "examples")["train"].sum().item() == 8


@pytest.mark.parametrize("eval_batch", [None, 3])
def test_the_held_out_loss_estimates_the_kl_over_each_eval_batch_as_trl_does(eval_batch):
    """TRL's KTO evaluates in batches of per_device_eval_batch_size (eval_batch; batch without it):
    each batch's KL estimate from its own KL rows, its loss weighted by its rows."""
    from types import SimpleNamespace

    from megacompile.train.stages.kto import KTOStage
    torch.manual_seed(0)
    n, beta = 5, 0.5
    policy, ref = -torch.rand(n, 2) * 3, -torch.rand(n, 2) * 3      # (example, [completion, its KL row])
    policy[:, 1] = ref[:, 1] + torch.tensor([0.1, 2.0, 0.3, 1.5, 0.2])     # KL estimates above 0, each batch's own
    desirable = [True, False, True, True, False]
    stage = KTOStage.__new__(KTOStage)
    stage.c = SimpleNamespace(batch=2, eval_batch=eval_batch, beta=beta)
    stage.loss = KTOLoss(beta, 1.0, 1.0, "kto", 0.0)
    held = [SimpleNamespace(desirable=d) for d in desirable]
    stage.held_out = lambda engine, step, logps: (held, ref, policy)
    stage._lengths = lambda examples: torch.ones(len(examples))
    got = stage.evaluate(None, 1)["eval_loss"]
    step, total = eval_batch or 2, 0.0
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        kl = max(0.0, float((policy[part, 1] - ref[part, 1]).mean()))
        losses = kto_loss(policy[part, 0], ref[part, 0], torch.tensor(desirable[part], dtype=torch.float32), kl, beta)
        total += losses.mean().item() * len(desirable[part])
    assert got == pytest.approx(total / n, rel=1e-6)
