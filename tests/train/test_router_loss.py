"""run.yaml's moe_aux_loss_coef (LlamaFactory's key): a mixture-of-experts folder whose config.json
leaves the router loss off trains with it on, at the run's weight, as eager transformers trains the
config LlamaFactory edits (output_router_logits on, router_aux_loss_coef the key's value); and the
export's config.json says so. Where no loss would take the key it is refused by name."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, float64_noise
from megacompile.errors import ArgumentError
from megacompile.train import load, log, run
from megacompile.train.data import packing
from tests.train import files, finetune_runs

SEQ, COEF = 16, 0.5


def _mixtral_dir(path: str) -> str:
    """A two-layer Mixtral folder (4 experts, top 2) with the router loss off, as released configs have it."""
    from transformers import MixtralConfig, MixtralForCausalLM
    tok = files.tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, output_router_logits=False, router_aux_loss_coef=0.001,
                           bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, use_cache=False)
    MixtralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _settings(tmp_path, model: str, **extra) -> dict:
    notes = files.text(str(tmp_path / "notes.txt"))
    return dict(model=model, data=[notes], eval=[notes], seq=SEQ, batch=2, steps=3, lr=1e-2,
                schedule="constant", max_grad_norm=None, device="cpu", run_dir=str(tmp_path / "run"), log_every=1,
                save_every=3, **extra)


def _eager(c, rows, coef: float | None):
    """The folder's model trained eagerly on the run's batches, the router loss on at `coef` (None: as
    config.json has it, off)."""
    from transformers import AutoModelForCausalLM
    extra = {} if coef is None else dict(output_router_logits=True, router_aux_loss_coef=coef)
    model = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32, **extra)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, _ = finetune_runs.train(model, c, rows, finetune_runs.trainer_groups(model, 0.0))
    return model, losses, start


def test_moe_aux_loss_coef_trains_the_routers_loss_as_eager_transformers(tmp_path):
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    c = load(files.run_yaml(str(tmp_path / "moe.yaml"), **_settings(tmp_path, model, moe_aux_loss_coef=COEF,
                                                                      export=str(tmp_path / "out"))), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, SEQ)
    eager, losses, start = _eager(c, rows, COEF)
    _, without, _ = _eager(c, rows, None)

    ours = torch.tensor([float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))])
    torch.testing.assert_close(ours, torch.tensor(losses), rtol=1e-5, atol=0)
    # The term is there: its share of the first loss is far above the tolerance.
    assert ours[0] - without[0] > 1e-3 * ours[0]

    def train_again(exact):       # the same training in float64, from the same weights
        exact.config._experts_implementation = "eager"       # torch's grouped GEMM takes no float64
        exact.load_state_dict({n: w.double() for n, w in start.items()})
        finetune_runs.train(exact, c, rows, finetune_runs.trainer_groups(exact, 0.0))
    noise = float64_noise(train_again, eager, eager)
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000003"), "master")

    tol = max(1e-5, WEIGHT_NOISE_FACTOR * noise)
    for name, p in eager.named_parameters():     # the engine trains the model as WholeTerm's policy
        err = (masters[f"policy.{name}"] - p.detach()).abs().max() / p.detach().abs().max()
        assert err <= tol, f"{name}: {err:.3g} (tolerance {tol:.3g})"

    with open(os.path.join(str(tmp_path / "out"), "config.json")) as f:
        written = json.load(f)
    assert written["output_router_logits"] is True and written["router_aux_loss_coef"] == COEF


@pytest.mark.parametrize("value", [None, 0])
def test_null_or_zero_leaves_the_config_as_it_is(tmp_path, value):
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, str(tmp_path), moe_aux_loss_coef=value)),
             [])
    assert c.moe_aux_loss_coef is None


@pytest.mark.parametrize("extra, says", [
    (dict(moe_aux_loss_coef=-0.1), "moe_aux_loss_coef must be a number >= 0; got -0.1"),
    (dict(moe_aux_loss_coef="much"), "moe_aux_loss_coef must be a number >= 0; got 'much'"),
    (dict(moe_aux_loss_coef=0.01, model="bundled"), "moe_aux_loss_coef: the bundled model has no experts"),
    (dict(moe_aux_loss_coef=0.01, batch=2, per_device_eval_batch_size=1),
     "moe_aux_loss_coef with eval_batch (per_device_eval_batch_size) 1: the held-out loss holds the routers' term"),
])
def test_a_coefficient_nothing_can_take_is_refused(tmp_path, extra, says):
    settings = {**_settings(tmp_path, str(tmp_path)), **extra}
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    assert says in str(e.value)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_a_preference_stage_refuses_it(tmp_path, stage):
    from tests.posttrain import stage_files
    work = {"model": str(tmp_path), "pairs": stage_files.pairs(str(tmp_path / "pairs.jsonl"))}
    settings = {**stage_files.dpo(work, str(tmp_path / "run")), "stage": stage, "moe_aux_loss_coef": 0.01}
    with pytest.raises(ArgumentError) as e:
        load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    assert f"stage {stage} trains its objective from the logits alone" in str(e.value)


def test_a_dense_model_is_refused_before_anything_is_written(tmp_path):
    model = files.model_dir(str(tmp_path / "llama"), dim=32)
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, model, moe_aux_loss_coef=0.01)), [])
    with pytest.raises(ArgumentError) as e:
        run(c)
    assert ("moe_aux_loss_coef 0.01: the llama model of " + model + " computes no router load-balancing loss"
            in str(e.value))
    assert not os.path.exists(c.run_dir)


@pytest.mark.parametrize("kind", ["full", "lora", "config"])
def test_every_way_a_run_builds_its_model_turns_the_loss_on(tmp_path, kind):
    """The planned (meta) model and the trained one: a folder's, a LoRA run's over it, a config's from scratch."""
    from megacompile.train.model import make_module, meta_model
    folder = _mixtral_dir(str(tmp_path / "mixtral"))
    model = os.path.join(folder, "config.json") if kind == "config" else folder
    extra = dict(finetuning_type="lora") if kind == "lora" else {}
    if kind == "config":
        extra["tokenizer"] = folder
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **_settings(tmp_path, model, moe_aux_loss_coef=COEF, **extra)),
             [])
    meta = meta_model(c)
    for built in (meta, make_module(c, meta, quiet=True)):
        config = built.config
        assert config.output_router_logits is True and config.router_aux_loss_coef == COEF
        base = getattr(built, "get_base_model", lambda: built)()       # under PEFT's wrapper for LoRA
        assert base.router_aux_loss_coef == COEF        # Mixtral reads it once, when built


