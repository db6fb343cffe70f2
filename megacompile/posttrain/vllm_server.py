"""Rollouts from a vLLM server on this machine (or one sharing its disk), spoken to over HTTP: the
OpenAI-compatible `/v1/completions` with token-id prompts and `return_token_ids` (vLLM >= 0.10.2)
and the sampled tokens' log-probabilities (`logprobs: 0`, read from `token_logprobs`),
and, after each optimizer step, the weights through vLLM's weight-transfer routes with its `disk`
backend: the masters are written as one bf16 safetensors file in `weights_dir` (each tensor cast
alone as it is written: the host grows by one tensor), then `/start_weight_update`,
`/update_weights` with that folder, `/finish_weight_update`. The server is started with them on:

    VLLM_SERVER_DEV_MODE=1 vllm serve POLICY_FOLDER --weight-transfer-config '{"backend": "disk"}' \
        --logprobs-mode processed_logprobs

(the last, for log-probabilities after the temperature, as the sampling correction reads them).

Sampling is the server's, seeded per call from the generator's seed and its count of calls.
"""
from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

import torch

from ..errors import ArgumentError, MegacompileError
from ..io.hf_save import write_safetensors
from .policy_weights import policy_of, policy_weights
from .rollout import Completion, check_request
from .sampling_filters import Filters
from .vllm_generator import SeededCalls, completion_tokens, sampling

WEIGHTS = "model.safetensors"
MARK = ".megacompile-rollout-weights"     # the folder is ours to overwrite: made by this generator


class VLLMServerGenerator(SeededCalls):
    def __init__(self, engine, url: str, weights_dir: str, *, model: str | None = None, eos_id: int | tuple[int, ...] | None = None,
                 seed: int = 0, timeout: float = 600.0, filters: Filters = Filters()):
        """`url`: the server (http://host:port); `weights_dir`: an absolute folder the server reads
        at the same path; `model`: the served model's name (by default the first /v1/models lists)."""
        if not isinstance(weights_dir, str) or not os.path.isabs(weights_dir):
            raise ArgumentError(f"weights_dir is an absolute folder the vLLM server reads at the same path; "
                                f"got {weights_dir!r}")
        _own_folder(weights_dir)
        _, self.prefix = policy_of(engine)
        self.engine, self.url, self.weights_dir = engine, url.rstrip("/"), weights_dir
        self.eos_id, self.seed, self.calls, self.timeout, self.filters = eos_id, seed, 0, timeout, filters
        self.model = model or self._request("v1/models", None)["data"][0]["id"]
        os.makedirs(weights_dir, exist_ok=True)
        open(os.path.join(weights_dir, MARK), "a").close()
        self._request("init_weight_transfer_engine", {"init_info": {}})
        self.sync()

    def _request(self, path: str, body: dict | None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"{self.url}/{path}", data=data, method="GET" if body is None else "POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                text = reply.read()
        except urllib.error.HTTPError as e:
            raise MegacompileError(f"the vLLM server at {self.url} refused /{path}: {e.code} "
                                   f"{e.read().decode(errors='replace')[:300]}"
                                   + (" (the weight routes need VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                      "'{\"backend\": \"disk\"}')" if "weight" in path else "")) from e
        except OSError as e:
            raise MegacompileError(f"cannot reach the vLLM server at {self.url} (/{path}): {e}") from e
        return json.loads(text) if text.strip() else {}

    def sync(self) -> None:
        """Write the masters in bf16 to weights_dir and have the server load them."""
        target = os.path.join(self.weights_dir, WEIGHTS)
        write_safetensors(target + ".partial", policy_weights(self.engine, self.prefix), torch.bfloat16)
        os.replace(target + ".partial", target)       # the server never reads a file half written
        self._request("start_weight_update", {})
        self._request("update_weights", {"update_info": {"path": self.weights_dir}})
        self._request("finish_weight_update", {"weight_version": str(self.engine.state.steps_done)})

    def generate(self, prompts, n, max_new_tokens, temperature=1.0) -> list[Completion]:
        check_request(prompts, n, max_new_tokens, temperature)
        settings = sampling(n, max_new_tokens, temperature, self.next_seed(temperature), self.eos_id, self.filters)
        body = dict(model=self.model, prompt=[list(p) for p in prompts], return_token_ids=True,
                    **{k: v for k, v in settings.items() if v is not None})
        choices = sorted(self._request("v1/completions", body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * n or any("token_ids" not in c for c in choices):
            raise MegacompileError(f"the vLLM server answered {len(choices)} completions of {len(prompts)} prompts x "
                                   f"n={n}, or without token_ids (it needs vLLM >= 0.10.2: return_token_ids)")
        completions = []
        for c in choices:
            tokens = completion_tokens(c["token_ids"], c.get("stop_reason"), self.eos_id)
            scored = (c.get("logprobs") or {}).get("token_logprobs")
            logprobs = None if not scored else tuple((tuple(None if x is None else float(x) for x in scored)
                                                      + (None,) * len(tokens))[:len(tokens)])
            completions.append(Completion(c["index"] // n, tuple(prompts[c["index"] // n]), tokens, logprobs))
        return completions


def _own_folder(weights_dir: str) -> None:
    """Each update replaces weights_dir/model.safetensors: a folder holding anything this generator
    did not write (the policy's own checkpoint, say) is refused rather than overwritten."""
    if not os.path.isdir(weights_dir) or os.path.exists(os.path.join(weights_dir, MARK)):
        return
    held = sorted(os.listdir(weights_dir))
    if held:
        raise ArgumentError(f"weights_dir {weights_dir} already holds {', '.join(held[:3])}"
                            f"{', ...' if len(held) > 3 else ''}, and each weight update replaces its {WEIGHTS}: "
                            "give an empty or new folder for the rollout weights")
