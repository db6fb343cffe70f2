"""run.yaml's choice of generator for stage: grpo (train/stages/rollouts.py): each key checked
before anything is written; a copy in fp32 (whole on the device, or its layers streamed) writes the
engine generator's log; vLLM colocated (a stand-in for its API) is handed the masters before each
rollout that follows a step; the sampler's state resumes from a checkpoint."""
from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from megacompile import Engine
from megacompile.errors import ArgumentError, MegacompileError
from megacompile.train import load, log, run
from megacompile.train.stages import grpo as grpo_stage
from megacompile.train.stages import rollouts as rollout_generator
from tests.posttrain import fake_vllm, stage_files
from tests.train import files
from tests.train.killed import TIMED      # the measured columns, which differ run to run



@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return stage_files.workspace(tmp_path_factory.mktemp("generators"))


def _untimed(path: str) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIMED} for row in log.read(path)]


@pytest.mark.parametrize("more, message", [
    ({"generator": "vllm"}, "generator must be one of engine, hf, hf_streamed .*got 'vllm'"),
    ({"generator_dtype": "float32"}, "generator_dtype is the dtype of generator hf's copy"),
    ({"generator": "hf", "generator_dtype": "float16"}, "generator_dtype must be one of bfloat16, float32"),
    ({"use_vllm": "yes"}, "use_vllm must be true or false; got 'yes'"),
    ({"vllm_mode": "remote"}, "vllm_mode applies to sampling with vLLM: set use_vllm: true"),
    ({"vllm_server_port": 9000, "vllm_importance_sampling_clip_min": 0.5},
     "vllm_server_port, vllm_importance_sampling_clip_min apply to sampling with vLLM"),
    ({"use_vllm": True, "generator": "hf"}, "use_vllm: true samples with vLLM .* generator chooses another"),
    ({"use_vllm": True, "vllm_mode": "remote"}, "vllm_mode must be colocate .* or server .*got 'remote'"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_gpu_memory_utilization": 0.5},
     "vllm_gpu_memory_utilization applies to vllm_mode colocate .*vllm serve --gpu-memory-utilization"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_max_model_length": 64},
     "vllm_max_model_length applies to vllm_mode colocate"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_enable_sleep_mode": True},
     "vllm_enable_sleep_mode applies to vllm_mode colocate"),
    ({"use_vllm": True, "vllm_enable_sleep_mode": "yes"}, "vllm_enable_sleep_mode must be true or false"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "localhost:8000"},
     "vllm_server_base_url is the server's address"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": "http://h:1", "vllm_server_port": 9000},
     "say where the server is twice"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_server_port": "8000"},
     "vllm_server_host and vllm_server_port are where vllm serve listens"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_server_timeout": -1}, "vllm_server_timeout is how many seconds"),
    ({"use_vllm": True, "vllm_server_timeout": 60}, "vllm_server_timeout applies to vllm_mode server"),
    ({"use_vllm": True, "vllm_max_model_length": 8}, r"vllm_max_model_length is vLLM's max_model_len, at least a "
                                                     r"row's length \(max_prompt_length \+ max_completion_length = 11\)"),
    ({"use_vllm": True, "vllm_model_impl": "torch"}, "vllm_model_impl must be one of vllm, transformers, auto"),
    ({"use_vllm": True, "vllm_mode": "colocate", "vllm_server_base_url": "http://h:1"},
     "vllm_server_base_url applies to vllm_mode server"),
    ({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 1.5},
     r"vllm_gpu_memory_utilization is the share of the GPU vLLM may take, in \(0, 1\]"),
    ({"use_vllm": True, "vllm_mode": "colocate"}, "VLLMGenerator needs vLLM, which is not installed"),
])
def test_a_bad_generator_key_is_refused_naming_it_before_anything_is_written(tmp_path, work, more, message,
                                                                              monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)         # vLLM is not installed: import fails
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(work, str(tmp_path / "run"), **more))
    with pytest.raises(MegacompileError, match=message):
        load(config, [])
    assert not os.path.exists(tmp_path / "run")


def test_a_generator_key_under_another_stage_is_refused(tmp_path, work):
    config = files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.dpo(work, str(tmp_path / "run"), use_vllm=True))
    with pytest.raises(ArgumentError, match=r"stage dpo: use_vllm \(stage grpo\) belongs to another stage"):
        load(config, [])


def _grpo_log(folder, **more) -> list[dict]:
    config = files.run_yaml(os.path.join(folder, "run.yaml"),
                            **stage_files.grpo(more.pop("work"), os.path.join(folder, "run"), steps=3, **more))
    assert run(load(config, []))["steps"] == 3
    return _untimed(os.path.join(folder, "run", "log.csv"))


