"""`megacompile plan --stage` / megacompile.plan_stage: a post-training step predicted from its parts,
each checked here against the plain plans it is made of (megacompile.plan of the same rows, a
training step or a forward-only pass), planned independently."""
from __future__ import annotations

import json
import re

import pytest
import torch

from megacompile import plan, plan_stage
from megacompile.cli import main
from megacompile.cost import PROFILES, generate_transient_bytes
from megacompile.cost import generation_memory
from megacompile.cost.decode import decode_step
from megacompile.errors import ArgumentError, BudgetTooSmallError, HostMemoryError
from megacompile.ir.printer import fmt_bytes
from megacompile.planner import model_from_config

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500}
BUDGET = 0.07     # GiB: the h100 profile reserves 67.5 MiB of it; the weights stream every pass
H100 = PROFILES["h100"]
GRPO = dict(prompts=2, num_generations=2, max_prompt_length=8)


@pytest.fixture(scope="module")
def model():
    return model_from_config(dict(CONFIG))


def _plan(model, rows, seq, train=True):
    return plan(model, BUDGET, batch=rows, seq=seq, train=train, fuse=False)


def _stage(model, stage, **keys):
    return plan_stage(model, BUDGET, stage, fuse=False, **keys)


# 2 prompts x 2 generations of 8 + 8 tokens, and of 8 + 16 (planned once for the tests below)
@pytest.fixture(scope="module")
def grpo8(model):
    return _stage(model, "grpo", **GRPO, max_completion_length=8, num_iterations=2, beta=0.04)


@pytest.fixture(scope="module")
def grpo16(model):
    return _stage(model, "grpo", **GRPO, max_completion_length=16)


def test_a_dpo_step_is_the_sft_step_of_twice_the_rows_and_a_reference_forward(model):
    dpo = _stage(model, "dpo", batch=2, seq=48)
    sft, reference = _plan(model, 4, 48), _plan(model, 4, 48, train=False)
    assert [p.name for p in dpo.parts] == ["training", "reference forward"]
    assert (dpo.rows, dpo.seq) == (4, 48)
    assert dpo.total_s == pytest.approx(sft.prediction.step_s + reference.prediction.step_s, rel=1e-9)
    assert dpo.weight_h2d_bytes == sft.weight_h2d_bytes_per_step + reference.weight_h2d_bytes_per_step
    given = _stage(model, "dpo", batch=2, seq=48, precompute_ref_log_probs=True)
    assert [p.name for p in given.parts] == ["training"]
    assert given.total_s == pytest.approx(sft.prediction.step_s, rel=1e-9)
    pretraining = _stage(model, "pt", batch=4, seq=48)      # LlamaFactory's stage pt: the sft step on text
    assert [p.name for p in pretraining.parts] == ["training"]
    assert pretraining.total_s == pytest.approx(sft.prediction.step_s, rel=1e-9)


def test_a_dpo_step_of_reference_free_loss_types_has_no_reference_pass(model):
    sft = _plan(model, 4, 48)
    for free in ("simpo", "orpo", ["simpo", "sft"]):
        alone = _stage(model, "dpo", batch=2, seq=48, loss_type=free)
        assert [p.name for p in alone.parts] == ["training"]
        assert alone.total_s == pytest.approx(sft.prediction.step_s, rel=1e-9)
        assert any("reads the policy alone: no reference pass" in n for n in alone.notes())
    mixed = _stage(model, "dpo", batch=2, seq=48, loss_type=["sigmoid", "sft"])     # TRL's RPO reads it
    assert [p.name for p in mixed.parts] == ["training", "reference forward"]


def test_the_planners_reference_free_losses_are_posttrains():
    from megacompile.planner.posttrain_step import REFERENCE_FREE
    from megacompile.posttrain.dpo_losses import REFERENCE_FREE as READ_BY_THE_LOSS
    assert set(REFERENCE_FREE) == set(READ_BY_THE_LOSS)


