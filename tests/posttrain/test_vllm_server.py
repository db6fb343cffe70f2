"""The vLLM server hand-off (posttrain/vllm_server.py) against a local HTTP server speaking the
routes it uses: token-id completions with return_token_ids, and the disk backend's weight-transfer
routes; the file it points the server to holds the masters in bf16 under the policy's names."""
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from safetensors import safe_open

from megacompile.errors import ArgumentError, MegacompileError
from megacompile.posttrain.rollout import Completion
from megacompile.posttrain.rollout_batch import rollout_batch
from megacompile.posttrain.vllm_server import WEIGHTS, VLLMServerGenerator
from tests.posttrain.test_vllm_generator import _bf16_masters, _engine

EOS = 3


class _Server:
    """Records every request; /update_weights reads the folder it is given, as vLLM's disk backend does."""

    def __init__(self):
        self.calls, self.loaded, self.fail = [], [], set()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer({"data": [{"id": "policy"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                path = self.path.strip("/")
                owner.calls.append((path, body))
                if path in owner.fail:
                    self.send_response(404)
                    self.end_headers()
                    self.wfile.write(b'{"detail": "Not Found"}')
                    return
                if path == "update_weights":
                    with safe_open(f"{body['update_info']['path']}/{WEIGHTS}", framework="pt") as f:
                        owner.loaded.append({k: f.get_tensor(k) for k in f.keys()})
                if path == "v1/completions":
                    choices = []
                    for i, prompt in enumerate(body["prompt"]):
                        for j in range(body["n"]):
                            tokens = [prompt[-1] + body["seed"] + j] + ([EOS] if j == 0 else [])
                            # logprobs: 0 -> the sampled tokens' own, in token_logprobs
                            scored = ({"token_logprobs": [-0.5 - k for k in range(len(tokens))]}
                                      if body.get("logprobs") is not None else None)
                            choices.append({"index": i * body["n"] + j, "token_ids": tokens, "stop_reason": EOS,
                                            "finish_reason": "stop", "text": "", "logprobs": scored})
                    return self._answer({"choices": choices[::-1]})         # in any order: placed by index
                self._answer({})

            def _answer(self, reply):
                raw = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


@pytest.fixture
def server():
    s = _Server()
    yield s
    s.http.shutdown()


def test_weights_go_to_the_server_through_the_disk_backend_after_each_step(server, tmp_path):
    engine = _engine(False)
    generator = VLLMServerGenerator(engine, server.url, str(tmp_path / "weights"), eos_id=EOS, seed=4)
    assert [p for p, _ in server.calls] == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                                            "finish_weight_update"]
    assert server.calls[2][1] == {"update_info": {"path": str(tmp_path / "weights")}}
    expected = _bf16_masters(engine)
    assert set(server.loaded[0]) == set(expected)
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, expected[n]) for n, t in server.loaded[0].items())

    completions = generator.generate([[5, 6], [7]], 2, 4, temperature=0.5)
    path, body = server.calls[-1]
    assert path == "v1/completions" and body["prompt"] == [[5, 6], [7]] and body["model"] == "policy"
    assert (body["n"], body["max_tokens"], body["temperature"], body["seed"]) == (2, 4, 0.5, 4)
    assert body["return_token_ids"] and body["stop_token_ids"] == [EOS] and body["ignore_eos"]
    assert body["logprobs"] == 0
    # the stop token the server left out of the second completion has no log-probability: None
    assert completions == [Completion(0, (5, 6), (10, EOS), (-0.5, -1.5)), Completion(0, (5, 6), (11, EOS), (-0.5, None)),
                           Completion(1, (7,), (11, EOS), (-0.5, -1.5)), Completion(1, (7,), (12, EOS), (-0.5, None))]

    batch = rollout_batch(completions, torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, width=4)
    engine.step(**batch, old_logps=torch.as_tensor(engine(input_ids=batch["input_ids"], labels=batch["labels"])))
    generator.sync()
    moved = _bf16_masters(engine)
    assert server.calls[-1] == ("finish_weight_update", {"weight_version": "1"})
    assert all(torch.equal(server.loaded[1][n], moved[n]) for n in expected)
    assert sum(not torch.equal(moved[n], expected[n]) for n in expected) > len(expected) // 2
    engine.close()


def test_a_server_without_the_weight_routes_or_a_relative_folder_is_refused(server, tmp_path):
    engine = _engine(False)
    with pytest.raises(ArgumentError, match="absolute"):
        VLLMServerGenerator(engine, server.url, "weights")
    theirs = tmp_path / "policy"          # a folder of the user's, e.g. the model's own: never overwritten
    theirs.mkdir()
    (theirs / "model.safetensors").write_bytes(b"the user's weights")
    with pytest.raises(ArgumentError, match="already holds model.safetensors"):
        VLLMServerGenerator(engine, server.url, str(theirs))
    assert (theirs / "model.safetensors").read_bytes() == b"the user's weights"
    server.fail.add("init_weight_transfer_engine")
    with pytest.raises(MegacompileError, match="VLLM_SERVER_DEV_MODE=1"):
        VLLMServerGenerator(engine, server.url, str(tmp_path / "rollout"))
    with pytest.raises(MegacompileError, match="cannot reach"):
        VLLMServerGenerator(engine, "http://127.0.0.1:9", str(tmp_path / "rollout"), model="policy")
    engine.close()