def test_a_vision_language_models_text_config_takes_it_and_deepseek_v3_refuses_it():
    from types import SimpleNamespace

    from transformers import DeepseekV3Config, Qwen3VLMoeConfig
    from megacompile.train import router_loss
    c = SimpleNamespace(moe_aux_loss_coef=COEF)
    vlm = Qwen3VLMoeConfig()
    router_loss.edit(vlm, c, "vlm")
    assert vlm.text_config.output_router_logits is True and vlm.text_config.router_aux_loss_coef == COEF
    with pytest.raises(ArgumentError, match="the deepseek_v3 model of ds computes no router load-balancing loss"):
        router_loss.edit(DeepseekV3Config(), c, "ds")


def test_a_stage_that_leaves_the_models_own_router_loss_out_says_so():
    """A config.json that asks for the term (output_router_logits) under a stage whose objective is of
    the logits alone: the run says the term is not trained, where TRL's DPO and KTO trainers add it."""
    from types import SimpleNamespace

    from transformers import MixtralConfig, Qwen3VLMoeConfig
    from megacompile.train import router_loss
    on = SimpleNamespace(config=MixtralConfig(output_router_logits=True))
    off = SimpleNamespace(config=MixtralConfig())
    vlm = Qwen3VLMoeConfig()
    vlm.text_config.output_router_logits = True
    said = router_loss.note(SimpleNamespace(stage="dpo"), on)
    assert "stage dpo trains its objective from the logits alone" in said and "TRL's DPO and KTO trainers add it" in said
    assert router_loss.note(SimpleNamespace(stage="kto"), SimpleNamespace(config=vlm)) is not None
    assert router_loss.note(SimpleNamespace(stage="sft", loss_type="nll"), on) is None
    assert router_loss.note(SimpleNamespace(stage="dpo"), off) is None
    dft = router_loss.note(SimpleNamespace(stage="sft", loss_type="dft"), on)
    assert "loss_type dft trains its loss from the logits alone" in dft
    assert router_loss.note(SimpleNamespace(stage="pt", loss_type="dft"), off) is None