def test_a_kto_step_is_the_sft_step_and_a_forward_pass_of_its_kl_rows(model):
    """The logged rewards come out of the training step's forward: no pass of the rows for them."""
    kto = _stage(model, "kto", batch=4, seq=48)
    sft, forward = _plan(model, 4, 48), _plan(model, 4, 48, train=False)
    assert [p.name for p in kto.parts] == ["training", "KL forward"]
    assert kto.total_s == pytest.approx(sft.prediction.step_s + forward.prediction.step_s, rel=1e-9)
    apo = _stage(model, "kto", batch=4, seq=48, loss_type="apo_zero_unpaired")      # no KL term
    assert [p.name for p in apo.parts] == ["training"]


def test_an_rm_step_is_the_sft_step_of_twice_the_rows(model):
    rm = _stage(model, "rm", batch=2, seq=48)
    sft = _plan(model, 4, 48)
    assert [p.name for p in rm.parts] == ["training"] and rm.rows == 4
    assert rm.total_s == pytest.approx(sft.prediction.step_s, rel=1e-9)


def test_grpo_parts_add_up_each_the_plan_of_its_pass(model, grpo8):
    train, forward = _plan(model, 4, 16), _plan(model, 4, 16, train=False)
    assert [p.name for p in grpo8.parts] == ["generation", "old-policy forward", "reference forward", "training"]
    expected = {"generation": 8 * forward.prediction.step_s, "old-policy forward": forward.prediction.step_s,
                "reference forward": forward.prediction.step_s, "training": 2 * train.prediction.step_s}
    assert {p.name: p.seconds for p in grpo8.parts} == pytest.approx(expected, rel=1e-9)
    assert grpo8.total_s == pytest.approx(sum(expected.values()), rel=1e-9)
    assert grpo8.per_optimizer_step_s == pytest.approx(grpo8.total_s / 2, rel=1e-12)
    shown = grpo8.to_json()
    assert shown["total_s"] == pytest.approx(sum(p["seconds"] for p in shown["parts"]), rel=1e-12)
    # beta 0: no reference, one forward pass less
    plain = _stage(model, "grpo", **GRPO, max_completion_length=8, num_iterations=2)
    assert [p.name for p in plain.parts] == ["generation", "old-policy forward", "training"]
    assert plain.total_s == pytest.approx(grpo8.total_s - forward.prediction.step_s, rel=1e-9)


def test_a_rollout_in_micro_batches_is_planned_at_a_micro_batchs_rows(model, grpo8):
    """steps_per_generation 2: the rollout's 4 rows in 2 micro-batches of 2; every pass (a new
    token, the old policy's, the reference's, a training step) once per micro-batch, at 2 rows."""
    micro = _stage(model, "grpo", **GRPO, max_completion_length=8, num_iterations=2, beta=0.04,
                   steps_per_generation=2)
    train, forward = _plan(model, 2, 16), _plan(model, 2, 16, train=False)
    assert micro.rows == 2 and micro.optimizer_steps == 2
    expected = {"generation": 16 * forward.prediction.step_s, "old-policy forward": 2 * forward.prediction.step_s,
                "reference forward": 2 * forward.prediction.step_s, "training": 4 * train.prediction.step_s}
    assert {p.name: p.seconds for p in micro.parts} == pytest.approx(expected, rel=1e-9)
    assert "4 rows in 2 micro-batches of 2" in micro.summary()
    with pytest.raises(ArgumentError, match="do not split into steps_per_generation 3 micro-batches"):
        _stage(model, "grpo", **GRPO, max_completion_length=8, steps_per_generation=3)


def test_engine_generation_streams_the_weights_once_per_new_token(grpo8, grpo16):
    per_pass = grpo8.forward.weight_h2d_bytes_per_step
    assert per_pass > 0.99 * grpo8.forward.weight_bytes      # not resident: each pass brings them all
    assert grpo16.forward.weight_h2d_bytes_per_step == per_pass
    assert grpo8.part("generation").weight_h2d_bytes == 8 * per_pass
    assert grpo16.part("generation").weight_h2d_bytes == 2 * grpo8.part("generation").weight_h2d_bytes
    assert grpo16.part("generation").passes == 16
    assert grpo16.part("generation").seconds == pytest.approx(16 * grpo16.forward.prediction.step_s, rel=1e-9)


