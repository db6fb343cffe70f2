"""A checkpoint transformers' Trainer saved, taken in by engine.load_trainer_checkpoint: training goes
on as the Trainer's torch AdamW would from the same files (losses to 1e-5, weights to the noise floor
of eager float32 against float64 from the same checkpoint), its moments, step counts and the step of
the learning-rate schedule included; a checkpoint that does not fit is refused with nothing loaded."""
from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import megacompile
from megacompile.acceptance.parity import WEIGHT_NOISE_FACTOR, weight_errors
from megacompile.engine import compile_folder
from megacompile.errors import MegacompileError, WeightsFileError
from tests import models

LR, WD, BETAS, EPS, WARMUP = 1e-2, 0.1, (0.9, 0.95), 1e-8, 4
BATCHES = [models.batch(96, 2, 16, seed=s) for s in range(5)]
SAVED_AT = 2      # optimizer steps the Trainer took before its checkpoint


def lr_at(step: int) -> float:
    """The learning rate of the 1-based optimizer step: a warmup, so a resume at the wrong step shows."""
    return LR * min(1.0, step / WARMUP)


def _llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=tied))


def trainer_optimizer(model) -> torch.optim.AdamW:
    """Trainer.create_optimizer's: the decayed parameters, then the exempt ones, in named_parameters() order."""
    exempt = set(megacompile.hf_no_decay(model))
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in trained if n not in exempt], "weight_decay": WD},
                              {"params": [p for n, p in trained if n in exempt], "weight_decay": 0.0}],
                             lr=LR, betas=BETAS, eps=EPS)


def train(model, optimizer, batches, first_step: int) -> list[float]:
    losses = []
    for step, ids in enumerate(batches, start=first_step):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def trainer_checkpoint(folder: str, tied: bool, edit=None) -> str:
    """What Trainer._save_checkpoint leaves after SAVED_AT steps; edit(state_dict) changes the
    optimizer's state before it is written."""
    model = _llama(tied)
    optimizer = trainer_optimizer(model)
    train(model, optimizer, BATCHES[:SAVED_AT], 1)
    model.save_pretrained(folder)
    saved = optimizer.state_dict()
    if edit is not None:
        edit(saved)
    torch.save(saved, os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": SAVED_AT, "epoch": 0.4, "log_history": []}, f)
    torch.save({"last_epoch": SAVED_AT}, os.path.join(folder, "scheduler.pt"))
    return folder


def eager_from(folder: str, dtype: torch.dtype):
    """The Trainer's run going on from its files: the model and optimizer loaded as it loads them."""
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(dtype)
    optimizer = trainer_optimizer(model)
    optimizer.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True))
    losses = train(model, optimizer, BATCHES[SAVED_AT:], SAVED_AT + 1)
    return model, losses


def engine_for(folder: str, **adamw):
    settings = dict(lr=lr_at, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=megacompile.hf_no_decay) | adamw
    return megacompile.from_pretrained(folder, hbm_budget=1.0, device="cpu", optimizer=megacompile.AdamW(**settings))


def trainer_order(engine) -> list[str]:
    """The trainable parameters in the Trainer's numbering: the decayed ones, then the exempt ones."""
    exempt = set(megacompile.hf_no_decay(engine.model))
    trained = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    return [n for n in trained if n not in exempt] + [n for n in trained if n in exempt]


def _never_stepped(saved: dict) -> None:
    """The first exempt parameter had no gradient in the Trainer's steps: torch keeps no state for it."""
    del saved["state"][saved["param_groups"][1]["params"][0]]


def _stepped_once(saved: dict) -> None:
    """The first decayed parameter had a gradient in one of the Trainer's steps only."""
    saved["state"][saved["param_groups"][0]["params"][0]]["step"] = torch.tensor(1.0)


@pytest.mark.parametrize("tied, edit", [(False, None), (True, None), (False, _never_stepped), (False, _stepped_once)],
                         ids=["untied", "tied", "a parameter never stepped", "a parameter stepped once"])
