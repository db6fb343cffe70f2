"""Rollouts from vLLM, colocated in this process (`vllm.LLM`), with the trained weights handed over
after each optimizer step through the model's own weight loader: `model.load_weights(iterable)`,
given an iterator of (name, bf16 tensor) in which each tensor is cast from its fp32 master only when
vLLM asks for it (policy_weights.py). The host never holds a bf16 copy of the model: what an update
adds to the process's memory is about one tensor.

Where the model lives, by vLLM version:
- V1 engine (vLLM 0.8 and later) with the engine core in this process, as it is with
  VLLM_ENABLE_V1_MULTIPROCESSING=0 set before the LLM is made:
  `llm.llm_engine.model_executor.driver_worker.worker.model_runner.model`;
- the V0 engine (vLLM before 0.8, or later with VLLM_USE_V1=0 while V0 shipped): `llm.llm_engine.model_executor.driver_worker.model_runner.model`.
An LLM whose model runs in another process is refused, naming the variable: its weights would have
to be serialised whole to cross. After the load the prefix cache is dropped (`llm.reset_prefix_cache()`):
its keys and values were computed with the old weights.

Sampling: vLLM's, seeded per call (`SamplingParams(seed=...)`) from the generator's seed and a count
of sampled calls (greedy ones draw nothing and are not counted), which is the state `state()` / `set_state()` save and restore. The tokenizer's eos is
ignored; `eos_id` holds the stop tokens (rollout.stop_ids), as for the other generators.
"""
from __future__ import annotations

import torch

from ..errors import ArgumentError, MegacompileError
from .policy_weights import policy_of, policy_weights
from .rollout import Completion, check_request, stop_ids
from .sampling_filters import Filters

MISSING = ("VLLMGenerator needs vLLM, which is not installed: pip install vllm (on the GPU machine that trains; "
           "the V1 engine in this process: vLLM >= 0.8 with VLLM_ENABLE_V1_MULTIPROCESSING=0), or sample with "
           "HFGenerator or EngineGenerator")


def _vllm():
    try:
        import vllm
    except ImportError as e:
        raise MegacompileError(MISSING) from e
    return vllm


def vllm_model(llm):
    """The model inside a colocated `vllm.LLM`, where its `load_weights` can be called in this process."""
    driver = getattr(getattr(getattr(llm, "llm_engine", None), "model_executor", None), "driver_worker", None)
    worker = getattr(driver, "worker", driver)          # V1 wraps the worker; V0 is the worker
    model = getattr(getattr(worker, "model_runner", None), "model", None)
    if model is None or not callable(getattr(model, "load_weights", None)):
        raise ArgumentError(
            "VLLMGenerator hands the weights to vLLM's model in this process, and this LLM runs it in another "
            "(its llm_engine.model_executor.driver_worker has no model_runner.model): set "
            "VLLM_ENABLE_V1_MULTIPROCESSING=0 before creating the LLM, with tensor_parallel_size=1")
    return model


class SeededCalls:
    """vLLM samples with a seed given per call: the generator's seed plus its count of sampled
    calls, which is the sampler's state in a checkpoint. A greedy call (temperature 0) draws
    nothing and is not counted: evaluating between rollouts leaves their seeds as they were."""
    seed: int
    calls: int

    def next_seed(self, temperature: float) -> int:
        if temperature == 0:
            return self.seed
        self.calls += 1
        return self.seed + self.calls - 1

    def state(self) -> torch.Tensor:
        """The sampler's state (calls made so far), for a checkpoint."""
        return torch.tensor([self.calls], dtype=torch.long)

    def set_state(self, state: torch.Tensor) -> None:
        self.calls = int(state[0])


