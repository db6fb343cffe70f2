"""`megacompile plan --run run.yaml`: the step a run would take, planned before it on any machine.

The plan it prints is the plan the run then runs (every memory and schedule figure of the run's
plan.json, on the cpu backend where both can be made here), with the run's config edits (added
tokens, rope_scaling), its fine-tuning method and its accumulation; a post-training run plans as
`plan --stage` does with the same keys; what the run.yaml decides is not taken twice."""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile

import pytest

from megacompile.cli import main
from megacompile.cost import host_memory
from tests.posttrain import fake_vllm, stage_files
from tests.train import files

# Every field of plan.json that says what the step holds and moves, and how it is scheduled; the
# timings are measured calibrations, the backend's name and the measured peak the run's alone.
TIMED = {"backend", "measured_device_peak_bytes", "predicted_step_s", "predicted_tokens_per_s", "predicted_tflops_6nd",
         "predicted_hardware_tflops", "host_busy_s", "pass_seconds", "trace_seconds", "predicted_compute_s",
         "predicted_exposed_s", "predicted_exposed_transfer_s", "predicted_exposed_update_s", "h2d_busy_s",
         "d2h_busy_s", "network_busy_s"}


def _run_yaml(tmp_path, **more) -> str:
    text = str(tmp_path / "text.jsonl")
    with open(text, "w") as f:
        for s in files.SENTENCES * 3:
            f.write(json.dumps({"text": s}) + "\n")
    settings = dict(model=files.model_dir(str(tmp_path / "llama"), dim=32), data=[text], seq=16, batch=2, grad_accum=2,
                    steps=1, finetuning_type="lora", lora_rank=4, rope_scaling="linear", add_tokens=["zorblax"],
                    hbm_budget=1, compute_dtype="bfloat16", device="cpu", run_dir=str(tmp_path / "run")) | more
    return files.run_yaml(str(tmp_path / "r.yaml"), **{k: v for k, v in settings.items() if v is not None})


def _ran_as_planned(tmp_path, capsys, path: str, before: dict) -> dict:
    """The run's plan.json, after the run, its every untimed figure the plan's before it."""
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    shared = [k for k in ran if k in before and k not in TIMED]
    assert {k: before[k] for k in shared} == {k: ran[k] for k in shared}
    return ran


def _plan_json(capsys, *argv) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_plan_before_the_run_is_the_plan_the_run_runs(tmp_path, capsys):
    path = _run_yaml(tmp_path)
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu")
    assert not os.path.exists(tmp_path / "run")       # nothing of the run is written, its data not read
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    shared = [k for k in ran if k in before and k not in TIMED]
    assert len(shared) > 50
    assert {k: before[k] for k in shared} == {k: ran[k] for k in shared}
    # What the run.yaml changed in the model and the step is in both: the grown vocabulary's rows
    # trained whole beside the adapters (additional_target), and two micro-batches a step.
    assert before["grad_accum"] == 2
    vocab_rows, dim = 64, 32       # 51 tokens and the one added, rounded up to 64 rows
    linears = [(32, 32), (32, 16), (32, 16), (32, 32), (32, 64), (32, 64), (64, 32)]    # q k v o gate up down
    adapters = 2 * sum(4 * (fan_in + fan_out) for fan_in, fan_out in linears)     # rank 4, both blocks
    assert before["trainable_params"] == 2 * vocab_rows * dim + adapters


def test_a_cpu_run_without_a_budget_is_planned_on_its_device_at_the_budget_it_takes(tmp_path, capsys):
    """device: cpu and no hbm_budget: the run takes budget_fraction of its weights (or its smallest
    plan); plan --run, without --hardware, plans that on the cpu backend, not an h100's 90%."""
    path = _run_yaml(tmp_path, hbm_budget=None, finetuning_type="full", lora_rank=None, rope_scaling=None,
                     add_tokens=None)
    before = _plan_json(capsys, "--run", path)
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    assert before["hardware"] == ran["hardware"] and before["budget_bytes"] == ran["budget_bytes"]
    shared = [k for k in ran if k in before and k not in TIMED]
    assert {k: before[k] for k in shared} == {k: ran[k] for k in shared}


