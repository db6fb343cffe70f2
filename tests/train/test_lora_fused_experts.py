"""LoRA on a mixture-of-experts' routed experts, fused 3-D weights in transformers 5 (no Linear
modules): `all` and the projections' names adapt them as PEFT's target_parameters, at the rank PEFT
gives the names it turns onto them; trained through compile as eager PEFT trains them (losses and
first-step moments to 1e-5); the adapter PEFT loads back and the merged model transformers loads
give the engine's loss. `all` beside Linear modules of the experts' names (a shared expert's, a
dense layer's) leaves those out, as PEFT's all-linear does; a list naming them, a fused pair named by
half, another family's names and settings PEFT's experts' adapters do not take are refused by name."""
from __future__ import annotations

import pytest
import torch

from megacompile.acceptance.parity import clone, eager_losses, megacompile_run, moment_error, weight_bytes
from megacompile.errors import ArgumentError
from megacompile.train.methods.lora import file_key, with_adapters
from tests.families import FAMILIES, batch

peft = pytest.importorskip("peft")
RANK, ALPHA = 4, 8


def _qwen3_moe():
    torch.manual_seed(0)
    return FAMILIES["qwen3_moe"]()


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    config = Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=8, intermediate_size=64, moe_intermediate_size=32,
                             shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                             layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                             linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    with torch.device("meta"):
        return Qwen3NextForCausalLM(config)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    with torch.device("meta"):
        return MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                                                num_local_experts=4, num_experts_per_tok=2))


def _trained_shapes(model) -> dict[str, tuple]:
    return {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}


def _with_b_drawn(model):
    """B away from zero (seeded), so the first step's gradients of every A are not zero."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.05)
    return model


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:The following:RuntimeWarning")
def test_all_adapts_the_routed_experts_as_peft_adapts_their_projections_names():
    """`all` on Qwen3-MoE: the attention's Linear modules and both fused weights of every experts
    layer, gate_up_proj at twice the rank and alpha (two projections), as PEFT 0.21 gives the model
    target_modules naming q..o and gate_proj, up_proj, down_proj."""
    ours = with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, "all")
    theirs = peft.get_peft_model(_qwen3_moe(), peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]))
    assert _trained_shapes(ours) == _trained_shapes(theirs)
    assert sorted(ours.peft_config["default"].target_parameters) == ["down_proj", "gate_up_proj"]
    wrappers = {m.parameter_name: m for m in ours.modules() if hasattr(m, "parameter_name")}
    assert wrappers["gate_up_proj"].scaling["default"] == wrappers["down_proj"].scaling["default"] == ALPHA / RANK
    assert wrappers["gate_up_proj"].r["default"] == 2 * RANK
    named = with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"])
    assert _trained_shapes(named) == _trained_shapes(ours)
    # the files name the experts' weight without the wrappers PEFT stacks on its module
    assert file_key("base_model.model.model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj") == \
        "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:The following:RuntimeWarning")
def test_adapted_experts_train_through_compile_as_eager_peft_and_export_as_peft_loads_them(tmp_path):
    from transformers import AutoModelForCausalLM
    base = _qwen3_moe()
    model = _with_b_drawn(with_adapters(clone(base), RANK, ALPHA, 0.0, "all"))
    batches = [batch(seed=i) for i in range(3)]
    eager_first, first = {}, {}
    losses = eager_losses(clone(model), batches, "hf", first_moments=eager_first)
    run = megacompile_run(clone(model), batches, "hf", 2 * weight_bytes(model) / 2 ** 30, first_moments=first)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=0)
    assert set(first) == set(eager_first) and any(".mlp.experts." in n for n in first)
    assert moment_error(first, eager_first) <= 1e-5

    ids = batch(seed=5)
    with torch.no_grad():
        ours = run.engine(input_ids=ids, labels=ids).loss.item()
    run.engine.save_pretrained(tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(clone(base), str(tmp_path / "adapter")).eval()
    assert any(".mlp.experts." in n for n, _ in loaded.named_parameters() if "lora_A" in n)
    run.engine.save_pretrained(tmp_path / "merged", merge_adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert loaded(input_ids=ids, labels=ids).loss.item() == pytest.approx(ours, rel=1e-5)
        assert merged(input_ids=ids, labels=ids).loss.item() == pytest.approx(ours, rel=1e-5)
    run.engine.close()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_mixtrals_expert_names_adapt_its_fused_weights_and_half_a_pair_is_refused():
    model = with_adapters(_mixtral(), RANK, ALPHA, 0.0, ["q_proj", "w1", "w3", "w2"])
    assert sorted(model.peft_config["default"].target_parameters) == ["down_proj", "gate_up_proj"]
    with pytest.raises(ArgumentError, match=r"w1 names the routed experts' gate_up_proj, which holds w3 too"):
        with_adapters(_mixtral(), RANK, ALPHA, 0.0, ["q_proj", "w1"])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_settings_the_experts_adapters_do_not_take_are_refused_by_name():
    with pytest.raises(ArgumentError, match=r"gate_up_proj, down_proj.*take no dropout: set lora_dropout: 0"):
        with_adapters(_mixtral(), RANK, ALPHA, 0.1, "all")
    with pytest.raises(ArgumentError, match=r"no DoRA"):
        with_adapters(_mixtral(), RANK, ALPHA, 0.0, ["w1", "w3"], dora=True)
    with_adapters(_mixtral(), RANK, ALPHA, 0.1, ["q_proj", "v_proj"])        # no experts: dropout as before


def _qwen3_moe_dense_first():
    """Qwen3-MoE with a dense MLP layer first (mlp_only_layers), as GLM-4.5-Air and DeepSeek-V3 begin."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    with torch.device("meta"):
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  head_dim=8, moe_intermediate_size=16, num_experts=4,
                                                  num_experts_per_tok=2, mlp_only_layers=[0]))


@pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::FutureWarning")
@pytest.mark.parametrize("make, where", [(_qwen3_next, "of its shared expert"),
                                         (_qwen3_moe_dense_first, "outside its routed experts")])
def test_all_beside_linear_modules_of_the_experts_names_adapts_the_experts_as_peft_all_linear(make, where):
    """Linear modules of the projections' names beside the routed experts (a shared expert's, a dense
    MLP layer's): PEFT turns those names onto the fused weights alone, on wrapping and on loading an
    adapter. `all` does as PEFT's all-linear does (the experts adapted, those modules left out, said
    in a note); a list naming them is refused, naming where they sit."""
    said: list[str] = []
    model = with_adapters(make(), 2, 4, 0.0, "all", said=said)
    config = model.peft_config["default"]
    assert sorted(config.target_parameters) == ["down_proj", "gate_up_proj"]
    assert not {"gate_proj", "up_proj", "down_proj"} & set(config.target_modules)
    assert f"leaves out the Linear modules down_proj, gate_proj, up_proj {where}" in said[0]
    with pytest.raises(ArgumentError) as e:
        with_adapters(make(), 2, 4, 0.0, ["q_proj", "gate_proj", "up_proj", "down_proj"])
    message = str(e.value)
    assert f"down_proj, gate_proj, up_proj name Linear modules {where}" in message
    assert "mlp.experts.gate_up_proj" in message and "base_layer" not in message
    assert "e.g. lora_target: q_proj" in message and ("shared expert" in message) == ("shared" in where)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_fused_weights_own_name_is_refused_naming_the_projections_names_that_adapt_it():
    """PEFT's target_modules match nothing by gate_up_proj (a parameter): the refusal names the
    names PEFT turns onto it for the family."""
    with pytest.raises(ArgumentError, match=r"gate_up_proj is no Linear module.*fused weights \(down_proj, "
                                            r"gate_up_proj\) take adapters by their projections' names, as PEFT "
                                            r"turns them for qwen3_moe: gate_proj, up_proj, down_proj"):
        with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, ["q_proj", "gate_up_proj", "down_proj"])
    with pytest.raises(ArgumentError, match=r"as PEFT turns them for mixtral: w1, w3, w2"):
        with_adapters(_mixtral(), RANK, ALPHA, 0.0, ["q_proj", "gate_up_proj"])


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_another_familys_expert_names_are_refused_as_peft_matches_nothing_by_them():
    with pytest.raises(ArgumentError, match=r"w1, w3 are no Linear module.*qwen3_moe: gate_proj, up_proj"):
        with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, ["q_proj", "w1", "w3"])
    with pytest.raises(ArgumentError, match=r"gate_proj, up_proj are no Linear module.*mixtral: w1, w3, w2"):
        with_adapters(_mixtral(), RANK, ALPHA, 0.0, ["q_proj", "gate_proj", "up_proj"])


