"""The vLLM hand-off (posttrain/vllm_generator.py) against a stand-in for vLLM's API
(tests/posttrain/fake_vllm.py): the weights it is given after each step are the masters cast to
bf16 under the policy's names, one at a time, so the process grows by about one tensor; requests
and replies are translated as vLLM means them; a missing vLLM or an LLM in another process is refused."""
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.initialization import no_init_weights

from megacompile import AdamW, compile
from megacompile.errors import ArgumentError, MegacompileError
from megacompile.posttrain import GRPOLoss, GRPOObjective
from megacompile.posttrain.rollout import Completion
from megacompile.posttrain.rollout_batch import rollout_batch
from megacompile.posttrain.vllm_generator import VLLMGenerator
from tests.e2e.io_peak import measure
from tests.posttrain import fake_vllm

MiB = 2**20


@pytest.fixture
def vllm(monkeypatch):
    fake = fake_vllm.module()
    monkeypatch.setitem(sys.modules, "vllm", fake)
    return fake


def _engine(tied, **sizes):
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3)
    policy = LlamaForCausalLM(LlamaConfig(**{**config, **sizes}, tie_word_embeddings=tied, use_cache=False))
    return compile(GRPOObjective(policy, GRPOLoss()), hbm_budget=0.01, device="cpu", compute_dtype=torch.float32,
                   optimizer=AdamW(lr=1e-2, weight_decay=0.0))


def _bf16_masters(engine):
    return {k[len("policy."):]: v.to(torch.bfloat16) for k, v in engine.state_dict().items()
            if k.startswith("policy.")}