def test_the_run_yaml_and_its_overrides_decide_what_the_flags_would(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(host_memory, "cgroup_memory_limit", lambda: None)    # the machine's RAM, in any container
    path = _run_yaml(tmp_path, finetuning_type="full", lora_rank=None, add_tokens=None, rope_scaling=None)
    full = _plan_json(capsys, "--run", path, "--hardware", "h100")
    assert full["grad_accum"] == 2 and full["budget_bytes"] == 2 ** 30
    assert full["host_budget_source"] == "this machine"
    same = _plan_json(capsys, "--config", str(tmp_path / "llama"), "--hardware", "h100", "--batch", "2", "--seq", "16",
                      "--hbm-budget", "1")
    assert full["device_peak_bytes"] == same["device_peak_bytes"]       # one micro-batch's peak either way
    assert full["trainable_params"] == same["trainable_params"]
    wider = _plan_json(capsys, "--run", path, "--hardware", "h100", "seq=32", "host_budget=4", "grad_accum=1")
    assert (wider["grad_accum"], wider["host_budget_bytes"], wider["host_budget_source"]) == (1, 4 * 2 ** 30,
                                                                                              "run.yaml")
    assert wider["device_peak_bytes"] > full["device_peak_bytes"]
    # The run's length: its steps at the predicted optimizer step (two micro-batches of the one planned).
    assert main(["plan", "--run", path, "--hardware", "h100", "steps=5000"]) == 0
    said = capsys.readouterr().out
    longer = _plan_json(capsys, "--run", path, "--hardware", "h100", "steps=5000")
    assert longer["run_steps"] == 5000
    assert longer["run_predicted_s"] == pytest.approx(5000 * 2 * longer["predicted_step_s"], rel=1e-9)   # a run each
    assert "  run            5,000 optimizer steps x " in said


@pytest.mark.parametrize("argv, message", [
    (["--batch", "4", "--dtype", "float32"], "--batch, --dtype: with --run the run.yaml says them; give batch=... "
                                             "compute_dtype=... after the run.yaml to plan another value"),
    (["--beta", "0.1"], "--beta: with --run the run.yaml says it; give beta=..."),
    (["hbm_budget=none_such"], "hbm_budget"),
])
def test_a_flag_the_run_yaml_decides_is_refused_naming_its_key(tmp_path, capsys, argv, message):
    path = _run_yaml(tmp_path)
    assert main(["plan", "--run", path, *argv]) == 2
    assert message in capsys.readouterr().err


def test_settings_without_a_run_yaml_and_the_bundled_model_are_refused(tmp_path, capsys):
    config = files.model_dir(str(tmp_path / "llama"), dim=32)
    assert main(["plan", "--config", config, "seq=64"]) == 2
    assert "seq=64: key=value settings are a run.yaml's, laid over it: give --run run.yaml before them" in \
        capsys.readouterr().err
    path = files.run_yaml(str(tmp_path / "b.yaml"), model="bundled", data="bundled", seq=16, steps=1)
    assert main(["plan", "--run", path]) == 2
    assert "plan --run plans a Hugging Face model folder or config: give model: PATH" in capsys.readouterr().err


def test_a_post_training_run_plans_as_plan_stage_with_its_keys(tmp_path, capsys, monkeypatch):
    work = stage_files.workspace(tmp_path)
    path = files.run_yaml(str(tmp_path / "g.yaml"), **stage_files.grpo(work, str(tmp_path / "run"), beta=0.04,
                                                                         steps_per_generation=2))
    staged = _plan_json(capsys, "--run", path, "--hardware", "h100")
    # batch 8 x steps_per_generation 2 = 16 completions a rollout, 4 to a prompt: 4 prompts
    flags = _plan_json(capsys, "--config", work["model"], "--stage", "grpo", "--hardware", "h100", "--hbm-budget", "1",
                       "--dtype", "float32", "--prompts", "4", "--num-generations", "4", "--max-prompt-length", "8",
                       "--max-completion-length", "3", "--steps-per-generation", "2", "--beta", "0.04")
    # steps 2 of grad_accum 1 micro-batch pass each: a rollout batch (2 passes) is one optimizer step's twice
    assert staged.pop("run_predicted_s") == pytest.approx(2 * staged["total_s"] / 2, rel=1e-9)
    assert _less_the_norm(staged, 2) == _less_the_norm(flags, 2) | {"run_steps": 2}
    assert (staged["prompts"], staged["rows"], staged["beta"]) == (4, 8, 0.04)     # a micro-batch: batch 8 rows
    dpo = files.run_yaml(str(tmp_path / "d.yaml"), **stage_files.dpo(work, str(tmp_path / "run"), grad_accum=2))
    assert main(["plan", "--run", dpo, "--hardware", "h100", "--json"]) == 0
    out = capsys.readouterr()
    pairs = _plan_json(capsys, "--config", work["model"], "--stage", "dpo", "--hardware", "h100", "--hbm-budget", "1",
                       "--dtype", "float32", "--batch", "2", "--seq", "16", "--loss-type", "sigmoid")
    said = json.loads(out.out)
    assert said.pop("run_predicted_s") == pytest.approx(3 * 2 * said["total_s"], rel=1e-9)    # steps 3 of 2 each
    assert _less_the_norm(said, 1) == _less_the_norm(pairs, 1) | {"grad_accum": 2, "run_steps": 3}
    assert "grad_accum 2: an optimizer step is 2 of these steps" in out.err
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm.module())       # vLLM needs a GPU: not installed here
    vllm = files.run_yaml(str(tmp_path / "v.yaml"), **stage_files.grpo(work, str(tmp_path / "run"), use_vllm=True))
    assert main(["plan", "--run", vllm]) == 2
    assert "give generator: hf (a copy with a key-value cache" in capsys.readouterr().err