def test_training_goes_on_as_the_trainers_adamw_would(tmp_path, tied, edit):
    folder = trainer_checkpoint(str(tmp_path / "checkpoint-2"), tied, edit)
    reference, eager_losses = eager_from(folder, torch.float32)
    exact, _ = eager_from(folder, torch.float64)
    noise = max(weight_errors(exact, reference).values())
    engine = engine_for(folder)
    trainer_state = engine.load_trainer_checkpoint(folder)
    assert trainer_state["global_step"] == SAVED_AT and engine.state.steps_done == SAVED_AT
    losses = [engine.step(input_ids=ids, labels=ids) for ids in BATCHES[SAVED_AT:]]
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    tolerance = max(1e-5, WEIGHT_NOISE_FACTOR * noise)
    errors = weight_errors(engine, reference)
    assert max(errors.values()) <= tolerance, (errors, noise)
    # The same weights without the Trainer's moments and steps (a new run from its weights) land
    # far from the Trainer's: the import is what the agreement above rests on.
    fresh = engine_for(folder)
    for ids in BATCHES[SAVED_AT:]:
        fresh.step(input_ids=ids, labels=ids)
    assert max(weight_errors(fresh, reference).values()) > 10 * tolerance


def _masters(engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.state_dict().items()}


def test_a_checkpoint_that_does_not_fit_is_refused_and_nothing_is_loaded(tmp_path):
    folder = trainer_checkpoint(str(tmp_path / "checkpoint-2"), tied=False)
    engine = engine_for(folder)
    engine.step(input_ids=BATCHES[0], labels=BATCHES[0])
    before, steps = _masters(engine), engine.state.steps_done

    def unchanged():
        after = _masters(engine)
        assert engine.state.steps_done == steps and all(torch.equal(before[n], after[n]) for n in before)

    # This engine's AdamW decays every parameter: the Trainer's two groups do not split its parameters so.
    with pytest.raises(WeightsFileError, match=r"param groups of \[\d+, \d+\].*no_decay=megacompile.hf_no_decay"):
        engine_for(folder, no_decay=()).load_trainer_checkpoint(folder)
    # The groups' order swapped: every index names another parameter, and the shapes say so.
    swapped = trainer_checkpoint(str(tmp_path / "swapped"), tied=False,
                                 edit=lambda s: s["param_groups"].reverse())
    with pytest.raises(WeightsFileError, match=r"param groups of|does not fit this model's trainable parameters"):
        engine.load_trainer_checkpoint(swapped)
    unchanged()
    # Another optimizer's state (an 8-bit AdamW keeps state1 and state2).
    eight_bit = trainer_checkpoint(str(tmp_path / "8bit"), tied=False, edit=lambda s: s.update(
        state={i: {"step": e["step"], "state1": e["exp_avg"], "state2": e["exp_avg_sq"]} for i, e in s["state"].items()}))
    with pytest.raises(WeightsFileError, match=r"is not AdamW's state \(it holds state1, state2, step, not exp_avg"):
        engine.load_trainer_checkpoint(eight_bit)
    unchanged()
    # torch's Adam, whose weight decay is L2 (its param groups say decoupled_weight_decay False).
    adam = trainer_checkpoint(str(tmp_path / "adam"), tied=False,
                              edit=lambda s: [g.update(decoupled_weight_decay=False) for g in s["param_groups"]])
    with pytest.raises(MegacompileError, match=r"its optimizer is Adam with L2 weight decay"):
        engine.load_trainer_checkpoint(adam)
    unchanged()
    # Other betas: refused, or kept as this engine's with a warning under strict=False.
    other = trainer_checkpoint(str(tmp_path / "betas"), tied=False,
                               edit=lambda s: [g.update(betas=(0.8, 0.99)) for g in s["param_groups"]])
    with pytest.raises(MegacompileError, match=r"betas: the checkpoint has \[0.8, 0.99\], this engine \[0.9, 0.95\]"):
        engine.load_trainer_checkpoint(other)
    unchanged()
    with pytest.warns(RuntimeWarning, match="this engine's are kept: betas"):
        engine.load_trainer_checkpoint(other, strict=False)
    assert engine.state.steps_done == SAVED_AT
    # Saved with save_only_model: no optimizer.pt.
    os.remove(os.path.join(other, "optimizer.pt"))
    with pytest.raises(WeightsFileError, match=r"lacks optimizer.pt \(a Trainer saving with save_only_model"):
        engine.load_trainer_checkpoint(other)
    # A DeepSpeed checkpoint is named as one.
    os.makedirs(os.path.join(other, "global_step2"))
    with pytest.raises(WeightsFileError, match=r"a DeepSpeed checkpoint"):
        engine.load_trainer_checkpoint(other)


