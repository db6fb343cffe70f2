"""A tiny model learns a preference by DPO through megacompile: the chosen completion repeats the
prompt's first token, the rejected one is random. Held-out preference accuracy from chance to > 0.9."""
import random

import pytest
import torch

from megacompile import AdamW, compile
from megacompile.errors import ArgumentError
from megacompile.models.llama import LlamaConfig, TinyLlama
from megacompile.posttrain import DPOLoss, DPOObjective
from megacompile.posttrain.logprobs import IGNORE
from megacompile.posttrain.preference import Pair, pack, preference_metrics, reference_logps

V, SEQ = 32, 10


def _pairs(n: int, seed: int) -> list[Pair]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = tuple(rng.randrange(2, V) for _ in range(4))
        chosen = (prompt[0],) * 3 + (1,)
        rejected = tuple(rng.randrange(2, V) for _ in range(3)) + (1,)
        out.append(Pair(prompt, chosen, rejected))
    return out


def test_pack_puts_chosen_rows_first_and_counts_the_completions_only():
    pairs = [Pair((5, 6, 7), (8, 9), (10,)), Pair((3,), (4, 4, 4), (2, 2))]
    batch = pack(pairs, seq=4)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [3, 4, 4, 4], [5, 6, 7, 10], [3, 2, 2, 0]]
    # the first chosen row is 5 tokens: cut at seq 4 (TRL's keep_start), its last completion token 9 is gone
    assert batch["labels"].tolist() == [[IGNORE, IGNORE, 8, IGNORE], [4, 4, 4, IGNORE], [IGNORE, IGNORE, 10, IGNORE],
                                        [2, 2, IGNORE, IGNORE]]
    for prompt in (5, 4):       # a prompt of seq tokens or more leaves no completion token (TRL drops it)
        with pytest.raises(ArgumentError, match="no room for its completion"):
            pack([Pair((1,) * prompt, (2,), (3,))], seq=4)


def _trl_scored(prompt: tuple, completion: tuple, max_length: int) -> list[int]:
    """The completion tokens TRL 1.16's DPOTrainer (and KTOTrainer) scores, written out from its
    collator and loss: completion_mask = [0] x prompt + [1] x completion, prompt + completion and
    the mask cut to [:max_length] (keep_start), then the model's logits at t predict token t + 1, so
    the tokens scored are those of input_ids[1:] where completion_mask[1:] is 1."""
    ids = list(prompt + completion)[:max_length]
    mask = ([0] * len(prompt) + [1] * len(completion))[:max_length]
    return [tok for tok, m in zip(ids[1:], mask[1:]) if m]


@pytest.mark.parametrize("seq", [6, 9, 10, 13, 20])
def test_rows_score_the_completion_tokens_trl_keeps_at_max_length(seq):
    rng = random.Random(seq)
    pairs = [Pair(tuple(rng.randrange(2, V) for _ in range(rng.randrange(1, 6))),
                  tuple(rng.randrange(2, V) for _ in range(rng.randrange(1, 20))),
                  tuple(rng.randrange(2, V) for _ in range(rng.randrange(1, 20)))) for _ in range(16)]
    # rows of seq + 1 and seq tokens: one completion token past max_length, then none
    pairs.append(Pair((3, 4, 5), tuple(range(2, seq)), tuple(range(2, seq - 1))))
    batch = pack(pairs, seq=seq, pad_id=0)
    rows = [(p.prompt, p.chosen) for p in pairs] + [(p.prompt, p.rejected) for p in pairs]
    assert batch["input_ids"].shape == batch["labels"].shape == (len(rows), seq)
    for (prompt, completion), labels in zip(rows, batch["labels"].tolist()):
        want = _trl_scored(prompt, completion, seq)
        assert len(want) == min(len(completion), seq - len(prompt))
        assert [t for t in labels if t != IGNORE] == want


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy_above_0_9():
    torch.manual_seed(0)
    policy = TinyLlama(LlamaConfig(vocab=V, dim=64, layers=2, heads=4, kv_heads=2, ffn=128))
    loss = DPOLoss(beta=0.1)
    engine = compile(DPOObjective(policy, loss), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32,
                     optimizer=AdamW(lr=2e-3, weight_decay=0.0))
    train = [pack(_pairs(8, seed), SEQ) for seed in range(40)]
    held_out = pack(_pairs(64, 1000), SEQ)
    train_ref = reference_logps(engine, train)          # the policy at step 0 is the reference
    [held_ref] = reference_logps(engine, [held_out])
    before = preference_metrics(held_ref, held_ref, loss.beta)
    losses = [engine.step(**batch, ref_logps=ref) for batch, ref in zip(train, train_ref)]
    after = preference_metrics(torch.as_tensor(engine(**held_out)), held_ref, loss.beta)
    engine.close()
    assert before["preference_accuracy"] == 0.0 and before["reward_margin"] == 0.0
    assert after["preference_accuracy"] > 0.9, after
    assert after["reward_margin"] > 0
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1, losses        # from log 2 = 0.693


def test_read_pairs_tokenizes_text_and_conversations(tmp_path):
    import json

    from megacompile.posttrain.preference import read_pairs
    from tests.train.files import tokenizer
    tok = tokenizer()
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "the cat", "chosen": "sat on the mat", "rejected": "ran in the park"},
        {"prompt": [{"role": "user", "content": "hello there"}],
         "chosen": [{"role": "assistant", "content": "i am fine"}],
         "rejected": [{"role": "assistant", "content": "it is late"}]}]) + "\n")
    text, chat = read_pairs(path, tok)
    assert text.chosen == tuple(tok("sat on the mat", add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
    assert text.prompt == tuple(tok("the cat")["input_ids"])
    assert tok.decode(list(chat.prompt)).split() == ["<|user|>", "hello", "there", "<|end|>", "<|assistant|>"]
    assert tok.decode(list(chat.chosen)).split() == ["i", "am", "fine", "<|end|>"]
    assert tok.decode(list(chat.rejected)).split() == ["it", "is", "late", "<|end|>"]
    path.write_text(json.dumps({"prompt": "the cat", "chosen": "sat"}) + "\n")
    with pytest.raises(ArgumentError, match="missing rejected"):
        read_pairs(path, tok)