def test_a_kv_cache_generator_sends_its_copy_once_and_refuses_a_cache_past_the_budget(model, grpo16):
    kv = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache")
    prefill = _plan(model, 4, 8, train=False)
    copy = 2 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])      # all of it in bfloat16
    generation = kv.part("generation")
    assert generation.weight_h2d_bytes == copy + prefill.weight_h2d_bytes_per_step
    assert "the copy on the device, sent once" in generation.detail
    assert generation.seconds < grpo16.part("generation").seconds
    # 2 x 2 x 32 B of keys and values per token and layer, 2 layers: 512 B per token; 4096 x 40000 tokens
    with pytest.raises(BudgetTooSmallError, match=r"the cache of 4096 rows x 40000 tokens \(78.12 GiB\)"):
        _stage(model, "grpo", prompts=2048, num_generations=2, max_prompt_length=8, max_completion_length=39992,
               generator="kv_cache")


def test_the_copy_and_cache_come_out_of_the_budget_the_engines_parts_plan_in(model):
    # As a run takes them (train/beside.py): the copy in bfloat16 (buffers in their own
    # dtype), the cache of 4 rows x 24 tokens at 512 B a token, and what generate passes through
    # (a prefill of 4 x 8 prompt tokens, a sampling step: cost/generation_memory.py).
    copy = 2 * sum(p.numel() for p in model.parameters()) + sum(b.numel() * b.element_size() for b in model.buffers())
    cache = 4 * 24 * 512 + generate_transient_bytes(model.config, 4, 8, 2)
    budget = int(BUDGET * 2 ** 30)
    kv = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache")
    assert kv.train.budget_bytes == kv.forward.budget_bytes == budget - (copy + cache)
    assert f"{fmt_bytes(copy + cache)} of the budget held beside the engine's plans" in kv.part("generation").detail
    streamed = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="hf_streamed")
    assert streamed.train.budget_bytes == budget - (copy + cache)       # two layers of two: all of it


def test_a_streamed_copys_layers_come_out_of_the_host_budget(model):
    layers = 2 * sum(p.numel() for p in model.model.layers.parameters())      # two decoder layers in bfloat16
    streamed = plan_stage(model, BUDGET, "grpo", fuse=False, host_budget=4, **GRPO, max_completion_length=16,
                          generator="hf_streamed")
    assert streamed.generator_host_bytes == layers and streamed.to_json()["generator_host_bytes"] == layers
    assert streamed.train.host_budget_bytes == 4 * 2 ** 30 - layers
    assert any(n.startswith("the streamed copy's decoder layers are pinned in host memory") for n in streamed.notes())
    on_device = plan_stage(model, BUDGET, "grpo", fuse=False, host_budget=4, **GRPO, max_completion_length=16,
                           generator="kv_cache")
    assert on_device.generator_host_bytes == 0 and on_device.train.host_budget_bytes == 4 * 2 ** 30
    with pytest.raises(HostMemoryError, match="take the whole host budget"):
        plan_stage(model, BUDGET, "grpo", fuse=False, host_budget=layers / 2 ** 30, **GRPO, max_completion_length=16,
                   generator="hf_streamed")


@pytest.mark.slow    # a budget search; the streamed copy's traffic stays in the default tier
def test_a_kv_cache_copy_the_engines_parts_do_not_fit_beside_is_streamed():
    deep = model_from_config({**CONFIG, "num_hidden_layers": 4})
    copy = 2 * sum(p.numel() for p in deep.parameters()) + sum(b.numel() * b.element_size() for b in deep.buffers())
    layer = 2 * sum(p.numel() for p in deep.model.layers[0].parameters())
    cache = 4 * 24 * 2 * 4 * 2 * 32 * 2          # 4 rows x 24 tokens, keys and values of 4 layers, 2 heads of 32
    cache += generate_transient_bytes(deep.config, 4, 8, 2)     # and what generate passes through
    streamed = copy - 2 * layer + cache             # the resident parts, two decoder layers, the cache
    with pytest.raises(BudgetTooSmallError) as e:
        plan(deep, 0.001, batch=4, seq=24, train=True, fuse=False)
    smallest = e.value.minimum_bytes               # the training step's smallest budget
    between = (smallest + streamed + layer) / 2 ** 30     # room for the streamed copy's parts, not the whole copy's
    kv = plan_stage(deep, between, "grpo", fuse=False, **GRPO, max_completion_length=16, generator="kv_cache")
    assert kv.train.budget_bytes == int(between * 2 ** 30) - streamed
    assert "does not fit beside the cache" in kv.part("generation").detail
    with pytest.raises(BudgetTooSmallError, match="the generator holds .* on the device for the whole run") as e:
        plan_stage(deep, (smallest + streamed) / 2 ** 30 - 1e-6, "grpo", fuse=False, **GRPO, max_completion_length=16,
                   generator="hf_streamed")
    assert e.value.minimum_bytes == pytest.approx(smallest + streamed, abs=2)