@pytest.mark.parametrize("tied", [False, True])
def test_each_step_hands_vllm_the_masters_in_bf16_by_name(vllm, tied):
    engine = _engine(tied)
    generator = VLLMGenerator(engine, model="/models/policy", eos_id=fake_vllm.EOS, seed=5, gpu_memory_utilization=0.3)
    llm = generator.llm
    # log-probabilities after the temperature, as the sampling correction reads them
    assert llm.args == dict(model="/models/policy", dtype="bfloat16", seed=5, tensor_parallel_size=1,
                            gpu_memory_utilization=0.3, logprobs_mode="processed_logprobs")
    expected = _bf16_masters(engine)
    if tied:            # a tied weight goes once, under its first name, as transformers saves it
        del expected["lm_head.weight"]
    first = llm.model.loads[0]
    assert [name for name, _, _ in first] == list(expected)
    assert all(dtype == torch.bfloat16 and shape == tuple(expected[n].shape) for n, dtype, shape in first)
    assert all(torch.equal(llm.model.kept[n], t) for n, t in expected.items())

    completions = [Completion(i // 2, (1, 2, 3), (4 + i, 5)) for i in range(4)]
    batch = rollout_batch(completions, torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, width=5)
    engine.step(**batch, old_logps=torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"])))
    generator.sync()
    moved = _bf16_masters(engine)
    assert len(llm.model.loads) == 2 and llm.resets == 2
    changed = [n for n in expected if not torch.equal(moved[n], expected[n])]
    assert len(changed) > len(expected) // 2, changed
    assert all(torch.equal(llm.model.kept[n], moved[n]) for n in expected)
    engine.close()


def test_requests_and_replies_are_translated_and_the_sampler_state_restores(vllm):
    engine = _engine(False)
    generator = VLLMGenerator(engine, llm=vllm.LLM(model="x"), eos_id=fake_vllm.EOS, seed=7)
    state = generator.state()
    first = generator.generate([[1, 2], [9]], 2, 6, temperature=0.7)
    prompts, params = generator.llm.requests[-1]
    assert prompts == [{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [9]}]
    assert (params.n, params.temperature, params.max_tokens, params.seed) == (2, 0.7, 6, 7)
    assert params.stop_token_ids == [fake_vllm.EOS] and params.ignore_eos and params.logprobs == 0
    # prompt 0's two completions, then prompt 1's; each ends with the stop token, listed or not
    assert [(c.prompt_index, c.prompt, c.tokens) for c in first] == [
        (0, (1, 2), (19, 3)), (0, (1, 2), (20, 3)), (1, (9,), (26, 3)), (1, (9,), (27, 3))]
    # the sampled tokens' log-probabilities; None for a stop token vLLM did not list (odd completions)
    lp = fake_vllm.LOGPROB
    assert [c.logprobs for c in first] == [(lp, lp - 1), (lp, None), (lp, lp - 1), (lp, None)]
    assert generator.generate([[1, 2]], 1, 6)[0].tokens == (20, 3)          # the next call, the next seed
    after = generator.state()
    generator.generate([[1, 2]], 1, 6, temperature=0)                       # greedy: nothing drawn, not counted
    assert torch.equal(generator.state(), after)
    generator.set_state(state)
    assert generator.generate([[1, 2], [9]], 2, 6, temperature=0.7) == first
    without = VLLMGenerator(engine, llm=vllm.LLM(model="x", layout="v0"))     # the V0 engine's model, found too
    assert len(without.llm.model.loads) == 1
    without.generate([[1]], 1, 4)
    assert without.llm.requests[-1][1].stop_token_ids is None and without.llm.requests[-1][1].ignore_eos
    with pytest.raises(ArgumentError, match="max_new_tokens"):
        generator.generate([[1]], 1, 0)
    engine.close()


def test_missing_vllm_or_a_model_out_of_reach_is_refused(vllm, monkeypatch):
    engine = _engine(False)
    with pytest.raises(ArgumentError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMGenerator(engine, llm=vllm.LLM(model="x", layout="remote"))
    with pytest.raises(ArgumentError, match="tensor_parallel_size"):
        VLLMGenerator(engine, model="x", tensor_parallel_size=2)
    with pytest.raises(ArgumentError, match="save_pretrained"):
        VLLMGenerator(engine)                  # no folder to start vLLM from
    monkeypatch.setitem(sys.modules, "vllm", None)      # import vllm raises ImportError
    with pytest.raises(MegacompileError, match="pip install vllm"):
        VLLMGenerator(engine, model="x")
    engine.close()


def test_a_weight_update_grows_the_process_by_one_tensor_not_a_bf16_copy(vllm):
    """170 MB of bf16 weights (340 MB of fp32 masters), the largest tensor 8 MiB in bf16: the update's
    growth of resident memory (the high-water mark over the resident size before it, io_peak.measure)
    stays under that tensor + 64 MiB, where casting the whole model first grows it by the whole copy."""
    config = LlamaConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                         tie_word_embeddings=False, use_cache=False)
    with no_init_weights():
        policy = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.uniform_(-0.05, 0.05, generator=g)
    engine = compile(GRPOObjective(policy, GRPOLoss()), hbm_budget=0.5, device="cpu", compute_dtype=torch.float32)
    llm = vllm.LLM(model="x")
    llm.model.keep = False
    largest = max(p.numel() for p in policy.parameters()) * 2
    bound = largest + 64 * MiB
    growth = measure(lambda: VLLMGenerator(engine, llm=llm))
    whole = measure(lambda: [p.to(torch.bfloat16) for p in policy.parameters()])
    assert len(llm.model.loads[0]) == len(list(policy.parameters()))
    assert whole > bound, (whole / MiB, bound / MiB)          # the bound tells the two apart
    assert growth <= bound, (growth / MiB, bound / MiB)
    print(f"host growth of a weight update: {growth / MiB:.1f} MiB (largest bf16 tensor {largest / MiB:.1f} MiB, "
          f"whole bf16 model {sum(p.numel() for p in policy.parameters()) * 2 / MiB:.0f} MiB)")
    engine.close()


def test_sleep_mode_releases_vllm_between_rollouts_and_reloads_the_masters_it_let_go(vllm, monkeypatch):
    """TRL's vllm_enable_sleep_mode: vLLM made with enable_sleep_mode sleeps at level 2 (weights and
    cache released) between rollouts; a sync wakes the weights and loads the masters; a rollout wakes
    the cache, samples and sleeps; a rollout with no sync since the last sleep loads the masters
    first. On cuda, what the engine's allocator holds back is released before the weights wake."""
    engine = _engine(False)
    released = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: released.append(True))
    generator = VLLMGenerator(engine, model="/models/policy", eos_id=fake_vllm.EOS, seed=5, sleep=True)
    llm = generator.llm
    assert llm.args["enable_sleep_mode"] is True
    assert llm.events == ["sleep 2", "wake weights", "load"]
    generator.generate([[5, 6]], 2, 4)
    assert llm.events[3:] == ["wake kv_cache", "generate", "sleep 2"]
    generator.sync()                                  # after a step: the masters, then the next rollout
    generator.generate([[5, 6]], 2, 4)
    assert llm.events[6:] == ["wake weights", "load", "wake kv_cache", "generate", "sleep 2"]
    generator.generate([[7]], 1, 4, temperature=0)    # an evaluation with no step since: the masters again
    assert llm.events[11:] == ["wake weights", "load", "wake kv_cache", "generate", "sleep 2"]
    assert len(released) == 3 and len(llm.model.loads) == 3
    awake = VLLMGenerator(engine, llm=vllm.LLM(model="x"))
    awake.generate([[5]], 1, 2)
    assert awake.llm.events == ["load", "generate"] and "enable_sleep_mode" not in awake.llm.args
    engine.close()
