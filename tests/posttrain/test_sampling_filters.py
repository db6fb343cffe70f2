"""The sampling filters (posttrain/sampling_filters.py) are transformers' own: the same logits kept,
with the same values, as its repetition-penalty processor and its temperature, top-k, top-p and
min-p warpers in generate's order; the engine's generator and the bf16 copy's draw the same tokens
with them from one seed; a drawn token is always one the filters keep."""
import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

from megacompile.errors import ArgumentError
from megacompile.posttrain.hf_generator import HFGenerator
from megacompile.posttrain.rollout import EngineGenerator
from megacompile.posttrain.sampling_filters import Filters, seen_tokens
from tests.posttrain.test_hf_generator import EOS, PROMPTS, _engine

V = 50
ROWS = [[1, 4, 4, 9], [2, 3], [7, 7, 7, 7], [0, 49, 12, 30]]


def _logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(len(ROWS), V, generator=g) * 3


def _theirs(logits, filters: Filters, temperature: float) -> torch.Tensor:
    """transformers' processors over the same rows (none padded), in generate's order."""
    ids = torch.tensor([row + [row[-1]] * (4 - len(row)) for row in ROWS])      # a repeated id changes nothing
    chain = []
    if filters.repetition_penalty != 1.0:
        chain.append(RepetitionPenaltyLogitsProcessor(filters.repetition_penalty))
    chain.append(TemperatureLogitsWarper(temperature))
    if filters.top_k:
        chain.append(TopKLogitsWarper(filters.top_k))
    if filters.top_p < 1.0:
        chain.append(TopPLogitsWarper(filters.top_p))
    if filters.min_p is not None:
        chain.append(MinPLogitsWarper(filters.min_p))
    scores = logits.clone()
    for processor in chain:
        scores = processor(ids, scores)
    return scores


@pytest.mark.parametrize("filters", [Filters(top_k=5), Filters(top_p=0.8), Filters(min_p=0.1),
                                     Filters(repetition_penalty=1.3), Filters(repetition_penalty=0.7),
                                     Filters(top_k=12, top_p=0.9, min_p=0.05, repetition_penalty=1.2)])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_the_filters_keep_what_transformers_keeps(filters, temperature):
    logits = _logits()
    ours = filters.truncate(filters.penalise(logits, seen_tokens(ROWS, V)) / temperature)
    theirs = _theirs(logits, filters, temperature)
    assert torch.equal(ours.isinf(), theirs.isinf())
    kept = ~ours.isinf()
    if filters.top_k or filters.top_p < 1.0 or filters.min_p is not None:
        assert 1 <= kept.sum(-1).min() and kept.sum(-1).max() < V     # each removes some, never all
    else:
        assert not torch.equal(ours, logits / temperature)             # the penalty moved the seen tokens
    torch.testing.assert_close(ours[kept], theirs[kept], rtol=0, atol=0)


def test_off_they_draw_what_softmax_of_the_logits_over_the_temperature_draws():
    logits = _logits()
    ours = Filters().draw(logits, None, 0.8, torch.Generator().manual_seed(3))
    plain = torch.multinomial(torch.softmax(logits / 0.8, -1), 1, generator=torch.Generator().manual_seed(3))
    assert torch.equal(ours, plain.squeeze(1)) and not Filters().active


def test_a_drawn_token_is_one_the_filters_keep_and_greedy_takes_the_penalised_argmax():
    logits = _logits()
    logits[0, 4] = logits[0].max() + 0.5        # row 0 holds token 4: the likeliest, until penalised
    filters = Filters(top_k=3, repetition_penalty=2.0)
    seen = seen_tokens(ROWS, V)
    allowed = ~filters.truncate(filters.penalise(logits, seen)).isinf()
    rng = torch.Generator().manual_seed(0)
    draws = torch.stack([filters.draw(logits, seen, 1.0, rng) for _ in range(200)])
    assert allowed.gather(1, draws.T).all()
    assert all(len(set(draws[:, r].tolist())) == 3 for r in range(len(ROWS)))       # every kept token drawn
    greedy = filters.draw(logits, seen, 0, rng)
    assert torch.equal(greedy, filters.penalise(logits, seen).argmax(-1))
    assert not torch.equal(greedy, logits.argmax(-1))       # the penalty moved some row's argmax


def test_the_engine_and_the_copy_draw_the_same_tokens_through_the_filters():
    engine = _engine()
    filters = Filters(top_k=8, top_p=0.9, min_p=0.02, repetition_penalty=1.5)
    ours = EngineGenerator(engine, eos_id=EOS, seed=1, filters=filters)
    copy = HFGenerator(engine, eos_id=EOS, seed=1, dtype=torch.float32, filters=filters)
    plain = EngineGenerator(engine, eos_id=EOS, seed=1)
    sampled = ours.generate(PROMPTS, 3, 6, temperature=1.0)
    assert copy.generate(PROMPTS, 3, 6, temperature=1.0) == sampled
    assert plain.generate(PROMPTS, 3, 6, temperature=1.0) != sampled
    greedy = ours.generate(PROMPTS, 1, 6, temperature=0)      # the penalty moves greedy decoding too
    assert copy.generate(PROMPTS, 1, 6, temperature=0) == greedy != plain.generate(PROMPTS, 1, 6, temperature=0)
    engine.close()


def test_vllm_is_handed_its_own_names_and_a_bad_value_is_refused():
    assert Filters().vllm_settings() == dict(top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
    assert Filters(top_k=4, min_p=0.1).vllm_settings()["top_k"] == 4
    for bad, message in [(dict(top_k=1.5), "top_k is the number"), (dict(top_p=1.2), "top_p must be in"),
                         (dict(min_p=-0.1), "min_p must be in"), (dict(repetition_penalty=math.nan),
                                                                  "repetition_penalty must be a positive")]:
        with pytest.raises(ArgumentError, match=message):
            Filters(**bad)