def test_a_streamed_copy_sends_its_weights_every_token(model):
    kv = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache")
    streamed = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="hf_streamed")
    prefill = _plan(model, 4, 8, train=False)
    copy = 2 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    generation = streamed.part("generation")
    assert generation.weight_h2d_bytes == 16 * copy + prefill.weight_h2d_bytes_per_step
    assert "streamed from the host every step, layer by layer" in generation.detail
    assert generation.seconds > kv.part("generation").seconds     # the copy fits here: resident is quicker


def test_a_streamed_copy_sends_its_weights_again_for_each_prefill_chunk(model, monkeypatch):
    whole = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="hf_streamed").part("generation")
    monkeypatch.setattr(generation_memory, "PREFILL_TOKENS", 4 * 2)      # 4 rows: chunks of 2 of the 8 positions
    chunked = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="hf_streamed").part("generation")
    copy = 2 * sum(t.numel() for t in [*model.parameters(), *model.buffers()])
    assert chunked.weight_h2d_bytes == whole.weight_h2d_bytes + 3 * copy
    assert chunked.seconds == pytest.approx(whole.seconds + 3 * copy / H100.h2d_bw)
    assert "a forward-only prefill of 4 x 8 tokens in 4 chunks (" in chunked.detail
    resident = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache").part("generation")
    monkeypatch.undo()
    assert resident.weight_h2d_bytes == _stage(model, "grpo", **GRPO, max_completion_length=16,
                                               generator="kv_cache").part("generation").weight_h2d_bytes


def test_a_decode_step_is_bound_by_device_memory_when_the_copy_fits_else_by_the_link():
    weights, params = 140 * 10**9, 70 * 10**9        # a 70B model's bfloat16 copy
    on = decode_step(H100, weight_bytes=weights, flop_params=params, rows=16, cache_bytes=0, ops=0,
                     weights_on_device=True)
    assert on.seconds == pytest.approx(weights / (H100.device_bw * H100.memory_efficiency))
    off = decode_step(H100, weight_bytes=weights, flop_params=params, rows=16, cache_bytes=0, ops=0,
                      weights_on_device=False)
    assert off.seconds == pytest.approx(weights / H100.h2d_bw) and off.seconds > 10 * on.seconds
    wide = decode_step(H100, weight_bytes=weights, flop_params=params, rows=4096, cache_bytes=0, ops=0,
                       weights_on_device=True)
    assert wide.seconds == pytest.approx(2 * params * 4096 / (H100.peak_bf16 * H100.matmul_efficiency))