def test_a_checkpoint_the_trainer_wrote_goes_on_to_the_trainers_own_last_step(tmp_path):
    """transformers' Trainer itself (its fused AdamW, its groups, a linear schedule with warmup) runs
    4 steps and saves at step 2; the engine takes checkpoint-2 in and runs steps 3 and 4 on the
    batches the Trainer fed: its losses and last weights are the Trainer's."""
    from transformers import Trainer, TrainingArguments
    fed: list[torch.Tensor] = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            fed.append(inputs["input_ids"].clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    model = _llama(tied=False)
    rows = [{"input_ids": ids, "labels": ids} for batch in BATCHES for ids in batch]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=4, save_steps=2,
                             learning_rate=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                             adam_epsilon=EPS, lr_scheduler_type="linear", warmup_steps=1, max_grad_norm=0.0,
                             report_to=[], use_cpu=True, logging_steps=1, disable_tqdm=True, seed=0)
    trainer = Recording(model=model, args=args, train_dataset=rows)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]

    def linear(step: int) -> float:       # the Trainer's LambdaLR: step k runs at lambda(k - 1)
        k = step - 1
        return LR * (k / 1 if k < 1 else max(0.0, (4 - k) / 3))
    folder = str(tmp_path / "checkpoint-2")
    engine = engine_for(folder, lr=linear)
    engine.load_trainer_checkpoint(folder)
    ours = [engine.step(input_ids=ids, labels=ids) for ids in fed[2:]]
    assert ours == pytest.approx(losses[2:], rel=1e-4)      # the Trainer logs its losses rounded to 4 digits
    errors = weight_errors(engine, model)
    assert max(errors.values()) <= 1e-5, errors


def test_taken_in_then_saved_before_any_step_the_checkpoint_holds_the_trainers_state(tmp_path):
    """Before its first step the engine has no host state: a save writes what waits to load, the
    Trainer's moments from memory included, and a fresh engine loading that save trains alike."""
    folder = trainer_checkpoint(str(tmp_path / "checkpoint-2"), tied=False)
    taken = engine_for(folder)
    taken.load_trainer_checkpoint(folder)
    taken.save_checkpoint(str(tmp_path / "ours"))
    again = engine_for(folder)
    again.load_checkpoint(str(tmp_path / "ours"))
    for ids in BATCHES[SAVED_AT:]:
        assert taken.step(input_ids=ids, labels=ids) == again.step(input_ids=ids, labels=ids)
    assert all(torch.equal(a, b) for a, b in zip(taken.state_dict().values(), again.state_dict().values()))


