"""Writes the torchtune checkpoints tests/e2e/test_torchtune_checkpoint.py takes in, each with what
torchtune's own conversion makes of its state. Run by hand where torchtune is installed (these were
written by torchtune 0.6.1 on the CPU):

    python tests/data/torchtune/make.py [CASE ...]      (every case, or those named)

Each case starts torchtune's model from a small Hugging Face model (the Llama of
tests/data/deepspeed/make.py, or a Qwen2 with tied embeddings) through FullModelHFCheckpointer, as
a torchtune recipe does, trains it SAVED_AT steps with torch's AdamW in float32 (one param group,
every parameter decayed, as torchtune's recipes build it), and saves an intermediate checkpoint
as the recipes do:

    CASE/epoch_0/                  FullModelHFCheckpointer.save_checkpoint: the Hugging Face
                                   weights and the model folder's files
    CASE/recipe_state/recipe_state.pt   (torchtune 0.6.1) {"optimizer": optimizer.state_dict(),
                                   keyed by the index of each parameter in the model's order,
                                   "seed", "epochs_run", "total_epochs", "max_steps_per_epoch"}
    fqn_* cases: CASE/epoch_0/recipe_state.pt instead, as torchtune's later releases write it: the
                                   optimizer state keyed by parameter name (get_optimizer_state_dict
                                   with full_state_dict, what its distributed recipes save) and
                                   "steps_run"
    CASE.expected.safetensors      master/, exp_avg/, exp_avg_sq/ under the Hugging Face names,
                                   as torchtune's tune_to_hf turns its state into them; after/ the
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
CASES = ("llama", "qwen2", "fqn_llama", "fqn_qwen2")


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 11)
    return torch.randint(0, ds.CONFIG["vocab_size"], (ROWS, SEQ), generator=g)


def _models(name: str, folder: str):
    """(the Hugging Face model saved into `folder`, torchtune's model, its checkpointer's model_type)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    if name.endswith("qwen2"):
        from torchtune.models.qwen2 import qwen2
        config = Qwen2Config(**QWEN2)
        hf = Qwen2ForCausalLM(config)
        tune = qwen2(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                     num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                     embed_dim=config.hidden_size, intermediate_dim=config.intermediate_size, max_seq_len=32,
                     norm_eps=config.rms_norm_eps, rope_base=config.rope_parameters["rope_theta"], tie_word_embeddings=True)
        kind = "QWEN2"
    else:
        from torchtune.models.llama3 import llama3
        config = LlamaConfig(**ds.CONFIG)
        hf = LlamaForCausalLM(config)
        tune = llama3(vocab_size=config.vocab_size, num_layers=config.num_hidden_layers,
                      num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                      embed_dim=config.hidden_size, intermediate_dim=config.intermediate_size, max_seq_len=32,
                      norm_eps=config.rms_norm_eps, rope_base=config.rope_parameters["rope_theta"])
        kind = "LLAMA3"
    hf.save_pretrained(folder)
    return hf, tune, kind


def _to_hf(kind: str, tensors: dict, config) -> dict:
    """torchtune's own conversion of a state keyed by its names into the Hugging Face names."""
    if kind == "QWEN2":
        from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf
        return qwen2_tune_to_hf(tensors, num_heads=config.num_attention_heads,
                                num_kv_heads=config.num_key_value_heads, dim=config.hidden_size,
                                tie_word_embeddings=True)
    from torchtune.models.convert_weights import tune_to_hf
    return tune_to_hf(tensors, num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
                      dim=config.hidden_size)


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
        tune.load_state_dict(checkpointer.load_checkpoint()["model"])
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
        checkpointer.save_checkpoint({"model": {k: v.clone() for k, v in tune.state_dict().items()},
                                      "optimizer": state, "seed": 0, "epochs_run": 1, "total_epochs": 1,
                                      "max_steps_per_epoch": SAVED_AT + GOING_ON}, epoch=0,
                                     intermediate_checkpoint=True)
        if fqn:     # the later releases' layout: the recipe state beside the weights, with steps_run
            recipe = os.path.join(out, "recipe_state", "recipe_state.pt")
            saved = torch.load(recipe, weights_only=False)
            saved["steps_run"] = SAVED_AT
            torch.save(saved, os.path.join(out, "epoch_0", "recipe_state.pt"))
            shutil.rmtree(os.path.dirname(recipe))
        names = [n for n, _ in tune.named_parameters()]
        moments = optimizer.state_dict()["state"]
        expected = {f"master/{k}": v.clone() for k, v in _to_hf(kind, dict(tune.named_parameters()), hf.config).items()}
        for table in ("exp_avg", "exp_avg_sq"):
            by_name = {n: moments[i][table] for i, n in enumerate(names)}
            expected |= {f"{table}/{k}": v.clone() for k, v in _to_hf(kind, by_name, hf.config).items()}
        losses = []
        for s in range(SAVED_AT, SAVED_AT + GOING_ON):
            losses.append(step(s))
            expected[f"after/ids.{s}"] = batch(s)
        expected |= {f"after/{k}": v.detach().clone()
                     for k, v in _to_hf(kind, dict(tune.named_parameters()), hf.config).items()}
        expected["after/losses"] = torch.stack(losses)
        save_file({k: v.detach().contiguous() for k, v in expected.items()}, f"{out}.expected.safetensors")


if __name__ == "__main__":
    for case in CASES:
        if len(sys.argv) == 1 or case in sys.argv[1:]:
            run(case)