@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:The following:RuntimeWarning")
def test_what_takes_adapters_is_said_in_one_line():
    said: list[str] = []
    model = with_adapters(_mixtral(), RANK, ALPHA, 0.0, "all", said=said)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert said == [f"lora_target: adapters on k_proj, o_proj, q_proj, v_proj and the routed experts' fused "
                    f"down_proj (rank {RANK}), gate_up_proj (rank {2 * RANK}): {trained:,} trainable parameters"]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_planned_model_refuses_a_pissa_start_on_the_experts_as_the_run_does():
    """methods.apply (plan --run, the run's meta model) takes pissa_init as lora_skeleton does."""
    from types import SimpleNamespace

    from megacompile.train import methods
    c = SimpleNamespace(finetuning_type="lora", lora_rank=RANK, lora_alpha=ALPHA, lora_dropout=0.0, lora_target="all",
                        compute_dtype="float32", use_dora=False, use_rslora=False, additional_target=[],
                        pissa_init=True, stage="sft", freeze_language_model=None, freeze_vision_tower=None,
                        freeze_multi_modal_projector=None)
    with pytest.raises(ArgumentError, match=r"no PiSSA start: leave pissa_init out"):
        methods.apply(c, _mixtral())


def _mixtral_dir(path: str) -> str:
    from transformers import MixtralConfig, MixtralForCausalLM
    from tests.train import files
    tok = files.tokenizer()
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id, use_cache=False)
    MixtralForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_run_with_lora_target_all_on_a_mixtral_folder_trains_its_experts_as_eager_peft(tmp_path):
    """run.yaml: the base streams from the folder's files into the experts' fused weights under PEFT's
    wrappers; the losses are eager PEFT's (the same seed, the same adapters) and the adapter export
    holds the experts' adapters."""
    import os

    from safetensors import safe_open

    from megacompile.train import load, log, run
    from tests.train import files, finetune_runs
    model = _mixtral_dir(str(tmp_path / "mixtral"))
    notes = files.text(str(tmp_path / "notes.txt"))
    c = load(files.run_yaml(str(tmp_path / "lora.yaml"), model=model, data=[notes], eval=[notes], seq=16, batch=2,
                            steps=3, lr=1e-2, schedule="constant", max_grad_norm=None, device="cpu",
                            run_dir=str(tmp_path / "run"), export=str(tmp_path / "out"), log_every=1, save_every=3,
                            finetuning_type="lora", lora_rank=RANK, lora_target="all", seed=3), [])
    run(c)
    rows, _ = finetune_runs.rows(c, tmp_path, 16)
    eager, losses, _ = finetune_runs.eager(c, rows)
    ours = [float(r["loss"]) for r in log.read(os.path.join(c.run_dir, "log.csv"))]
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(losses), rtol=1e-5, atol=0)
    with safe_open(os.path.join(c.export, "adapter_model.safetensors"), "pt") as f:
        assert any(".mlp.experts.base_layer.lora_A." in k for k in f.keys())


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_an_adapter_start_without_the_experts_adapters_is_refused_naming_them(tmp_path):
    """An adapter made with the attention's modules alone (LlamaFactory's `all` on transformers 5,
    whose Linear modules are the attention's) is not the adapter `all` makes here."""
    from megacompile.errors import WeightsFileError
    from megacompile.io import lora_adapter
    with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, ["q_proj", "k_proj", "v_proj", "o_proj"]).save_pretrained(tmp_path)
    with pytest.raises(WeightsFileError, match=r"target_parameters None \(this model down_proj, gate_up_proj; "):
        lora_adapter.check(with_adapters(_qwen3_moe(), RANK, ALPHA, 0.0, "all"), str(tmp_path))


def test_a_peft_without_its_weight_conversion_table_is_refused_rather_than_adapting_nothing(monkeypatch):
    """The experts' names are PEFT's per family: a PEFT release without that table would leave them
    adapting nothing, so an MoE model is refused naming the upgrade; a dense model is not concerned."""
    import sys

    from megacompile.train.methods.lora_experts import pre_fusion
    monkeypatch.setitem(sys.modules, "peft.utils.transformers_weight_conversion", None)    # import fails
    with pytest.raises(ArgumentError, match="routed experts are fused weights.*pip install -U peft"):
        pre_fusion(_qwen3_moe())
    assert pre_fusion(FAMILIES["llama"]()) == {}