@pytest.mark.parametrize("stage, keys, message", [
    ("ppo", {}, "stage must be one of sft, pt, dpo, kto, rm, grpo; got 'ppo'"),
    ("dpo", {"num_generations": 4}, "stage dpo: num_generations belongs to stage grpo"),
    ("sft", {"precompute_ref_log_probs": True}, "stage sft: precompute_ref_log_probs belongs to stage dpo"),
    ("grpo", {"num_generation": 4}, "stage grpo: no key 'num_generation'; its keys are prompts, num_generations"),
    ("grpo", {"num_generations": 1}, "num_generations (completions per prompt: a group of one has no advantage) "
                                     "must be an int >= 2; got 1"),
    ("grpo", {"max_completion_length": 0}, "max_completion_length must be an int >= 1; got 0"),
    ("grpo", {"prompts": True}, "prompts (prompts per rollout batch) must be an int >= 1; got True"),
    ("grpo", {"beta": -0.1}, "beta must be a finite number >= 0; got -0.1"),
    ("grpo", {"generator": "vllm"}, "generator must be one of engine, kv_cache"),
    ("grpo", {"batch": 8}, "stage grpo takes no batch"),
    ("dpo", {"precompute_ref_log_probs": "yes"}, "precompute_ref_log_probs must be True or False; got 'yes'"),
    ("dpo", {"loss_type": 3}, "stage dpo: loss_type is a loss type's name or a list of them (TRL's); got 3"),
    ("dpo", {"batch": 0}, "batch (preference pairs per step, 2 rows each) must be an int >= 1; got 0"),
    ("dpo", {"sync_ref_model": True, "precompute_ref_log_probs": True}, "sync_ref_model moves a reference"),
    ("dpo", {"sync_ref_model": True, "loss_type": "simpo"}, "sync_ref_model moves a reference"),
    ("sft", {"seq": 0}, "seq (tokens per sequence) must be an int >= 1; got 0"),
])
def test_bad_keys_and_values_are_refused_before_anything_is_planned(stage, keys, message):
    with pytest.raises(ArgumentError) as e:
        plan_stage("no/such/config.json", BUDGET, stage, **keys)       # refused before the config is read
    assert message in str(e.value)


