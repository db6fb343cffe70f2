"""Writes the torchtune checkpoints tests/e2e/test_torchtune_checkpoint.py takes in, each with what
torchtune's own conversion makes of its state. Run by hand where torchtune is installed (these were
written by torchtune 0.6.1 on the CPU, torchao 0.10 beside it):

    python tests/data/torchtune/make.py [CASE ...]      (every case, or those named)

Each case starts torchtune's model from a small Hugging Face model (the Llama of
tests/data/deepspeed/make.py, a Qwen2 or a Gemma, both with tied embeddings, the Gemma's heads
wider than hidden / heads) through FullModelHFCheckpointer, as
a torchtune recipe does, trains it SAVED_AT steps with torch's AdamW in float32 (one param group,
every parameter decayed, as torchtune's recipes build it), and saves an intermediate checkpoint
as the recipes do:

    CASE/epoch_0/                  FullModelHFCheckpointer.save_checkpoint: the Hugging Face
                                   weights and the model folder's files
    CASE/recipe_state/recipe_state.pt   (torchtune 0.6.1) {"optimizer": optimizer.state_dict(),
                                   keyed by the index of each parameter in the model's order,
                                   "seed", "epochs_run", "total_epochs", "max_steps_per_epoch"}
    lora_* cases: LoRA adapters (LORA) trained on the frozen model, saved as torchtune's LoRA
                                   recipes save them: the merged weights, adapter_model.pt
                                   (torchtune's names), adapter_model.safetensors and
                                   adapter_config.json (PEFT's); the optimizer given every
                                   parameter, as the recipes give it
    fqn_* cases: CASE/epoch_0/recipe_state.pt instead, as torchtune's later releases write it: the
                                   optimizer state keyed by parameter name (get_optimizer_state_dict
                                   with full_state_dict, what its distributed recipes save) and
                                   "steps_run"
    CASE.expected.safetensors      master/, exp_avg/, exp_avg_sq/ under the Hugging Face names,
                                   as torchtune's tune_to_hf turns its state into them (a LoRA
                                   case's adapters under the PEFT model's names: Llama's as
                                   tune_to_peft_adapter_weights turns them, Qwen2's renamed alone,
                                   as torchtune does not permute Qwen2's rows); after/ the
                                   weights after GOING_ON more steps on batches after/ids.N, whose
                                   losses are after/losses
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("deepspeed_make", os.path.join(HERE, "..", "deepspeed", "make.py"))
ds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ds)
SAVED_AT, GOING_ON, ROWS, SEQ = 3, 2, 2, 8
LR, WD, BETAS, EPS = 1e-2, 0.1, (0.9, 0.95), 1e-8
QWEN2 = dict(vocab_size=51, hidden_size=16, intermediate_size=22, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, rope_theta=10000.0)
GEMMA = dict(vocab_size=51, hidden_size=16, intermediate_size=22, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=1, head_dim=8, max_position_embeddings=32, rope_theta=10000.0)
# Gemma 2: its four norms per layer and its final norm inside the logits' cap, named otherwise
GEMMA2 = GEMMA | dict(query_pre_attn_scalar=8, sliding_window=4096, attn_logit_softcapping=50.0,
                      final_logit_softcapping=30.0)
CASES = ("llama", "qwen2", "fqn_llama", "fqn_qwen2", "lora_llama", "fqn_lora_qwen2", "fqn_gemma", "gemma2")
# each LoRA case's modules (torchtune's lora_attn_modules, apply_lora_to_mlp), rank and alpha
LORA = {"lora_llama": (["q_proj", "k_proj", "v_proj"], True), "fqn_lora_qwen2": (["q_proj", "k_proj"], False)}
RANK, ALPHA = 4, 8.0


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 11)
    return torch.randint(0, ds.CONFIG["vocab_size"], (ROWS, SEQ), generator=g)


def _models(name: str, folder: str):
    """(the Hugging Face model saved into `folder`, torchtune's model, its checkpointer's model_type)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    lora = dict(lora_attn_modules=LORA[name][0], apply_lora_to_mlp=LORA[name][1], lora_rank=RANK,
                lora_alpha=ALPHA) if name in LORA else {}
    if name.endswith(("gemma", "gemma2")):
        if name.endswith("gemma2"):
            from torchtune.models.gemma2._component_builders import gemma2 as build
            from transformers import Gemma2Config as Config, Gemma2ForCausalLM as Model
            sizes, kind = GEMMA2, "GEMMA2"
            extra = dict(hidden_capping_value=50.0, final_capping_value=30.0, sliding_window_size=4096,
                         query_pre_attn_scalar=8)
        else:
            from torchtune.models.gemma._component_builders import gemma as build
            from transformers import GemmaConfig as Config, GemmaForCausalLM as Model
            sizes, kind, extra = GEMMA, "GEMMA", {}
        config = Config(**sizes)
        hf = Model(config)
        tune = build(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                     num_heads=config.num_attention_heads, head_dim=config.head_dim,
                     num_kv_heads=config.num_key_value_heads, embed_dim=config.hidden_size,
                     intermediate_dim=config.intermediate_size, max_seq_len=32, norm_eps=config.rms_norm_eps,
                     rope_base=config.rope_parameters["rope_theta"], **extra)
        hf.save_pretrained(folder)
        return hf, tune, kind
    if name.endswith("qwen2"):
        from torchtune.models.qwen2 import lora_qwen2, qwen2
        config = Qwen2Config(**QWEN2)
        hf = Qwen2ForCausalLM(config)
        tune = (lora_qwen2 if lora else qwen2)(
            vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            embed_dim=config.hidden_size, intermediate_dim=config.intermediate_size, max_seq_len=32,
            norm_eps=config.rms_norm_eps, rope_base=config.rope_parameters["rope_theta"], tie_word_embeddings=True,
            **lora)
        kind = "QWEN2"
    else:
        from torchtune.models.llama3 import llama3, lora_llama3
        config = LlamaConfig(**ds.CONFIG)
        hf = LlamaForCausalLM(config)
        tune = (lora_llama3 if lora else llama3)(
            vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            embed_dim=config.hidden_size, intermediate_dim=config.intermediate_size, max_seq_len=32,
            norm_eps=config.rms_norm_eps, rope_base=config.rope_parameters["rope_theta"], **lora)
        kind = "LLAMA3"
    hf.save_pretrained(folder)
    return hf, tune, kind


