"""run.yaml's post-training keys: each checked (key, value, fix) before anything is read or
written; a key of another stage refused."""
from __future__ import annotations

import os

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from tests.posttrain import stage_files
from tests.train import files


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return stage_files.workspace(tmp_path_factory.mktemp("stage_keys"))


@pytest.mark.parametrize("stage, more, message", [
    ("sft", {"beta": 0.1}, r"stage sft: beta \(stage dpo or kto or grpo\) belongs to another stage"),
    ("dpo", {"num_generations": 4}, r"stage dpo: num_generations \(stage grpo\) belongs to another stage"),
    ("grpo", {"label_smoothing": 0.1}, r"label_smoothing \(stage dpo\) belongs to another stage"),
    ("ppo", {}, "stage 'ppo' is not supported"),
    ("rlhf", {}, "stage must be one of sft, pt, dpo, kto, rm, grpo; got 'rlhf'"),
    ("dpo", {"beta": 0}, "beta must be a positive number, e.g. 0.1; got 0"),
    ("dpo", {"loss_type": "dapo"}, "DPO loss_type must be one of sigmoid, hinge, ipo, .*; got 'dapo'"),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0]},
     r"loss_weights is a list of one number per loss type \(2: sigmoid, sft\)"),
    ("dpo", {"loss_type": "exo_pair"}, r"label_smoothing is exo_pair's epsilon and must be in \(0, 1\)"),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "rpo_alpha": 1.0}, "rpo_alpha adds loss_type sft"),
    ("dpo", {"pref_ftx": -0.5}, r"pref_ftx must be >= 0 \(the weight of the chosen completions' NLL"),
    ("kto", {"pref_ftx": -0.5}, r"pref_ftx must be >= 0 \(the weight of the chosen completions' NLL"),
    ("dpo", {"precompute_ref_log_probs": "yes"}, "precompute_ref_log_probs must be true or false"),
    ("grpo", {"scale_rewards": "std"}, r"scale_rewards must be one of group, batch, none \(or true: group"),
    ("grpo", {"importance_sampling_level": "seq"}, "importance_sampling_level must be one of token, sequence"),
    ("grpo", {"delta": 0.5}, "delta caps the importance weight from above .* must be > 1"),
    ("grpo", {"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\]"),
    ("grpo", {"mask_truncated_completions": "yes"}, "mask_truncated_completions must be true or false"),
    ("grpo", {"temperature": 0}, "temperature must be > 0"),
    ("dpo", {"label_smoothing": 0.5}, r"label_smoothing must be in \[0, 0.5\)"),
    ("dpo", {"packing": False}, "stage dpo: packing is not taken by dpo"),
    ("grpo", {"num_generations": 1}, "num_generations must be a whole number >= 2; got 1"),
    ("grpo", {"batch": 6}, r"batch 6 x steps_per_generation 1 = 6 completions .* must be a multiple of "
                           "num_generations 4"),
    ("grpo", {"batch": 3, "grad_accum": 2}, r"batch 3 x steps_per_generation 2 = 6"),     # TRL's default: grad_accum
    ("grpo", {"batch": 2, "grad_accum": 2, "steps_per_generation": 3},
     "steps_per_generation 3 must be a multiple of grad_accum 2.* give steps_per_generation 4"),
    ("grpo", {"steps_per_generation": 2, "generation_batch_size": 24},
     r"steps_per_generation 2 and generation_batch_size 24 disagree \(generation_batch_size = batch 8 x"),
    ("grpo", {"generation_batch_size": 12}, "generation_batch_size 12 must be a multiple of batch 8"),
    ("grpo", {"steps_per_generation": 0}, "steps_per_generation must be a whole number >= 1; got 0"),
    ("grpo", {"steps_per_generation": 2, "num_iterations": 2, "steps": 6},
     r"steps 6 must be a multiple of 4, the optimizer steps of a rollout batch \(steps_per_generation 2 / "
     r"grad_accum 1 x num_iterations 2\)"),
    ("grpo", {"vllm_importance_sampling_mode": "token_mask"}, "vllm_importance_sampling_mode applies to sampling "
                                                               "with vLLM: set use_vllm: true"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_mode": "tis"},
     "vllm_importance_sampling_mode must be one of token_truncate"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_cap": -1},
     "vllm_importance_sampling_clip_max must be a positive number"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_cap": 2.0,
              "vllm_importance_sampling_clip_max": 4.0}, "_cap is TRL's old name of vllm_importance_sampling_clip_max"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_clip_min": 2.0,
              "vllm_importance_sampling_clip_max": 2.0}, r"clip_min \(2.0\) must be below"),
    ("grpo", {"use_vllm": True, "vllm_mode": "server", "vllm_importance_sampling_mode": "token_truncate",
              "vllm_importance_sampling_clip_max": None}, "token_truncate clamps the ratio.* both are null"),
    ("dpo", {"ld_alpha": 0.5, "rpo_alpha": 1.0}, "ld_alpha reweighs the completions' log-probabilities, and sft "),
    ("dpo", {"ld_alpha": 2}, r"ld_alpha weighs the tokens past the shorter completion's length, in \[0, 1\]"),
    ("dpo", {"loss_type": "bco_pair", "f_divergence_type": "forward_kl"},
     "f_divergence_type forward_kl applies to loss types sigmoid.*not to bco_pair"),
    ("dpo", {"f_divergence_type": "alpha", "f_alpha_divergence_coef": 0.3}, "f_divergence_type must be one of"),
    ("kto", {"f_divergence_type": "forward_kl"}, r"f_divergence_type \(stage dpo\) belongs to another stage"),
    ("grpo", {"loss_type": "vespo", "use_vllm": True, "vllm_mode": "server"},
     "loss_type vespo takes the sampler's correction token by token .*got sequence_mask"),
    ("grpo", {"loss_type": "sapo", "sapo_temperature_neg": 0}, "sapo_temperature_neg must be a positive number"),
    ("grpo", {"generation_kwargs": {"max_tokens": 5, "top_k": 3}}, "generation_kwargs: max_tokens is not supported"),
    ("grpo", {"generation_kwargs": {"temperature": 0.7}}, "temperature divides the training log-probabilities too"),
    ("grpo", {"generation_kwargs": {"top_p": 2.0}}, r"top_p must be in \(0, 1\]"),
    ("grpo", {"top_k": -1}, r"top_k is the number of likeliest tokens a rollout draws from, a whole number >= 0"),
    ("grpo", {"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ("grpo", {"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
    ("grpo", {"repetition_penalty": 0}, "repetition_penalty must be a positive number"),
    ("dpo", {"top_p": 0.9}, r"top_p \(stage grpo\) belongs to another stage"),
    ("grpo", {"epsilon": 1.5}, r"epsilon must be in \(0, 1\), e.g. 0.2; got 1.5"),
    ("grpo", {"temperature": -1}, "temperature must be > 0"),
    ("grpo", {"reward_funcs": []}, "reward_funcs is a list of reward functions"),
    ("grpo", {"reward_funcs": ["no_such_module:f"]}, "reward function 'no_such_module:f' cannot be loaded"),
    ("grpo", {"reward_weights": [1.0]}, r"reward_weights is a list of one number per reward function \(2\)"),
    ("grpo", {"num_iterations": 2, "steps": 3}, "steps 3 must be a multiple of 2, the optimizer steps of a rollout"),
    ("grpo", {"seq": 64}, "stage grpo: seq is not taken by grpo"),
    ("grpo", {"loss_type": "sigmoid"}, "loss_type for stage grpo must be one of grpo, bnpo, dr_grpo, dapo"),
])
def test_a_bad_key_is_refused_naming_it_before_anything_is_written(tmp_path, work, stage, more, message):
    make = stage_files.dpo if stage == "dpo" else stage_files.grpo
    settings = make(work, str(tmp_path / "run"))
    settings = {**settings, "stage": stage, **more}
    if stage in ("sft", "kto", "rlhf"):
        settings = {k: v for k, v in settings.items() if k not in ("reward_funcs", "reward_weights", "num_generations",
                                                                   "max_prompt_length", "max_completion_length",
                                                                   "temperature")}
        settings["data"] = work["pairs"]
    with pytest.raises(ArgumentError, match=message):
        load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    assert not os.path.exists(tmp_path / "run")