def test_plan_stage_on_the_command_line(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    base = ["plan", "--config", str(path), "--hbm-budget", str(BUDGET), "--host-budget", "4"]
    assert main([*base, "--stage", "grpo", "--prompts", "2", "--num-generations", "2", "--max-prompt-length", "8",
                 "--max-completion-length", "4", "--json"]) == 0
    captured = capsys.readouterr()      # --json: the document on stdout, the text on stderr
    shown, out = json.loads(captured.out), captured.err
    assert [p["name"] for p in shown["parts"]] == ["generation", "old-policy forward", "training"]
    assert shown["parts"][0]["passes"] == 4 and shown["rows"] == 4 and shown["seq"] == 12
    assert shown["total_s"] == pytest.approx(sum(p["seconds"] for p in shown["parts"]), rel=1e-12)
    assert "megacompile plan --stage grpo (2 prompts x 2 generations = 4 rows of 8 + 4 tokens" in out
    assert main([*base, "--stage", "dpo", "--loss-type", "simpo", "--seq", "16", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [p["name"] for p in shown["parts"]] == ["training"] and shown["loss_type"] == ["simpo"]
    assert main([*base, "--stage", "dpo", "--loss-type", "sigmoid,sft", "--seq", "16", "--json"]) == 0
    assert [p["name"] for p in json.loads(capsys.readouterr().out)["parts"]] == ["training", "reference forward"]
    assert main([*base, "--stage", "dpo", "--sync-ref-model", "--seq", "16", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["reference_host_bytes"] > 0 and "the reference's weights are a second" in captured.err
    for flags, message in ((["--num-generations", "4"], "--num-generations plans a post-training step: give --stage"),
                           (["--stage", "dpo", "--loss-type", "simpoo"], "DPO loss_type must be one of"),
                           (["--stage", "dpo", "--num-generations", "4"], "num_generations belongs to stage grpo"),
                           (["--stage", "grpo", "--global-batch", "8"], "--global-batch is not taken with it"),
                           (["--stage", "grpo", "--seq", "64"], "stage grpo takes no seq")):
        assert main([*base, *flags]) == 2
        assert message in capsys.readouterr().err


def test_a_reference_at_every_step_is_its_weights_once_more_on_the_host_checked_against_the_budget(model, grpo8,
                                                                                                   grpo16):
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert grpo8.reference_host_bytes == weights and grpo16.reference_host_bytes == 0     # beta 0.04, beta 0
    moving = _stage(model, "dpo", batch=2, seq=48, sync_ref_model=True)
    assert moving.reference_host_bytes == weights and _stage(model, "dpo", batch=2, seq=48).reference_host_bytes == 0
    held = moving.train.host_bytes + moving.train.stash_bytes
    note = [n for n in moving.notes() if n.startswith("the reference's weights")]
    assert note and note[0].endswith(f"{fmt_bytes(held + weights)} in all")
    assert moving.to_json()["reference_host_bytes"] == weights
    # A host budget the policy fits and the reference beside it does not: refused, naming the smallest that fits.
    budget = (held + weights // 2) / 2 ** 30
    assert plan_stage(model, BUDGET, "dpo", batch=2, seq=48, fuse=False, host_budget=budget).reference_host_bytes == 0
    with pytest.raises(HostMemoryError, match="the reference model's frozen weights") as e:
        plan_stage(model, BUDGET, "dpo", batch=2, seq=48, fuse=False, host_budget=budget, sync_ref_model=True)
    assert e.value.facts["smallest_host_budget_bytes"] == held + weights


def test_the_note_names_what_bounds_generation(grpo16):
    generation = grpo16.part("generation")
    assert generation.compute_s == pytest.approx(16 * grpo16.forward.prediction.compute_s, rel=1e-9)
    # under a MiB of weights a pass against 16 passes' kernels: the link is not what it waits on
    assert generation.weight_h2d_bytes / H100.h2d_bw < 0.1 * generation.compute_s
    assert [n for n in grpo16.notes() if n.startswith("generation is")][0].endswith(": compute bounds it")


def test_an_engine_generator_plan_says_when_a_copy_with_a_cache_would_generate_sooner(model, grpo16):
    """The note's figure is kv_cache's own plan's, within the estimate of its prefill (the forward's
    time scaled to the prompts' tokens), and it names the run's generator for where the copy lives."""
    (note,) = [n for n in grpo16.notes() if n.startswith("generator kv_cache")]
    kv = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache").part("generation")
    said = float(re.search(r"would generate a rollout batch in about ([0-9.]+) ms", note).group(1)) / 1e3
    assert said == pytest.approx(kv.seconds, rel=0.1)
    ratio = float(re.search(r", ([0-9.]+)x less than the engine generator's", note).group(1))
    assert ratio == pytest.approx(grpo16.part("generation").seconds / kv.seconds, rel=0.1) and ratio > 1.25
    assert "a run's generator: hf)" in note and "on the device beside the plans" in note
    assert note in grpo16.to_json()["notes"]
    # one new token: the copy's prefill and a decode step are not quicker than the engine's one pass
    one = _stage(model, "grpo", **GRPO, max_completion_length=1)
    assert not any(n.startswith("generator kv_cache") for n in one.notes())
    chosen = _stage(model, "grpo", **GRPO, max_completion_length=16, generator="kv_cache")
    assert not any(n.startswith("generator kv_cache (") for n in chosen.notes())


def test_a_lora_policys_stage_holds_its_reference_as_adapters_and_its_copy_merged(tmp_path, capsys):
    """--stage with --lora-rank plans the LoRA policy a run trains: its reference holds only the
    adapters on the host (the frozen base is the policy's), and a generation copy is the plain
    model's size, the adapters merged into it."""
    from megacompile.train.methods.lora import lora_for_plan
    lora = lora_for_plan(model_from_config(dict(CONFIG)), 4, "all", torch.bfloat16)
    adapters = sum(p.numel() * p.element_size() for n, p in lora.named_parameters() if "lora_" in n)
    staged = plan_stage(lora, BUDGET, "grpo", fuse=False, **GRPO, max_completion_length=16, beta=0.04,
                        generator="kv_cache")
    assert 0 < staged.reference_host_bytes == adapters
    assert any(n.startswith("the reference holds its own LoRA adapters on the host") for n in staged.notes())
    plain = model_from_config(dict(CONFIG))
    full = plan_stage(plain, BUDGET, "grpo", fuse=False, **GRPO, max_completion_length=16, generator="kv_cache")
    held = re.search(r"([0-9.]+ [KM]iB) of the budget held beside", staged.part("generation").detail).group(1)
    assert f"{held} of the budget held beside" in full.part("generation").detail      # the plain copy's
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["plan", "--config", str(path), "--hbm-budget", str(BUDGET), "--host-budget", "4", "--stage", "grpo",
                 "--prompts", "2", "--num-generations", "2", "--max-prompt-length", "8", "--max-completion-length", "4",
                 "--beta", "0.04", "--lora-rank", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reference_host_bytes"] == adapters


def test_a_dpo_kto_or_grpo_step_with_images_plans_the_vision_tower_in_every_part(capsys):
    """images_per_row (--images-per-row) plans each part's rows with images, the training step's and
    the forward-only passes' alike (grpo's generation too, a copy's with the tower's pass beside it):
    the same plans megacompile.plan makes of those rows (stage rm's too)."""
    import megacompile
    from tests import vlm
    config = vlm.llava().config
    cpu = dict(hardware="cpu", compute_dtype=torch.float32)
    dpo = plan_stage(config, 1.0, "dpo", batch=1, seq=vlm.SEQ, images_per_row=1, **cpu)
    assert [p.name for p in dpo.parts] == ["training", "reference forward"]
    for part, train in ((dpo.train, True), (dpo.forward, False)):
        alone = megacompile.plan(config, hbm_budget=1.0, batch=2, seq=vlm.SEQ, train=train, images_per_row=1, **cpu)
        assert part.vision is not None and part.vision.vision_peak_bytes > 0
        assert part.predicted_peak_bytes == alone.predicted_peak_bytes
    text = plan_stage(config, 1.0, "dpo", batch=1, seq=vlm.SEQ, **cpu)
    assert text.train.vision is None and text.train.prediction.step_s < dpo.train.prediction.step_s
    kto = plan_stage(config, 1.0, "kto", batch=2, seq=vlm.SEQ, images_per_row=1, **cpu)
    assert [p.name for p in kto.parts] == ["training", "KL forward"]
    assert kto.forward.vision is not None
    grpo = plan_stage(config, 1.0, "grpo", images_per_row=1, prompts=1, num_generations=2,
                      max_prompt_length=vlm.SEQ - 4, max_completion_length=4, **cpu)
    assert [p.name for p in grpo.parts] == ["generation", "old-policy forward", "training"]
    alone = megacompile.plan(config, hbm_budget=1.0, batch=2, seq=vlm.SEQ, train=False, images_per_row=1, **cpu)
    assert grpo.forward.vision is not None and grpo.forward.predicted_peak_bytes == alone.predicted_peak_bytes
    assert grpo.train.vision is not None
    rm = plan_stage(config, 1.0, "rm", batch=1, seq=vlm.SEQ, images_per_row=1, **cpu)
    assert [p.name for p in rm.parts] == ["training"] and rm.train.vision is not None
    # as `plan --run` plans it: the reward model the run trains, on the model's rows with images
    from megacompile.planner import model_from_config
    from megacompile.posttrain import RewardModel
    from megacompile.train.stages.rm import planned_rows
    model = model_from_config(config)
    scored = plan_stage(model, 1.0, "rm", batch=1, seq=vlm.SEQ, images_per_row=1, trained=RewardModel.of(model),
                        inputs=planned_rows, **cpu)
    assert scored.train.vision is not None and scored.train.vision.vision_peak_bytes > 0
    assert scored.train.vision.vision_params == rm.train.vision.vision_params
    assert "vision tower" in scored.train.summary()
    # a copy with a cache: its generate's passing tensors count the tower's pass over the rollout's images
    copied = plan_stage(config, 1.0, "grpo", images_per_row=1, prompts=1, num_generations=2,
                        max_prompt_length=vlm.SEQ - 4, max_completion_length=4, generator="kv_cache", **cpu)
    alone = plan_stage(config, 1.0, "grpo", prompts=1, num_generations=2, max_prompt_length=vlm.SEQ - 4,
                       max_completion_length=4, generator="kv_cache", **cpu)
    held = lambda staged: re.search(r"([0-9.]+ [KM]iB) of the budget held beside",  # noqa: E731
                                    staged.part("generation").detail).group(1)
    assert held(copied) != held(alone) and copied.part("generation").seconds > alone.part("generation").seconds