class VLLMGenerator(SeededCalls):
    def __init__(self, engine, llm=None, *, model: str | None = None, eos_id: int | tuple[int, ...] | None = None, seed: int = 0,
                 filters: Filters = Filters(), sleep: bool = False, **llm_args):
        """`llm`: a colocated vllm.LLM already made; else one is made from `model` (a Hugging Face
        folder of the policy's architecture, by default the one the engine was loaded from) in bf16,
        with `llm_args` (gpu_memory_utilization=..., max_model_len=...). Its weights are replaced by
        the engine's at once.

        `sleep` (TRL's vllm_enable_sleep_mode; an LLM made here is made with enable_sleep_mode): between
        rollouts vLLM sleeps at level 2, its weights and key-value cache released from the device while
        the engine trains. `sync()` wakes the weights and loads the masters, `generate()` wakes the
        cache, samples and puts both to sleep again, loading the masters first if they went with the
        last sleep and no sync came since, as TRL does."""
        self.vllm = _vllm()
        _, self.prefix = policy_of(engine)
        if llm_args.pop("tensor_parallel_size", 1) != 1:
            raise ArgumentError("VLLMGenerator hands each weight whole to one model in this process: "
                                "tensor_parallel_size is 1 (a larger policy: VLLMServerGenerator)")
        if llm is None:
            model = model or engine.state.source_dir
            if model is None:
                raise ArgumentError("VLLMGenerator(model=...) is the Hugging Face folder vLLM starts from (the engine "
                                    "was not loaded from one): write it with engine.save_pretrained(path, "
                                    "dtype=torch.bfloat16), or pass llm=vllm.LLM(...)")
            # the sampled tokens' log-probabilities after the temperature, as the sampler drew them
            # (vLLM's default, raw_logprobs, is before it): the sampling correction compares them
            # with the policy's at the temperature
            llm_args.setdefault("logprobs_mode", "processed_logprobs")
            if sleep:
                llm_args["enable_sleep_mode"] = True
            llm = self.vllm.LLM(model=model, dtype="bfloat16", seed=seed, tensor_parallel_size=1, **llm_args)
        self.engine, self.llm, self.eos_id, self.seed, self.calls = engine, llm, eos_id, seed, 0
        self.filters, self.sleep, self.weights_asleep = filters, sleep, False
        self.model = vllm_model(llm)
        if sleep:
            self.llm.sleep(level=2)
            self.weights_asleep = True
        self.sync()

    def sync(self) -> None:
        """Hand the engine's current masters to vLLM, each cast to bf16 when vLLM reads it."""
        if self.weights_asleep:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()        # what the engine's allocator holds back, for vLLM to map again
            self.llm.wake_up(tags=["weights"])
            self.weights_asleep = False
        self.model.load_weights(policy_weights(self.engine, self.prefix, torch.bfloat16))
        reset = getattr(self.llm, "reset_prefix_cache", None)
        if reset is not None:
            reset()

    def generate(self, prompts, n, max_new_tokens, temperature=1.0) -> list[Completion]:
        check_request(prompts, n, max_new_tokens, temperature)
        settings = sampling(n, max_new_tokens, temperature, self.next_seed(temperature), self.eos_id, self.filters)
        params = self.vllm.SamplingParams(**settings)
        if self.weights_asleep:
            self.sync()                 # the masters went with the last sleep, and no step has changed them
        if self.sleep:
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        finally:
            if self.sleep:
                self.llm.sleep(level=2)
                self.weights_asleep = True
        completions = []
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            if len(out.outputs) != n:
                raise MegacompileError(f"vLLM returned {len(out.outputs)} completions of prompt {i}, not n={n}")
            for c in out.outputs:
                tokens = completion_tokens(c.token_ids, getattr(c, "stop_reason", None), self.eos_id)
                completions.append(Completion(i, tuple(prompt), tokens,
                                              sampled_logprobs(c.token_ids, getattr(c, "logprobs", None), len(tokens))))
        return completions


def completion_tokens(token_ids, stop_reason, eos_id) -> tuple[int, ...]:
    """A vLLM completion's tokens, ending with the stop token where it stopped on one (vLLM may
    leave a stop token out of token_ids); `eos_id` as rollout.stop_ids takes it."""
    tokens = tuple(token_ids)
    if stop_reason in stop_ids(eos_id) and (not tokens or tokens[-1] != stop_reason):
        tokens += (stop_reason,)
    return tokens


def sampled_logprobs(token_ids, logprobs, count: int) -> tuple[float | None, ...] | None:
    """The sampler's log-probability of each sampled token, from vLLM's per-token {token id:
    Logprob} (logprobs=0 asks for the sampled token's alone); None for a stop token appended after
    them (completion_tokens); None for all where vLLM gave none."""
    if not logprobs:
        return None
    values = tuple(float(step[t].logprob) for t, step in zip(token_ids, logprobs))
    return (values + (None,) * count)[:count]


def sampling(n: int, max_new_tokens: int, temperature: float, seed: int, eos_id, filters: Filters = Filters()) -> dict:
    """vLLM's sampling settings of one call: the tokenizer's eos ignored, `eos_id` the stop tokens,
    the sampled token's log-probability returned (the sampler's correction reads it), and top_k,
    top_p, min_p and repetition_penalty where they are on."""
    return dict(n=n, temperature=float(temperature), max_tokens=max_new_tokens, seed=seed, ignore_eos=True,
                stop_token_ids=list(stop_ids(eos_id)) or None, logprobs=0,
                **(filters.vllm_settings() if filters.active else {}))