def resumed_trainer(model, folder: str, groups: list[dict] | None = None, **schedule
                    ) -> tuple[list[float], list[torch.Tensor]]:
    """transformers' Trainer over `model` resumed from `folder` to step 4 on BATCHES' rows, with
    this file's AdamW (over `groups`, as a trainer that makes its own optimizer hands it over) and
    `schedule` (its lr_scheduler_type, ...): (its logged losses, the input_ids it fed each resumed step)."""
    from transformers import Trainer, TrainingArguments
    fed: list[torch.Tensor] = []

    class Recording(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            fed.append(inputs["input_ids"].clone())
            return super().compute_loss(model, inputs, *args, **kwargs)

    rows = [{"input_ids": ids, "labels": ids} for batch in BATCHES for ids in batch]
    args = TrainingArguments(output_dir=os.path.dirname(folder), per_device_train_batch_size=2, max_steps=4,
                             learning_rate=LR, weight_decay=WD, adam_beta1=BETAS[0], adam_beta2=BETAS[1],
                             adam_epsilon=EPS, max_grad_norm=0.0, report_to=[], use_cpu=True, logging_steps=1,
                             disable_tqdm=True, save_strategy="no", **schedule)
    optimizers = (None, None) if groups is None else (torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS), None)
    trainer = Recording(model=model, args=args, train_dataset=rows, optimizers=optimizers)
    trainer.train(resume_from_checkpoint=folder)
    assert trainer.state.global_step == 4 and len(fed) == 2
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], fed


def test_the_trainer_resumes_from_a_checkpoint_the_engine_wrote_and_trains_as_the_engine(tmp_path):
    """The way back: the engine trains 2 steps and writes checkpoint-2; transformers' Trainer resumes
    from it (a linear schedule with warmup, over 4 steps) and its steps 3 and 4 land where the
    engine's own steps 3 and 4 on the same batches do."""
    source = str(tmp_path / "model")
    _llama(tied=False).save_pretrained(source)

    def linear(step: int) -> float:       # the Trainer's schedule below: step k runs at lambda(k - 1)
        k = step - 1
        return LR * (k / 1 if k < 1 else max(0.0, (4 - k) / 3))
    engine = engine_for(source, lr=linear)
    for ids in BATCHES[:SAVED_AT]:
        engine.step(input_ids=ids, labels=ids)
    folder = str(tmp_path / "out" / "checkpoint-2")
    engine.save_trainer_checkpoint(folder, batch_size=2, logging_steps=1)
    assert sorted(os.listdir(os.path.dirname(folder))) == ["checkpoint-2"]       # nothing left beside it

    model = LlamaForCausalLM.from_pretrained(source)
    theirs, fed = resumed_trainer(model, folder, lr_scheduler_type="linear", warmup_steps=1)
    ours = [engine.step(input_ids=ids, labels=ids) for ids in fed]
    assert ours == pytest.approx(theirs, rel=1e-4)      # the Trainer logs its losses rounded to 4 digits
    errors = weight_errors(engine, model)
    assert max(errors.values()) <= 1e-5, errors
    # And read back by the engine's own import, it is the state it was written from.
    again = engine_for(source, lr=linear)
    again.load_trainer_checkpoint(folder)
    assert again.state.steps_done == SAVED_AT
    with pytest.raises(megacompile.errors.CheckpointError, match="something is there already"):
        engine.save_trainer_checkpoint(folder, batch_size=2)
    with pytest.raises(MegacompileError, match="no_decay=megacompile.hf_no_decay"):
        engine_for(source, no_decay=()).save_trainer_checkpoint(str(tmp_path / "other"), batch_size=2)
    with pytest.raises(megacompile.errors.ArgumentError, match="per_device_train_batch_size"):
        engine.save_trainer_checkpoint(str(tmp_path / "other"), batch_size=0)
    with pytest.raises(megacompile.errors.ArgumentError, match=r"logging_steps from this checkpoint on.*got 0"):
        engine.save_trainer_checkpoint(str(tmp_path / "other"), batch_size=2, logging_steps=0)
    assert not os.path.exists(tmp_path / "other")