def _attended(rows, index: int, seq: int) -> torch.Tensor:
    """Row `index`'s attention_mask as LlamaFactory's collator pads a record: 1 on the record's
    tokens, 0 after them (one record a row, at its start)."""
    (doc,) = rows.documents(index)
    length = int(rows.tokens.docs[doc + 1] - rows.tokens.docs[doc])
    return (torch.arange(seq) < length).long()


def test_padding_is_left_out_of_the_routers_statistics_as_llamafactory_leaves_it(tmp_path):
    """Records one a row, the rest padding: the routers' term counts the records' tokens alone, as
    eager transformers given LlamaFactory's attention_mask counts them. Without the mask the padding's
    routing enters the term, and the losses differ by far more than the tolerance."""
    from transformers import AutoModelForCausalLM
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    seq = 48
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **{**_settings(tmp_path, model, moe_aux_loss_coef=COEF),
                                                         "data": [chats], "eval": None, "seq": seq,
                                                         "save_every": False}), [])
    run(c)
    ours = torch.tensor([float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))])
    from megacompile.train.data.tokens import load_tokenizer, token_file
    tok = load_tokenizer(c.model)
    made = token_file(str(tmp_path / "tokens"), "train", c.data, tok, c.model, c.train_on_prompt)
    rows = packing.Rows(made, seq, c.packing, c.seed, pad_id=tok.pad_token_id)

    def eager(masked: bool) -> torch.Tensor:
        eager = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32, output_router_logits=True,
                                                     router_aux_loss_coef=COEF)
        opt = torch.optim.AdamW(finetune_runs.trainer_groups(eager, 0.0), lr=c.lr, betas=tuple(c.betas), eps=c.eps)
        losses = []
        for step in range(c.steps):
            first = step * c.batch
            inputs = packing.batch(rows, first, c.batch, shifted=False)
            assert (inputs["input_ids"][:, -1] == rows.pad_id).all()     # every row ends in padding
            if masked:
                inputs["attention_mask"] = torch.stack([_attended(rows, i, seq) for i in range(first, first + c.batch)])
            opt.zero_grad(set_to_none=True)
            loss = eager(**inputs).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return torch.tensor(losses)

    torch.testing.assert_close(ours, eager(True), rtol=1e-5, atol=0)
    assert (ours - eager(False)).abs().max() > 1e-3 * ours.abs().max()


@pytest.mark.parametrize("packed", [False, True, "isolated"])
def test_rows_carry_the_mask_where_the_routers_count_them_and_isolation_is_kept(tmp_path, packed):
    """The rows of a model whose loss holds the routers' term say where their padding is, except under
    isolated packing, whose position ids transformers reads only without an attention_mask; a dense
    model's rows carry none."""
    from types import SimpleNamespace

    from transformers import LlamaConfig, MixtralConfig
    from megacompile.train.stages import open_stage
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    settings = {**_settings(tmp_path, model), "data": [files.chats(str(tmp_path / "chats.jsonl"))], "eval": None,
                "seq": 48, "packing": packed}
    c = load(files.run_yaml(str(tmp_path / "r.yaml"), **settings), [])
    routed = SimpleNamespace(config=MixtralConfig(output_router_logits=True))
    for meta, masked in ((routed, packed != "isolated"), (SimpleNamespace(config=LlamaConfig()), False)):
        stage = open_stage(c, str(tmp_path / "run"), meta)
        try:
            inputs = stage.first_inputs(2)
        finally:
            stage.discard()
        assert ("attention_mask" in inputs) == masked
        assert ("position_ids" in inputs) == (packed == "isolated")
        if masked:
            ids, kept = inputs["input_ids"], inputs["attention_mask"].bool()
            assert not kept.all() and (ids[~kept] == stage.tokenizer.pad_token_id).all()