def test_data_of_another_shape_is_refused_before_the_run_folder_is_made(tmp_path, work):
    config = files.run_yaml(str(tmp_path / "run.yaml"), **{**stage_files.dpo(work, str(tmp_path / "run")),
                                                            "data": work["prompts"]})
    with pytest.raises(ArgumentError, match="a preference record needs prompt, chosen and rejected; missing chosen"):
        run(load(config, []))
    config = files.run_yaml(str(tmp_path / "run.yaml"), **{**stage_files.dpo(work, str(tmp_path / "run")), "seq": 3})
    with pytest.raises(ArgumentError, match="hold no preference pairs: the prompts of its 10 pairs each fill rows "
                                            "of seq 3, and truncation_mode keep_start drops them as TRL does"):
        run(load(config, []))
    assert not os.path.exists(tmp_path / "run")


@pytest.mark.parametrize("stage, more, want", [
    ("dpo", {"pref_beta": 0.2, "pref_loss": "ipo", "dpo_label_smoothing": 0.1}, (0.2, "ipo", 0.1)),
    ("dpo", {"pref_loss": "hinge"}, (0.1, "hinge", 0.0)),
    ("dpo", {"pref_loss": "simpo", "pref_beta": 2.0}, (2.0, "simpo", 0.0)),
    ("kto", {"pref_beta": 0.3, "pref_loss": "sigmoid"}, (0.3, "kto", None)),     # kto's loss is its own
])
def test_llamafactorys_preference_keys_are_read_as_trls(tmp_path, work, stage, more, want, capsys):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**stage_files.dpo(work, str(tmp_path / "run")),
                                                              "stage": stage, **more}), [])
    assert (c.beta, c.loss_type, c.label_smoothing) == want
    if stage == "kto":
        assert "pref_loss 'sigmoid' is not read by stage kto" in capsys.readouterr().out