def test_an_optimizer_file_of_torchs_legacy_format_is_read_too(tmp_path):
    """torch.save(..., _use_new_zipfile_serialization=False) writes no zip archive, which no memory
    map reads: the file is read whole instead, to the same state."""
    folder = trainer_checkpoint(str(tmp_path / "checkpoint-2"), tied=False)
    path = os.path.join(folder, "optimizer.pt")
    torch.save(torch.load(path, weights_only=True), path, _use_new_zipfile_serialization=False)
    zipped = trainer_checkpoint(str(tmp_path / "zipped"), tied=False)
    a, b = engine_for(folder), engine_for(zipped)
    a.load_trainer_checkpoint(folder)
    b.load_trainer_checkpoint(zipped)
    for ids in BATCHES[SAVED_AT:]:
        assert a.step(input_ids=ids, labels=ids) == b.step(input_ids=ids, labels=ids)


def _mapped_resident(name: str) -> int:
    """Resident bytes of this process's memory maps of files named `name` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and not head[0].endswith(":"):     # a mapping's first line
                inside = head[-1].endswith(os.sep + name)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_optimizer_pt_is_not_held_in_memory_beside_the_host_state_it_is_read_into(tmp_path, monkeypatch):
    """optimizer.pt comes in through a memory map; each moment's pages go back once it is in the host
    state, so the file (8 bytes per parameter) is never resident whole beside the host state: while
    the moments are read in, no more of it is resident than about its largest moment."""
    from megacompile.io import source
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    optimizer = trainer_optimizer(model)
    train(model, optimizer, BATCHES[:1], 1)
    folder = str(tmp_path / "checkpoint-1")
    model.save_pretrained(folder)
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 1}, f)
    moments = 8 * sum(p.numel() for p in model.parameters())
    largest = 4 * max(p.numel() for p in model.parameters())
    resident, write = [], source._write

    def measured_write(host, item, t):
        write(host, item, t)
        resident.append(_mapped_resident("optimizer.pt"))
    monkeypatch.setattr(source, "_write", measured_write)
    engine = engine_for(folder)
    engine.load_trainer_checkpoint(folder)
    engine.prepare(input_ids=BATCHES[1], labels=BATCHES[1])     # the host state is built and the moments read in
    assert engine.host.view("exp_avg", "model.embed_tokens.weight").abs().sum() > 0
    assert len(resident) > 2 * 20 and max(resident) <= 2 * largest < moments / 4, (max(resident), largest, moments)


def _with_lora(model, seed: int):
    import peft
    torch.manual_seed(seed)
    return peft.get_peft_model(model, peft.LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules=["q_proj", "v_proj"]))


@pytest.mark.parametrize("first_step", [False, True], ids=["taken in first", "taken in after a step"])
def test_a_lora_runs_trainer_checkpoint_goes_on_as_its_adamw_would(tmp_path, first_step):
    """A LoRA run's checkpoint-N holds PEFT's adapter (not the model) and the AdamW state of the adapters:
    the engine takes it in beside its own base weights, before its host state exists or after."""
    import peft
    base = str(tmp_path / "base")
    _llama(tied=False).save_pretrained(base)
    trainer = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=1)
    optimizer = trainer_optimizer(trainer)
    train(trainer, optimizer, BATCHES[:SAVED_AT], 1)
    folder = str(tmp_path / "checkpoint-2")
    trainer.save_pretrained(folder)
    torch.save(optimizer.state_dict(), os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": SAVED_AT}, f)

    reference = peft.PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), folder, is_trainable=True)
    going_on = trainer_optimizer(reference)
    going_on.load_state_dict(torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True))
    eager_losses = train(reference, going_on, BATCHES[SAVED_AT:], SAVED_AT + 1)

    model = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=2)      # other adapters until the load
    engine = megacompile.compile(model, 1.0, device="cpu", optimizer=megacompile.AdamW(
        lr=lr_at, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=megacompile.hf_no_decay))
    if first_step:
        engine.prepare(input_ids=BATCHES[0], labels=BATCHES[0])
    engine.load_trainer_checkpoint(folder)
    losses = [engine.step(input_ids=ids, labels=ids) for ids in BATCHES[SAVED_AT:]]
    assert losses == pytest.approx(eager_losses, rel=1e-5)
    errors = weight_errors(engine, reference)
    assert max(errors.values()) <= 1e-5, errors


def test_a_lora_adapter_of_another_rank_is_refused_by_name(tmp_path):
    import peft
    base = str(tmp_path / "base")
    _llama(tied=False).save_pretrained(base)
    other = peft.get_peft_model(LlamaForCausalLM.from_pretrained(base), peft.LoraConfig(
        task_type="CAUSAL_LM", r=8, lora_alpha=8, target_modules=["q_proj"]))
    folder = str(tmp_path / "checkpoint-1")
    other.save_pretrained(folder)
    torch.save(trainer_optimizer(other).state_dict(), os.path.join(folder, "optimizer.pt"))
    with open(os.path.join(folder, "trainer_state.json"), "w") as f:
        json.dump({"global_step": 0}, f)
    engine = megacompile.compile(_with_lora(LlamaForCausalLM.from_pretrained(base), seed=2), 1.0, device="cpu",
                                 optimizer=megacompile.AdamW(lr=LR, no_decay=megacompile.hf_no_decay))
    with pytest.raises(WeightsFileError, match=r"not this model's: r 8 \(this model 4; run.yaml lora_rank\); "
                                               r"target_modules q_proj \(this model q_proj, v_proj"):
        engine.load_trainer_checkpoint(folder)
    full = engine_for(base)
    with pytest.raises(WeightsFileError, match=r"holds a LoRA adapter \(rank 8, alpha 8, on q_proj\) and this model "
                                               r"has none"):
        full.load_trainer_checkpoint(folder)


def test_the_trainer_resumes_a_lora_run_from_the_adapter_and_moments_the_engine_wrote(tmp_path):
    """The way back for a LoRA run: checkpoint-2 holds PEFT's adapter (no model: the base is the
    Trainer's own) and the adapters' AdamW state; transformers' Trainer over a PEFT model whose
    adapters start elsewhere resumes from it, and its steps 3 and 4 land where the engine's do."""
    from megacompile.train.methods.lora import file_key
    from tests.train.files import tokenizer
    base = str(tmp_path / "base")
    _llama(tied=False).save_pretrained(base)
    tokenizer().save_pretrained(base)
    # Compiled on the folder, as a LoRA run is: the checkpoint takes its tokenizer from there, as a Trainer saves it.
    engine = compile_folder(_with_lora(LlamaForCausalLM.from_pretrained(base), seed=1), base, 1.0, file_key=file_key,
                            device="cpu", optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                                      no_decay=megacompile.hf_no_decay))
    for ids in BATCHES[:SAVED_AT]:
        engine.step(input_ids=ids, labels=ids)
    folder = str(tmp_path / "out" / "checkpoint-2")
    engine.save_trainer_checkpoint(folder, batch_size=2, logging_steps=1)
    assert sorted(os.listdir(folder)) == ["adapter_config.json", "adapter_model.safetensors", "chat_template.jinja",
                                          "optimizer.pt", "scheduler.pt", "tokenizer.json", "tokenizer_config.json",
                                          "trainer_state.json"]
    assert AutoTokenizer.from_pretrained(folder).get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()

    model = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=2)      # other adapters until the resume
    theirs, fed = resumed_trainer(model, folder, lr_scheduler_type="constant")
    ours = [engine.step(input_ids=ids, labels=ids) for ids in fed]
    assert ours == pytest.approx(theirs, rel=1e-4)      # the Trainer logs its losses rounded to 4 digits
    errors = weight_errors(engine, model)
    assert max(errors.values()) <= 1e-5, errors
    # PEFT reads the adapter as the engine's masters held it at step 2: the engine's own import of the
    # checkpoint then trains alike.
    again = megacompile.compile(_with_lora(LlamaForCausalLM.from_pretrained(base), seed=3), 1.0, device="cpu",
                                optimizer=megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                                                            no_decay=megacompile.hf_no_decay))
    again.load_trainer_checkpoint(folder)
    assert [again.step(input_ids=ids, labels=ids) for ids in fed] == ours