@pytest.mark.parametrize("accumulation", ["micro", pytest.param("layer", marks=pytest.mark.slow)])
def test_each_micro_batch_adds_its_whole_term_to_the_step_as_the_trainer_adds_it(tmp_path, accumulation):
    """grad_accum 2 over records of uneven length: each micro-batch's cross-entropy weighs its share
    of the step's target tokens (num_items_in_batch) and its router term is added whole, as the
    Trainer steps transformers' MoE model; losses and weights as eager's, with the micro-batches
    one after another through the model or layer by layer (their scales inputs of one program)."""
    from transformers import AutoModelForCausalLM
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    chats = files.chats(str(tmp_path / "chats.jsonl"))
    settings = _settings(tmp_path, model, moe_aux_loss_coef=COEF, grad_accum=2) | dict(data=[chats], eval=[chats],
                                                                                       seq=32, accumulation=accumulation)
    c = load(files.run_yaml(str(tmp_path / "moe.yaml"), **settings), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, c.seq)

    def trainer_steps(eager) -> tuple[list[float], list[tuple[float, float]]]:
        """The Trainer's steps: the losses, and each micro-batch's (weight, weighted router term)."""
        opt = torch.optim.AdamW(eager.parameters(), lr=c.lr, betas=tuple(c.betas), eps=c.eps, weight_decay=0.0)
        losses, shares = [], []
        for step in range(c.steps):
            micro = [packing.batch(rows, (2 * step + i) * c.batch, c.batch, shifted=False, padding_mask=True)
                     for i in range(2)]
            counts = [packing.target_count(m, shifted=False) for m in micro]
            total = 0.0
            for inputs, n in zip(micro, counts):
                out = eager(**inputs, num_items_in_batch=sum(counts))
                out.loss.backward()
                total += out.loss.item()
                shares.append((n / sum(counts), COEF * out.aux_loss.item()))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(total)
        return losses, shares

    eager = AutoModelForCausalLM.from_pretrained(c.model, dtype=torch.float32, output_router_logits=True,
                                                 router_aux_loss_coef=COEF)
    start = {n: p.detach().clone() for n, p in eager.named_parameters()}
    losses, shares = trainer_steps(eager)
    assert shares[0][0] != shares[1][0]           # the micro-batches weigh differently
    ours = torch.tensor([float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))])
    torch.testing.assert_close(ours, torch.tensor(losses), rtol=1e-5, atol=0)
    # Weighted as the cross-entropy is, each term would count its weight alone: far outside the tolerance.
    assert sum((1 - w) * term for w, term in shares[:2]) > 1e-3 * losses[0]

    def train_again(exact):       # the same training in float64, from the same weights
        exact.config._experts_implementation = "eager"       # torch's grouped GEMM takes no float64
        exact.load_state_dict({n: w.double() for n, w in start.items()})
        trainer_steps(exact)
    tol = max(1e-5, WEIGHT_NOISE_FACTOR * float64_noise(train_again, eager, eager))
    masters = finetune_runs.tables(os.path.join(c.run_dir, "checkpoints", "step-000003"), "master")
    for name, p in eager.named_parameters():
        err = (masters[f"policy.{name}"] - p.detach()).abs().max() / p.detach().abs().max()
        assert err <= tol, f"{name}: {err:.3g} (tolerance {tol:.3g})"