def test_pref_loss_orpo_trains_llamafactorys_orpo(tmp_path, work):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**stage_files.dpo(work, str(tmp_path / "run")),
                                                            "pref_loss": "orpo"}), [])
    assert c.loss_type == "orpo_per_pair"


@pytest.mark.parametrize("value, words", [("kto_pair", "pref_loss takes sigmoid, hinge, ipo, orpo, simpo here"),
                                          ("dpo", "pref_loss takes sigmoid, hinge, ipo, orpo, simpo here")])
def test_a_pref_loss_megacompile_does_not_have_is_refused(tmp_path, work, value, words):
    with pytest.raises(ArgumentError, match=words):
        load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.dpo(work, str(tmp_path / "run")),
                            pref_loss=value), [])


@pytest.mark.parametrize("stage", ["dpo", "kto", "rm", "grpo"])
def test_images_are_refused_by_each_post_training_stage_without_a_processor(tmp_path, work, stage):
    import json
    from megacompile.train.data.tokens import load_tokenizer
    from megacompile.train.stages import kind
    records = {"dpo": {"prompt": "<image> what is it", "chosen": "a cat", "rejected": "a dog"},
               "kto": {"prompt": "<image> what is it", "completion": "a cat", "label": True},
               "grpo": {"prompt": "<image> what is it"}}
    record = {**records.get(stage, records["dpo"]), "images": ["cat.png"]}
    path = tmp_path / "media.jsonl"
    path.write_text(json.dumps(record) + "\n")
    make = stage_files.grpo if stage == "grpo" else stage_files.dpo
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**make(work, str(tmp_path / "run")), "stage": stage,
                                                            "data": str(path), "eval_fraction": 0, "eval_every": None}))
    words = f"which stage {stage} reads only through a vision-language model's processor"
    with pytest.raises(ArgumentError, match=f"media.jsonl:1: the record has images, {words}"):
        kind(c)(c, load_tokenizer(work["model"], None))


def test_pref_ftx_is_read_under_dpo_and_kto_and_its_zero_asks_for_nothing(tmp_path, work, capsys):
    from megacompile.train.data.tokens import load_tokenizer
    from megacompile.train.stages import kind
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "pref_ftx": 0.25}
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **settings), [])
    stage = kind(c)(c, load_tokenizer(work["model"], None))
    assert c.pref_ftx == 0.25 and stage.loss.ftx == 0.25
    assert "sigmoid + 0.25 pref_ftx (each pair's chosen NLL per token) loss" in stage.describe(None)[0]
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**settings, "pref_ftx": 0, "stage": "kto"}), [])
    assert c.pref_ftx is None       # LlamaFactory's web UI writes its default, 0, under kto too
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **{**settings, "pref_ftx": 0.5, "stage": "kto"}), [])
    stage = kind(c)(c, load_tokenizer(work["model"], None))
    assert c.pref_ftx == 0.5 and stage.loss.ftx == 0.5
    assert "pref_ftx 0.5 (the desirable completions' NLL per token, as LlamaFactory's kto)" in stage.describe(None)[0]