def _to_hf(kind: str, tensors: dict, config) -> dict:
    """torchtune's own conversion of a state keyed by its names into the Hugging Face names (a LoRA
    run's adapters: into the PEFT model's)."""
    adapters = {n: t for n, t in tensors.items() if ".lora_" in n}
    if adapters:
        return _adapters_to_hf(kind, adapters, config)
    if kind == "GEMMA2":
        from torchtune.models.gemma2._convert_weights import gemma2_tune_to_hf
        return gemma2_tune_to_hf(tensors, num_heads=config.num_attention_heads,
                                 num_kv_heads=config.num_key_value_heads, dim=config.hidden_size,
                                 head_dim=config.head_dim)
    if kind == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf
        return qwen2_tune_to_hf(tensors, num_heads=config.num_attention_heads,
                                num_kv_heads=config.num_key_value_heads, dim=config.hidden_size,
                                tie_word_embeddings=True)
    from torchtune.models.convert_weights import tune_to_hf
    return tune_to_hf(tensors, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                      dim=config.hidden_size, head_dim=getattr(config, "head_dim", None))


def _adapters_to_hf(kind: str, tensors: dict, config) -> dict:
    if kind == "QWEN2":     # renamed alone: torchtune's PEFT conversion would permute rows Qwen2 does not permute
        from torchtune.models.convert_weights import _FROM_HF, get_mapped_key
        names = {v.replace(".weight", f".{lora}.weight"): k.replace(".weight", f".{peft}.weight")
                 for k, v in _FROM_HF.items() if v for lora, peft in (("lora_a", "lora_A"), ("lora_b", "lora_B"))}
        out = {"base_model.model." + get_mapped_key(n, names): t for n, t in tensors.items()}
    else:
        from torchtune.models.convert_weights import tune_to_peft_adapter_weights
        out = tune_to_peft_adapter_weights(tensors, num_heads=config.num_attention_heads,
                                           num_kv_heads=config.num_key_value_heads, dim=config.hidden_size)
    return {k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): t for k, t in out.items()}


