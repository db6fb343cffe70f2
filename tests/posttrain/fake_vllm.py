"""A stand-in for the part of vLLM's API that VLLMGenerator uses (vllm.LLM, vllm.SamplingParams,
the colocated model's load_weights), inserted into sys.modules by the tests: vLLM itself needs a
GPU and is not installed here. It records what it is given; its completions are made from the
request (prompt and seed), so the tests can check how requests and replies are translated."""
from __future__ import annotations

import types
from types import SimpleNamespace

EOS = 3
LOGPROB = -0.25


class SamplingParams:
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


class Model:
    """The model inside the LLM: load_weights reads the iterator one pair at a time, as vLLM's
    loaders do, and hands each to `check` (it keeps no tensor unless `keep`)."""

    def __init__(self):
        self.loads, self.kept, self.check = [], {}, None
        self.keep, self.events = True, None

    def load_weights(self, weights):
        seen = []
        for name, w in weights:
            seen.append((name, w.dtype, tuple(w.shape)))
            if self.check is not None:
                self.check(name, w)
            if self.keep:
                self.kept[name] = w.clone()
        self.loads.append(seen)
        if self.events is not None:
            self.events.append("load")
        return {name for name, _, _ in seen}


class LLM:
    def __init__(self, model=None, layout="v1", **kwargs):
        """layout: where the model sits: "v1" (the V1 engine in this process), "v0", or "remote"
        (the engine core in another process: no model_runner here)."""
        self.args = dict(model=model, **kwargs)
        self.model, self.requests, self.resets = Model(), [], 0
        self.events: list[str] = []         # sleep and wake calls, loads and generations, in order
        self.model.events = self.events
        worker = SimpleNamespace(model_runner=SimpleNamespace(model=self.model))
        driver = {"v1": SimpleNamespace(worker=worker), "v0": worker, "remote": SimpleNamespace()}[layout]
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(driver_worker=driver))

    def reset_prefix_cache(self):
        self.resets += 1

    def sleep(self, level=1):
        self.events.append(f"sleep {level}")

    def wake_up(self, tags=None):
        self.events.append(f"wake {','.join(tags) if tags else 'all'}")

    def generate(self, prompts, params, use_tqdm=True):
        """Completion j of a prompt: (last prompt token + seed + j) % 50, then the stop token, which
        the reply leaves out of token_ids for odd j (a stop token vLLM does not list)."""
        self.requests.append((prompts, params))
        self.events.append("generate")
        out = []
        for p in prompts:
            completions = []
            for j in range(params.n):
                first = (p["prompt_token_ids"][-1] + params.seed + j) % 50 + 10
                stop = params.stop_token_ids[0] if params.stop_token_ids else None
                tokens = [first] + ([stop] if stop is not None and j % 2 == 0 else [])
                # with logprobs=0, each sampled token's log-probability alone: LOGPROB, then LOGPROB - 1
                logprobs = (None if getattr(params, "logprobs", None) is None else
                            [{t: SimpleNamespace(logprob=LOGPROB - i)} for i, t in enumerate(tokens)])
                completions.append(SimpleNamespace(token_ids=tokens, stop_reason=stop, finish_reason="stop",
                                                   logprobs=logprobs))
            out.append(SimpleNamespace(outputs=completions))
        return out


def module() -> types.ModuleType:
    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = LLM, SamplingParams
    return fake