def test_grpo_completions_stop_where_the_models_generation_config_stops(tmp_path, work):
    """A completion ends at the EOS or at an id the model folder's generation_config.json stops at
    (Gemma's <end_of_turn>), as vLLM stops by that config: the generator stops there and a
    completion ending there is not truncated."""
    import json
    from megacompile.train.data import turn_ends
    from megacompile.train.data.tokens import load_tokenizer
    from megacompile.train.stages import kind
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(work, str(tmp_path / "run"))), [])
    tokenizer = load_tokenizer(work["model"], None)
    (tmp_path / turn_ends.FILE).write_text(json.dumps({"eos_token_id": [tokenizer.eos_token_id, 7]}))
    turn_ends.attach(tokenizer, str(tmp_path))
    stage = kind(c)(c, tokenizer)
    assert stage.stops == tuple(sorted({tokenizer.eos_token_id, 7}))


def test_a_grpo_checkpoint_saved_before_the_sampling_keys_resumes_and_one_sampled_otherwise_is_refused(tmp_path, work):
    from types import SimpleNamespace
    from megacompile.train.stages import keys
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(work, str(tmp_path / "run"),
                                                                          use_vllm=True, vllm_mode="server")), [])
    assert (c.vllm_importance_sampling_clip_max, c.vllm_importance_sampling_clip_min) == (3.0, None)
    assert (c.vllm_server_base_url, c.vllm_server_timeout) == ("http://localhost:8000", 240.0)
    newer = ("top_k", "top_p", "min_p", "repetition_penalty", "vllm_importance_sampling_clip_max",
             "vllm_importance_sampling_clip_min", "vllm_max_model_length", "vllm_model_impl")
    old = {k: v for k, v in keys.saved_keys(c).items() if k not in newer}
    old["vllm_importance_sampling_cap"] = 3.0           # the name clip_max was saved under
    keys.check_resume(c, SimpleNamespace(extra={"stage": old}, path="ckpt"))
    filtered = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), use_vllm=True, vllm_mode="server", top_p=0.9,
        vllm_importance_sampling_clip_max=2.0)), [])
    with pytest.raises(ArgumentError, match=r"top_p 1.0 -> 0.9, .*vllm_importance_sampling_clip_max 3.0 -> 2.0"):
        keys.check_resume(filtered, SimpleNamespace(extra={"stage": old}, path="ckpt"))


def test_a_resume_may_change_what_is_logged_but_not_what_is_sampled(tmp_path, work):
    from types import SimpleNamespace
    from megacompile.train.stages import keys
    saved = keys.saved_keys(load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"))), []))
    logged = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), num_generations_eval=2, log_completions=True)), [])
    keys.check_resume(logged, SimpleNamespace(extra={"stage": saved}, path="ckpt"))
    hotter = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), temperature=1.5)), [])
    with pytest.raises(ArgumentError, match=r"temperature 1.0 -> 1.5"):
        keys.check_resume(hotter, SimpleNamespace(extra={"stage": saved}, path="ckpt"))


def test_cispo_and_sapo_runs_log_the_clip_fraction_their_loss_has(tmp_path, work, capsys):
    from megacompile.train.data.tokens import load_tokenizer
    from megacompile.train.stages.grpo import GRPOStage
    c = load(files.run_yaml(str(tmp_path / "sapo.yaml"), **stage_files.grpo(
        work, str(tmp_path / "sapo"), loss_type="sapo", sapo_temperature_neg=1.2)), [])
    assert (c.sapo_temperature_pos, c.sapo_temperature_neg) == (1.0, 1.2)
    stage = GRPOStage(c, load_tokenizer(c.model))
    assert stage.loss.sapo_temperatures == (1.0, 1.2) and "clip_ratio" not in stage.columns
    config = files.run_yaml(str(tmp_path / "cispo.yaml"), **stage_files.grpo(work, str(tmp_path / "cispo"),
                                                                             loss_type="cispo", steps=1))
    c = load(config, [])
    assert "loss_type cispo caps each token's weight at epsilon_high itself, here epsilon's 0.2" in \
        capsys.readouterr().out
    run(c)
    (row,) = log.read(str(tmp_path / "cispo" / "log.csv"))
    # ratio 1 at the first step, above the cap of 0.2: every token of a positive advantage is capped
    assert 0 < float(row["cispo_clip_ratio"]) < 1 and "clip_ratio" not in row


def test_generation_kwargs_sets_the_sampling_filters_over_their_keys_as_in_trl(tmp_path, work, capsys):
    c = load(files.run_yaml(str(tmp_path / "run.yaml"), **stage_files.grpo(
        work, str(tmp_path / "run"), top_k=3, generation_kwargs={"top_k": 7, "repetition_penalty": 1.2})), [])
    assert (c.top_k, c.repetition_penalty, c.top_p, c.generation_kwargs) == (7, 1.2, 1.0, None)
    assert "generation_kwargs' top_k 7 overrides top_k: 3, as in TRL" in capsys.readouterr().out
