"""Planning a mixture-of-experts config: FLOPs from the parameters a token uses (top_k of the
experts), bytes over the link from all of them; a block's experts stream with the block."""
from __future__ import annotations

import transformers

import megacompile

H, I, E, K, LAYERS, VOCAB = 64, 128, 4, 2, 2, 256


def _config(**kw):
    return transformers.MixtralConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=E,
                                      num_experts_per_tok=K, vocab_size=VOCAB, max_position_embeddings=128, **kw)


def test_six_nd_counts_active_parameters_and_transfers_count_all():
    plan = megacompile.plan(_config(), hbm_budget=1.0, seq=64, hardware="h100")
    captured = plan.captured
    total = sum(e.numel for e in captured.state.values() if e.trainable)
    experts = LAYERS * E * 3 * H * I                    # gate_up [E, 2I, H] + down [E, H, I] per layer
    assert captured.active_params == total - experts + experts * K // E
    assert captured.flop_params == captured.active_params - VOCAB * H      # the untied embedding is a lookup
    assert plan.prediction.model_flops == 6 * captured.flop_params * 64
    # The experts' grouped matmuls are counted as hardware FLOPs (2SKN each, forward and backward):
    # without them the device would seem to do far less work than 6ND.
    assert 0.9 < plan.prediction.hardware_flops_per_model_flop < 1.5
    assert "active per token" in plan.summary()
    # Every expert of a block crosses the link with the block: the block's weights value holds them all.
    block = next(s for s in captured.stages if s.name == "block.0")
    assert block.template.weight_bytes >= E * 3 * H * I * 2     # bf16 device copies of all experts


def test_dense_model_reports_no_active_split():
    plan = megacompile.plan(transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=LAYERS,
                                                     num_attention_heads=4, vocab_size=VOCAB),
                            hbm_budget=1.0, seq=64, hardware="h100")
    total = sum(e.numel for e in plan.captured.state.values() if e.trainable)
    assert plan.captured.active_params == total
    assert "active per token" not in plan.summary()


def _gpt_oss_config():
    # GPT-OSS's layout: fused gate_up_proj [E, H, 2I] and down_proj [E, I, H], each with a per-expert
    # bias, and a router with a bias; sliding and full attention alternate. Eight layers, so that
    # planning traces only some blocks of each group (capture/alike.py).
    return transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=8,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_local_experts=E, num_experts_per_tok=K, vocab_size=VOCAB,
                                     sliding_window=8, max_position_embeddings=128)


def test_gpt_oss_active_parameters_in_every_capture_of_a_planning_run():
    """plan_global_batch captures once per micro-batch size; a later capture traces one block per
    group, and every block's experts must still count at top_k / E."""
    from megacompile.capture.top import blocks_grouped_once
    from megacompile.planner.from_config import model_from_config
    model = model_from_config(_gpt_oss_config())
    dense = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == 8 * E * (H * 2 * I + 2 * I + I * H + H)
    with blocks_grouped_once():
        plans = [megacompile.plan(model, hbm_budget=1.0, batch=b, seq=64, hardware="h100") for b in (2, 1)]
    for plan in plans:
        assert plan.captured.active_params == dense + experts * K // E
        peak = plan.hardware.peak_flops(plan.captured.compute_dtype)
        assert plan.prediction.tflops_6nd * 1e12 <= peak
        assert plan.prediction.hardware_flops_per_model_flop > 0.5