def test_a_loraplus_runs_checkpoint_is_llamafactorys_four_groups_and_the_trainer_resumes_it(tmp_path):
    """With AdamW lr_ratios of one ratio on each B (LoRA+, run.yaml's loraplus_lr_ratio) the checkpoint
    holds LlamaFactory's LoRA+ param groups: a Trainer handed that optimizer (LlamaFactory's
    create_custom_optimizer) resumes from it and its steps land where the engine's do; the engine's own
    import reads the groups back."""
    from megacompile.train.methods.lora import file_key
    from tests.train.files import tokenizer
    from tests.train.finetune_runs import loraplus_groups
    ratio = 16.0
    base = str(tmp_path / "base")
    _llama(tied=False).save_pretrained(base)
    tokenizer().save_pretrained(base)

    def adamw(model):
        plus = {n: ratio for n, p in model.named_parameters() if p.requires_grad and ("lora_B" in n or p.ndim == 1)}
        return megacompile.AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=megacompile.hf_no_decay,
                                 lr_ratios=plus)
    model = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=1)
    engine = compile_folder(model, base, 1.0, file_key=file_key, device="cpu", optimizer=adamw(model))
    for ids in BATCHES[:SAVED_AT]:
        engine.step(input_ids=ids, labels=ids)
    folder = str(tmp_path / "out" / "checkpoint-2")
    engine.save_trainer_checkpoint(folder, batch_size=2, logging_steps=1)
    groups = torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True)["param_groups"]
    assert [len(g["params"]) for g in groups] == [4, 4, 0, 0]
    assert [g["lr"] for g in groups] == pytest.approx([LR, LR * ratio, LR * ratio, LR])
    assert [g["weight_decay"] for g in groups] == [WD, WD, 0.0, WD]

    theirs_model = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=2)     # other adapters until the resume
    theirs, fed = resumed_trainer(theirs_model, folder, loraplus_groups(theirs_model, LR, WD, ratio),
                                  lr_scheduler_type="constant")
    ours = [engine.step(input_ids=ids, labels=ids) for ids in fed]
    assert ours == pytest.approx(theirs, rel=1e-4)      # the Trainer logs its losses rounded to 4 digits
    errors = weight_errors(engine, theirs_model)
    assert max(errors.values()) <= 1e-5, errors
    again_model = _with_lora(LlamaForCausalLM.from_pretrained(base), seed=3)
    again = megacompile.compile(again_model, 1.0, device="cpu", optimizer=adamw(again_model))
    again.load_trainer_checkpoint(folder, strict=True)
    assert [again.step(input_ids=ids, labels=ids) for ids in fed] == ours