@pytest.fixture(scope="module")
def engine_log(tmp_path_factory, work):
    return _grpo_log(str(tmp_path_factory.mktemp("engine")), work=work)


@pytest.mark.parametrize("generator", ["hf", "hf_streamed"])
def test_an_fp32_copy_writes_the_engine_generators_log(tmp_path, work, engine_log, generator):
    assert _grpo_log(str(tmp_path), work=work, generator=generator, generator_dtype="float32") == engine_log
    # the rollouts after a step sample from the moved weights: the copy took them (sync)
    assert len({r["completions/mean_length"] + r["reward"] for r in engine_log}) > 1


def test_a_run_with_a_copy_generator_gives_no_advice_on_generators(tmp_path, work, capsys):
    config = files.run_yaml(os.path.join(tmp_path, "run.yaml"),
                            **stage_files.grpo(work, os.path.join(tmp_path, "run"), steps=1, generator="hf"))
    run(load(config, []))
    out = capsys.readouterr().out
    assert "  stage          grpo:" in out and "would generate a rollout batch" not in out


def test_the_copys_sampler_resumes_from_a_checkpoint(tmp_path, work):
    def settings(name: str, steps: int) -> dict:
        return stage_files.grpo(work, str(tmp_path / name), steps=steps, save_every=1, resume="auto",
                                generator="hf", generator_dtype="float32")
    run(load(files.run_yaml(str(tmp_path / "whole.yaml"), **settings("whole", 3)), []))
    run(load(files.run_yaml(str(tmp_path / "cut.yaml"), **settings("cut", 1)), []))
    assert run(load(files.run_yaml(str(tmp_path / "cut.yaml"), **settings("cut", 3)), []))["steps"] == 3
    whole, cut = _untimed(str(tmp_path / "whole" / "log.csv")), _untimed(str(tmp_path / "cut" / "log.csv"))
    assert cut == whole and len({r["reward"] for r in whole}) > 1
    engine_resume = files.run_yaml(str(tmp_path / "cut.yaml"), **{**settings("cut", 4), "generator": "engine",
                                                                   "generator_dtype": None})
    with pytest.raises(ArgumentError, match="generator 'hf' -> 'engine'"):
        run(load(engine_resume, []))


class _SmallVocabLLM(fake_vllm.LLM):
    """The stand-in's completions kept inside the tiny tokenizer's vocabulary (51 ids, eos 3)."""

    def generate(self, prompts, params, use_tqdm=True):
        out = super().generate(prompts, params, use_tqdm)
        for o in out:
            for c in o.outputs:
                c.token_ids = [t if t == fake_vllm.EOS else t % 40 + 5 for t in c.token_ids]
                if c.logprobs is not None:
                    c.logprobs = [{t: next(iter(step.values()))} for t, step in zip(c.token_ids, c.logprobs)]
        return out