def _less_the_norm(staged: dict, passes: int) -> dict:
    """A --stage plan's JSON less the seconds of its training step (`passes` of them), which a run's
    plan holds with the gradients' norm taken (tests/train/test_stage_run_plan.py) and --stage
    without it; the rest, the other parts' seconds among it, must be the same."""
    training = next(p for p in staged["parts"] if p["name"] == "training")
    assert training["seconds"] == pytest.approx(passes * staged["train_step_s"], rel=1e-9)
    others = [p for p in staged["parts"] if p["name"] != "training"]
    assert staged["total_s"] == pytest.approx(training["seconds"] + sum(p["seconds"] for p in others), rel=1e-9)
    return {k: v for k, v in staged.items() if k not in ("train_step_s", "total_s", "per_optimizer_step_s", "parts")
            } | {"parts": [p for p in staged["parts"] if p["name"] != "training"] + [
                {k: v for k, v in training.items() if k not in ("seconds", "compute_s")}]}


@pytest.mark.parametrize("stage", ["sft", pytest.param("dpo", marks=pytest.mark.slow),
                                   pytest.param("grpo", marks=pytest.mark.slow)])
def test_a_run_given_epochs_plans_the_steps_its_data_makes_of_them(tmp_path, capsys, monkeypatch, stage):
    """LlamaFactory's runs give num_train_epochs: the plan reads and tokenises the data as the run
    does (max_samples, the held-out split) to count the optimizer steps, and leaves nothing behind."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if stage == "sft":
        path = files.run_yaml(str(tmp_path / "e.yaml"), model=files.model_dir(str(tmp_path / "llama"), dim=32),
                              data=[files.chats(str(tmp_path / "chats.jsonl"), n=23)], max_samples=21,
                              eval_fraction=0.2, seq=32, batch=2, grad_accum=2, num_train_epochs=1.5, device="cpu",
                              hbm_budget=1, run_dir=str(tmp_path / "run"))
    else:
        work = stage_files.workspace(tmp_path)
        make = stage_files.dpo if stage == "dpo" else stage_files.grpo
        more = dict(grad_accum=2) if stage == "dpo" else dict(eval_fraction=0.25)
        path = files.run_yaml(str(tmp_path / "e.yaml"), **make(work, str(tmp_path / "run"), steps=None, epochs=2,
                                                               **more))
    planned = _plan_json(capsys, "--run", path, "--hardware", "h100")
    assert not os.path.exists(tmp_path / "run")
    assert not [f for f in os.listdir(scratch) if f.startswith("megacompile")]       # torch's own caches aside
    assert main(["plan", "--run", path, "--hardware", "h100"]) == 0
    assert f"epochs = {planned['run_steps']:,} optimizer steps x " in capsys.readouterr().out
    assert main(["train", "--config", path]) == 0
    said = capsys.readouterr().out
    assert re.search(rf"step +{planned['run_steps']}/{planned['run_steps']} \|", said)     # the run's last step


@pytest.mark.slow     # the second case of the first test's guard: a vision-language model's
def test_a_vision_language_run_plans_with_the_images_its_rows_hold(tmp_path, capsys, monkeypatch):
    from tests.train import vlm_files
    monkeypatch.chdir(tmp_path)
    vlm_files.model_dir("model")
    vlm_files.records("data.jsonl")
    vlm_files.records("eval.jsonl", n=4)
    settings = vlm_files.settings("run", seq=64, steps=1, hbm_budget=1)
    del settings["resume"], settings["export"]
    path = files.run_yaml("r.yaml", **settings)
    # its first micro-batch: two rows of one image each (the data's every fourth record has none)
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu", "--images-per-row", "1")
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    assert before["vision"]["images"]["images_per_row"] == 1       # said by the plan made from a config alone
    shared = [k for k in ran if k in before and k not in TIMED | {"vision"}]
    assert {k: before[k] for k in shared} == {k: ran[k] for k in shared}


def test_a_weighted_supervised_loss_plans_its_objective(tmp_path, capsys):
    """loss_type eaft (dft the same) trains its objective over the whole logits: the plan before the
    run is the run's, and not the cross-entropy run's."""
    path = _run_yaml(tmp_path, finetuning_type="full", lora_rank=None, add_tokens=None, rope_scaling=None,
                     loss_type="eaft")
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu")
    plain = _plan_json(capsys, "--run", path, "--hardware", "cpu", "loss_type=nll")
    assert not os.path.exists(tmp_path / "run")
    ran = _ran_as_planned(tmp_path, capsys, path, before)
    assert plain["arena_tensor_count"] != ran["arena_tensor_count"]


@pytest.mark.parametrize("method", ["lora", "full"])
def test_a_reward_model_run_plans_the_reward_model_it_trains(tmp_path, capsys, monkeypatch, method):
    """stage rm trains the decoder under a one-number score, not the causal LM: the plan counts the
    parameters the run trains and holds (a score, no lm_head), and its training step is the run's
    (LlamaFactory's LoRA reward model of a tiny Qwen3: 16,384 trainable and 330,112 frozen planned,
    16,448 and 202,112 trained)."""
    import megacompile.planner
    work = stage_files.workspace(tmp_path)
    more = dict(finetuning_type="lora", lora_rank=4) if method == "lora" else {}
    path = files.run_yaml(str(tmp_path / "rm.yaml"), **stage_files.dpo(work, str(tmp_path / "run"), stage="rm", steps=1,
                                                                        **more))
    planned = []
    plan_stage = megacompile.planner.plan_stage
    monkeypatch.setattr(megacompile.planner, "plan_stage", lambda *a, **k: planned.append(plan_stage(*a, **k))
                        or planned[-1])
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu")
    assert main(["train", "--config", path]) == 0
    said = capsys.readouterr().out
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    step = planned[0].train.to_json()
    counts = ("trainable_params", "frozen_params")
    assert [step[k] for k in counts] == [ran[k] for k in counts]
    assert [before.get(k) for k in counts] == [ran[k] for k in counts]        # --json says them
    assert f"model          {ran['trainable_params']:,} trainable parameters" in said
    # the training step planned is the run's: its rows scored at their last token (no logits over
    # the vocabulary), its gradients' norm taken at the end (max_grad_norm) as the run takes it
    shared = [k for k in ran if k in step and k not in TIMED | {"schedule", "arena_tensors"}]
    assert len(shared) > 50
    assert {k: step[k] for k in shared} == {k: ran[k] for k in shared}
    ops = [[{k: v for k, v in op.items() if k not in ("predicted", "device_bytes_during", "device_bytes_after")}
            for op in where["schedule"]] for where in (step, ran)]
    assert ops[0] == ops[1] and any(op["op"] == "clip_grads" for op in ops[0])
    names = [name for name, _ in planned[0].train.captured.state.items()]
    assert any(n.endswith("score.weight") for n in names) and not any("lm_head" in n for n in names)


@pytest.mark.parametrize("max_grad_norm", [1.0, None])
def test_the_plan_before_the_run_computes_the_gradients_norm_as_the_run_does(tmp_path, capsys, max_grad_norm):
    """The run takes the gradients' norm every step (to clip at max_grad_norm; at null, to log it):
    the plan before it does too, so it does not offer updates as gradients land, which clipping
    rules out."""
    path = _run_yaml(tmp_path, finetuning_type="full", lora_rank=None, add_tokens=None, rope_scaling=None,
                     grad_accum=1, max_grad_norm=max_grad_norm)
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu")
    bare = _plan_json(capsys, "--config", str(tmp_path / "llama"), "--hardware", "cpu", "--batch", "2", "--seq", "16",
                      "--hbm-budget", "1")
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    with open(tmp_path / "run" / "plan" / "plan.json") as f:
        ran = json.load(f)
    landing = "predicted_step_s_updates_as_gradients_land"
    assert landing in bare and landing not in ran and landing not in before


def test_a_run_with_the_routers_loss_plans_the_term_whole_in_each_micro_batch(tmp_path, capsys):
    """moe_aux_loss_coef: the run trains the model inside router_loss.WholeTerm, its rows carrying an
    attention_mask and a router_scale; the plan before the run is that step's, not the bare model's."""
    from tests.train.test_router_loss import _mixtral_dir
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    path = files.run_yaml(str(tmp_path / "moe.yaml"), model=model, data=[files.chats(str(tmp_path / "c.jsonl"))],
                          seq=16, batch=2, steps=1, device="cpu", moe_aux_loss_coef=0.01,
                          run_dir=str(tmp_path / "run"))
    before = _plan_json(capsys, "--run", path, "--hardware", "cpu")
    bare = _plan_json(capsys, "--run", path, "--hardware", "cpu", "moe_aux_loss_coef=0")
    ran = _ran_as_planned(tmp_path, capsys, path, before)
    assert ran["measured_device_peak_bytes"] == before["device_peak_bytes"] != bare["device_peak_bytes"]