@pytest.mark.parametrize("adapter", [{"use_dora": True}, {"modules_to_save": ["lm_head"]},
                                     {"target_modules": ["embed_tokens", "q_proj"]}],
                         ids=["DoRA", "modules_to_save", "an Embedding's adapters"])
def test_dora_modules_to_save_and_embedding_adapters_go_out_and_come_back_in_as_peft_names_them(tmp_path, adapter):
    """PEFT writes a DoRA magnitude as `...lora_magnitude_vector`, a module trained whole as the
    wrapped module's own name (`lm_head.weight`) and an Embedding's adapters as `lora_embedding_A`:
    the engine's Trainer checkpoint is read by PEFT as the engine holds it, and read back by an engine
    whose adapters start elsewhere, which then trains as the engine that wrote it."""
    import peft

    def model(seed: int):
        torch.manual_seed(seed)
        return peft.get_peft_model(_llama(tied=False), peft.LoraConfig(
            task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, **{"target_modules": ["q_proj", "v_proj"],
                                                                          **adapter}))

    def engine(seed: int):
        return megacompile.compile(model(seed), 1.0, device="cpu", optimizer=megacompile.AdamW(
            lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, no_decay=megacompile.hf_no_decay))
    first = engine(1)
    for ids in BATCHES[:SAVED_AT]:
        first.step(input_ids=ids, labels=ids)
    folder = str(tmp_path / "checkpoint-2")
    first.save_trainer_checkpoint(folder, batch_size=2)
    read = peft.PeftModel.from_pretrained(model(3).base_model.model, folder)
    ours, theirs = first.state_dict(), read.state_dict()
    trained = [n for n, p in first.model.named_parameters() if p.requires_grad]
    assert len(trained) >= 6 and all(torch.equal(ours[n], theirs[n]) for n in trained)
    second = engine(2)
    second.load_trainer_checkpoint(folder)
    losses = [second.step(input_ids=ids, labels=ids) for ids in BATCHES[SAVED_AT:]]
    assert losses == [first.step(input_ids=ids, labels=ids) for ids in BATCHES[SAVED_AT:]]