def _dataloader_state(batches: int) -> dict:
    """What a recipe's StatefulDataLoader says after `batches` batches (saved beside the optimizer)."""
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(list(range(ROWS * (SAVED_AT + GOING_ON))), batch_size=ROWS)
    it = iter(loader)
    for _ in range(batches):
        next(it)
    return loader.state_dict()


def run(name: str) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torchtune.training import FullModelHFCheckpointer

    out = os.path.join(HERE, name)
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as base:
        hf, tune, kind = _models(name, base)
        checkpointer = FullModelHFCheckpointer(checkpoint_dir=base, checkpoint_files=["model.safetensors"],
                                               model_type=kind, output_dir=out)
        missing, _ = tune.load_state_dict(checkpointer.load_checkpoint()["model"], strict=False)
        if name in LORA:
            from torchtune.modules.peft import get_adapter_params, set_trainable_params
            set_trainable_params(tune, get_adapter_params(tune))
            torch.manual_seed(3)
            for n, p in tune.named_parameters():      # torchtune starts lora_b at zero: move every adapter off it
                if p.requires_grad:
                    torch.nn.init.normal_(p, std=0.1)
        assert all(".lora_" in n for n in missing), missing
        optimizer = torch.optim.AdamW(tune.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)

        def step(s: int) -> torch.Tensor:
            ids = batch(s)
            logits = tune(ids)
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss.detach()

        for s in range(SAVED_AT):
            step(s)
        fqn = name.startswith("fqn_")
        state = (get_optimizer_state_dict(tune, optimizer, options=StateDictOptions(full_state_dict=True))
                 if fqn else optimizer.state_dict())
        saved = {"model": {k: v.clone() for k, v in tune.state_dict().items()}, "optimizer": state, "seed": 0,
                 "epochs_run": 1, "total_epochs": 2, "max_steps_per_epoch": SAVED_AT + GOING_ON,
                 "dataloader": _dataloader_state(SAVED_AT)}
        if name in LORA:        # as torchtune's LoRA recipes save: merged weights, the adapters beside them
            from torchtune.modules.peft import get_adapter_state_dict, get_lora_module_names, get_merged_lora_ckpt
            saved["adapter"] = get_adapter_state_dict(saved["model"])
            saved["model"] = get_merged_lora_ckpt(saved["model"], rank=RANK, alpha=ALPHA)
            saved["adapter_config"] = {"r": RANK, "lora_alpha": ALPHA, "peft_type": "LORA",
                                       "target_modules": get_lora_module_names(*LORA[name], False)}
        checkpointer.save_checkpoint(saved, epoch=0, intermediate_checkpoint=True)
        if fqn:     # the later releases' layout: the recipe state beside the weights, with steps_run
            recipe = os.path.join(out, "recipe_state", "recipe_state.pt")
            saved = torch.load(recipe, weights_only=False)
            saved["steps_run"] = SAVED_AT
            torch.save(saved, os.path.join(out, "epoch_0", "recipe_state.pt"))
            shutil.rmtree(os.path.dirname(recipe))
        trained = {n: p for n, p in tune.named_parameters() if p.requires_grad}
        moments = {n: optimizer.state[p] for n, p in trained.items()}
        expected = {f"master/{k}": v.detach().clone() for k, v in _to_hf(kind, trained, hf.config).items()}
        for table in ("exp_avg", "exp_avg_sq"):
            by_name = {n: moments[n][table] for n in trained}
            expected |= {f"{table}/{k}": v.clone() for k, v in _to_hf(kind, by_name, hf.config).items()}
        losses = []
        for s in range(SAVED_AT, SAVED_AT + GOING_ON):
            losses.append(step(s))
            expected[f"after/ids.{s}"] = batch(s)
        trained = {n: p for n, p in tune.named_parameters() if p.requires_grad}
        expected |= {f"after/{k}": v.detach().clone() for k, v in _to_hf(kind, trained, hf.config).items()}
        expected["after/losses"] = torch.stack(losses)
        save_file({k: v.detach().contiguous() for k, v in expected.items()}, f"{out}.expected.safetensors")


if __name__ == "__main__":
    for case in CASES:
        if len(sys.argv) == 1 or case in sys.argv[1:]:
            run(case)
