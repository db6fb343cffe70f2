"""bf16 compute and save_pretrained with 2 ranks (a transformers Llama): the ranks track one
process on the whole batch at the bf16 tests' tolerance, and rank 0's export is the one process's
export of the same weights, loadable by transformers."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from . import ranks

pytestmark = pytest.mark.slow
BF16 = 1e-2           # as the one-process bf16 tests (tests/e2e/test_api.py)
STEPS = 4


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("bf16"))
    ranks.spawn("bf16_export", 2, folder, steps=STEPS)
    return folder, [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(2)]


def _tensors(folder: str) -> dict:
    out = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(folder, f)))
    return out


def test_two_ranks_in_bf16_track_one_process_on_the_whole_batch(two_ranks):
    folder, results = two_ranks
    engine = ranks.llama_bf16()
    losses = [engine.step(input_ids=ids, labels=ids) for ids in ranks.batches(STEPS)]
    reference = engine.state_dict()
    mean = [sum(ls) / 2 for ls in zip(*(r["losses"] for r in results))]
    assert max(abs(a - b) / abs(b) for a, b in zip(mean, losses)) <= BF16
    # The weights: AdamW moves a weight by about lr whatever its gradient's size, so where bf16
    # rounding decides a small gradient's sign the two runs part by ~lr. The updates as a whole
    # must agree: their cosine (one rank's share never gathered would leave half of them out).
    weights = torch.load(os.path.join(folder, "weights.pt"))
    initial = ranks.llama_bf16().model.state_dict()
    ours = torch.cat([(weights[k] - initial[k]).flatten() for k in reference])
    theirs = torch.cat([(v - initial[k]).flatten() for k, v in reference.items()])
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) >= 0.95, \
        torch.nn.functional.cosine_similarity(ours, theirs, dim=0)
    # the node's copy is bf16: 2 B per parameter, once
    params = sum(v.numel() for k, v in reference.items() if k in engine.host.slots)
    assert 2 * params <= results[0]["shared_bytes"] < 2 * params + len(engine.host.owners) * 4096


def test_the_export_of_two_ranks_is_the_one_process_export_of_the_same_weights(two_ranks, tmp_path):
    from transformers import AutoModelForCausalLM
    folder, _ = two_ranks
    weights = torch.load(os.path.join(folder, "weights.pt"))
    one = ranks.llama_bf16()
    one.load_state_dict(weights)
    ids = ranks.batches(1)[0]
    one.prepare(input_ids=ids, labels=ids)
    one.save_pretrained(str(tmp_path), max_shard_size="100KB")
    exported, expected = _tensors(os.path.join(folder, "export")), _tensors(str(tmp_path))
    assert exported.keys() == expected.keys() and all(torch.equal(exported[k], expected[k]) for k in expected)
    back = AutoModelForCausalLM.from_pretrained(os.path.join(folder, "export"))
    for key, value in back.state_dict().items():
        assert torch.equal(value, weights[key]), key