def test_use_vllm_colocated_samples_from_vllm_handed_the_masters_before_each_rollout(tmp_path, work, monkeypatch):
    fake = fake_vllm.module()
    made = []
    monkeypatch.setattr(fake, "LLM", lambda **kw: made.append(_SmallVocabLLM(**kw)) or made[-1])
    monkeypatch.setitem(sys.modules, "vllm", fake)
    stage_files.CALLS.clear()
    ratios, steps = [], []
    measure, step = grpo_stage.sampling_ratio, Engine.step
    monkeypatch.setattr(grpo_stage, "sampling_ratio", lambda *a: ratios.append((a, measure(*a))) or ratios[-1][1])
    monkeypatch.setattr(Engine, "step", lambda engine, **kw: steps.append(kw) or step(engine, **kw))
    config = files.run_yaml(str(tmp_path / "run.yaml"),
                            **stage_files.grpo(work, str(tmp_path / "run"), steps=2, use_vllm=True,
                                               seed=7, top_k=5, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                               vllm_model_impl="transformers", off_policy_mask_threshold=0.5,
                                               vllm_enable_sleep_mode=True))
    run(load(config, []))
    llm, = made
    # the sampler's correction, TRL's default (sequence_mask, cap 3): vLLM's log-probabilities of
    # the sampled tokens against the old policy's, the weights handed to the step as its input
    assert len(ratios) == 2 == len(steps)
    for (args, (weights, metrics)), kw in zip(ratios, steps):
        old, sampled, mask, mode, clip_max, clip_min = args
        # the step's rows are cut after their longest completion (trim_padding): no label past the cut
        cut = kw["input_ids"].shape[1]
        assert not mask[:, cut:].any()
        assert (mode, clip_max, clip_min) == ("sequence_mask", 3.0, None)
        assert torch.equal(kw["sampling_ratio"], weights[:, :cut])
        assert torch.equal(old[:, :cut], kw["old_logps"]) and torch.equal(mask[:, :cut], kw["labels"] != -100)
        # the off-policy mask measures the drift from vLLM's own log-probabilities: a step input
        torch.testing.assert_close(kw["sampling_logps"], sampled[:, :cut], equal_nan=True)
        given = sampled[mask]       # NaN: the stop token vLLM left out of its reply (weighs 1)
        assert set(given[~given.isnan()].tolist()) == {fake_vllm.LOGPROB, fake_vllm.LOGPROB - 1}
    for row, (_, (_, metrics)) in zip(log.read(str(tmp_path / "run" / "log.csv")), ratios):
        assert all(float(row[k]) == pytest.approx(v) for k, v in metrics.items())
    # vllm_mode colocate is TRL's default
    assert llm.args == dict(model=work["model"], dtype="bfloat16", seed=7, tensor_parallel_size=1,
                            gpu_memory_utilization=0.3, max_model_len=11, logprobs_mode="processed_logprobs",
                            model_impl="transformers", enable_sleep_mode=True)
    # asleep between the two rollouts: each woke the weights for the masters, then the cache
    rollout = ["wake weights", "load", "wake kv_cache", "generate", "sleep 2"]
    assert llm.events == ["sleep 2"] + rollout * 2
    # the sampling filters, as vLLM names them
    assert [(p.top_k, p.top_p, p.min_p, p.repetition_penalty) for _, p in llm.requests] == [(5, 0.9, 0.05, 1.1)] * 2
    assert [params.seed for _, params in llm.requests] == [7, 8]          # the seed and the count of calls
    assert [params.n for _, params in llm.requests] == [4, 4]
    assert len(llm.model.loads) == 2                # at the start, and before the rollout after step 1
    # the rewards the run logged are those of vLLM's completions
    rows = log.read(str(tmp_path / "run" / "log.csv"))
    tokenizer = files.tokenizer()
    for (prompts, params), call, row in zip(list(llm.requests), stage_files.CALLS, rows):
        replies = llm.generate(prompts, params)
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for o in replies for c in o.outputs]
        assert call["completions"] == texts
        assert float(row["rewards/starts_like_prompt/mean"]) == pytest.approx(sum(call["rewards"]) / 8)


def test_use_vllm_server_writes_the_weights_in_the_run_folder(tmp_path):
    from tests.posttrain.test_vllm_server import _Server
    from tests.posttrain.test_vllm_generator import _engine
    server = _Server()
    try:
        c = SimpleNamespace(generator="vllm", vllm_mode="server", vllm_server_base_url=server.url, seed=3,
                            vllm_server_timeout=5.0, top_k=0, top_p=1.0, min_p=None, repetition_penalty=1.0)
        generator = rollout_generator.make(c, _engine(False), 3, 0, str(tmp_path / "run"))
        weights = os.path.abspath(str(tmp_path / "run" / rollout_generator.WEIGHTS_DIR))
        assert generator.weights_dir == weights and generator.seed == 3
        assert ("update_weights", {"update_info": {"path": weights}}) in server.calls
        generator.engine.close()
    finally:
        server.http.shutdown()


def test_the_run_waits_for_the_server_up_to_vllm_server_timeout():
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]       # nothing listens there once the socket is closed
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    with pytest.raises(MegacompileError, match=rf"the vLLM server at {url} did not answer in vllm_server_timeout "
                                               r"0.5 s.*raise vllm_server_timeout"):
        rollout_generator.wait_for_server(url, 0.5, poll=0.1)
    assert time.monotonic() - started < 5
    servers = []                        # vllm serve still loading when the run starts: up 0.5 s later
    started = time.monotonic()
    timer = threading.Timer(0.5, lambda: servers.append(ThreadingHTTPServer(("127.0.0.1", port), Health)) or
                            threading.Thread(target=servers[0].serve_forever, daemon=True).start())
    timer.start()
    try:
        rollout_generator.wait_for_server(url, 30.0, poll=0.1)
        assert servers and time.monotonic() - started >= 0.5
    finally:
        timer.join()
        for server in servers:
            server.shutdown()


def test_a_lora_policys_copy_takes_its_adapters_merged_and_writes_the_engine_generators_log(tmp_path, work):
    lora = dict(finetuning_type="lora", lora_rank=4, lora_target="all", lr=5e-2)
    (tmp_path / "engine").mkdir()
    (tmp_path / "hf").mkdir()
    engine = _grpo_log(str(tmp_path / "engine"), work=work, **lora)
    assert _grpo_log(str(tmp_path / "hf"), work=work, generator="hf", generator_dtype="float32", **lora) == engine
    assert len({r["completions/mean_length"] + r["reward"] for r in engine}) > 1     # the adapters moved it
