"""Gradient accumulation in stages sft and pt weighs each micro-batch by its target tokens, as
transformers' Trainer does with num_items_in_batch (the model's loss a sum over the micro-batch's
tokens divided by the whole step's count): a step trains the mean over all its tokens. Held against
eager transformers given num_items_in_batch, on records of different lengths, where the mean of the
micro-batches' means (each weighted 1/grad_accum) trains measurably otherwise."""
from __future__ import annotations

import os

import torch

from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, float64_noise
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

SEQ, K, STEPS = 40, 2, 3


def _eager(model, c, rows, by_tokens: bool) -> list[float]:
    """The run's micro-batches (one row each, in the run's order) trained with torch.optim.AdamW,
    each micro-batch's loss given num_items_in_batch (the Trainer's way), or divided by K."""
    opt = torch.optim.AdamW(finetune_runs.trainer_groups(model, 0.0), lr=c.lr, betas=tuple(c.betas), eps=c.eps)
    logged = []
    for step in range(STEPS):
        group = [packing.batch(rows, step * K + j, 1, shifted=False) for j in range(K)]
        items = sum(int((b["labels"][:, 1:] != -100).sum()) for b in group)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for b in group:
            loss = model(**b, num_items_in_batch=torch.tensor(items)).loss if by_tokens else model(**b).loss / K
            loss.backward()
            total += loss.item()
        opt.step()
        logged.append(total)
    return logged


def test_micro_batches_weigh_their_tokens_as_the_trainer_weighs_them(tmp_path):
    from transformers import AutoModelForCausalLM
    model = files.model_dir(str(tmp_path / "llama"), dim=32)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), model=model, data=[files.chats(str(tmp_path / "c.jsonl"))],
                            seq=SEQ, batch=1, grad_accum=K, steps=STEPS, lr=1e-2, schedule="constant",
                            max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"), log_every=1,
                            save_every=STEPS), [])
    run(c)
    from megacompile.train.data.tokens import load_tokenizer, token_file
    tok = load_tokenizer(c.model)
    rows = packing.Rows(token_file(str(tmp_path / "tokens"), "train", c.data, tok, c.model, c.train_on_prompt),
                        SEQ, c.packing, c.seed, pad_id=tok.pad_token_id)
    counts = [packing.target_count(packing.batch(rows, i, 1, shifted=False), shifted=False) for i in range(K * STEPS)]
    assert len(set(counts)) > 1        # micro-batches of different token counts: the weighting shows

    def built():
        return AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32)
    eager, start = built(), {n: p.detach().clone() for n, p in built().named_parameters()}
    losses = _eager(eager, c, rows, by_tokens=True)
    ours = torch.tensor([float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))])
    torch.testing.assert_close(ours, torch.tensor(losses), rtol=1e-5, atol=0)

    def train_again(exact):
        exact.load_state_dict({n: w.double() for n, w in start.items()})
        _eager(exact, c, rows, by_tokens=True)
    noise = float64_noise(train_again, eager, eager)
    tol = max(1e-5, WEIGHT_NOISE_FACTOR * noise)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", f"step-{STEPS:06d}"), "master")
    for name, p in eager.named_parameters():
        err = (masters[name] - p.detach()).abs().max() / p.detach().abs().max()
        assert err <= tol, f"{name}: {err:.3g} (tolerance {tol:.3g})"

    # The mean of the micro-batches' means trains another model, far outside that tolerance.
    means = built()
    _eager(means, c, rows, by_tokens=False)
    assert max((masters[n] - p.detach()).abs().max() / p.detach().abs().max()
               for n, p in means.named_parameters()) > 10 * tol