@pytest.mark.parametrize("tier", ["ram", "disk"])
def test_optimizer_pt_is_written_from_the_host_state_itself_and_reads_back_as_it(tmp_path, monkeypatch, tier):
    """Every moment goes to torch.save as a view of its owner's flat buffer (torch.save writes a
    storage once, whatever shares it): writing the checkpoint copies none of the host state's 8 bytes
    per parameter of moments, and the file reads back as the engine holds them. On the disk tier each
    moment is its own copy: a view would keep its owner's whole read alive for every parameter."""
    from megacompile.cost.host_memory import host_costs
    from megacompile.io import trainer_export
    source = str(tmp_path / "model")
    _llama(tied=False).save_pretrained(source)
    engine = engine_for(source)
    if tier == "disk":      # the moments on disk, streamed in pieces of 4096 parameters (a pool this small)
        monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "4096")
        budget = host_costs(engine.prepare(input_ids=BATCHES[0], labels=BATCHES[0]).captured,
                            torch.float32)[1].ram_bytes / 2 ** 30
        engine = megacompile.from_pretrained(source, hbm_budget=1.0, device="cpu", nvme_dir=str(tmp_path / "tier"),
                                             host_budget=budget, optimizer=megacompile.AdamW(
                                                 lr=lr_at, betas=BETAS, eps=EPS, weight_decay=WD,
                                                 no_decay=megacompile.hf_no_decay))
    for ids in BATCHES[:SAVED_AT]:
        engine.step(input_ids=ids, labels=ids)
    engine.synchronize()        # the last step's host updates done: what the save writes
    host = engine.state.host
    held = {(i, k): host.view(k, n).clone() for i, n in enumerate(trainer_order(engine))
            for k in ("exp_avg", "exp_avg_sq")}
    saved = []
    real_save = torch.save
    monkeypatch.setattr(trainer_export.torch, "save", lambda obj, f, **kw: (saved.append(obj), real_save(obj, f, **kw)))
    folder = str(tmp_path / "checkpoint-2")
    engine.save_trainer_checkpoint(folder, batch_size=2)
    (optimizer,) = [obj for obj in saved if "param_groups" in obj]
    moments = [t for entry in optimizer["state"].values() for t in (entry["exp_avg"], entry["exp_avg_sq"])]
    if tier == "ram":
        buffers = {b.untyped_storage().data_ptr() for o in host.owners.values() for b in (o.exp_avg, o.exp_avg_sq)}
        assert moments and all(t.untyped_storage().data_ptr() in buffers for t in moments)
    else:
        assert host.disk is not None and host.disk.holds("exp_avg")
        assert all(t.untyped_storage().nbytes() == 4 * t.numel() for t in moments)
    read = torch.load(os.path.join(folder, "optimizer.pt"), weights_only=True)
    assert read["state"].keys() == {i for i, _ in held}
    assert all(torch.equal(read["state"][i][k], t) for (i, k), t in held.items())
