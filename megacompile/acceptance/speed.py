"""The speed half of the validation: calibrate the hardware profile, then time real steps of
Llama-shaped models against the plan's prediction under that profile."""
from __future__ import annotations

import statistics
import time

import torch

from .table import Row

# Llama 1B (TinyLlama-1.1B's shape) and Llama 2 7B; `layers` is cut to what the time allows.
SHAPES = {
    "llama-1b": dict(vocab=32000, dim=2048, ffn=5632, heads=32, kv_heads=4, layers=22),
    "llama-7b": dict(vocab=32000, dim=4096, ffn=11008, heads=32, kv_heads=32, layers=32),
}


def calibrate_rows(device) -> tuple[object, list[Row]]:
    """The measured profile (megacompile/calibrate) and one row per figure in it."""
    from ..calibrate import measure, measure_gpu
    profile = measure_gpu(torch.device(device)) if torch.device(device).type == "cuda" else measure()
    rows = [Row("calibrate", key, float(value)) for key, value in profile.to_dict().items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)]
    return profile, rows


def step_rows(device, shape: str, layers: int, profile, batch: int = 4, seq: int = 2048, steps: int = 3,
              hbm_budget: float | None = None, dims: dict | None = None) -> list[Row]:
    """Measured against predicted for one model: step time, exposed transfer time (predicted; the
    runtime does not time device work yet), host optimizer time and 6ND TFLOPS."""
    from .. import AdamW
    from .. import compile as compile_model
    from ..cost import predict
    from ..models.llama import LlamaConfig, TinyLlama
    cuda = torch.device(device).type == "cuda"
    config = dict(SHAPES[shape] if dims is None else dims, layers=layers)
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(**config))
    ids = torch.randint(0, config["vocab"], (batch, seq))
    if hbm_budget is None:   # most of the device, so the plan keeps what it can
        from ..settings import default_hbm_budget
        hbm_budget = default_hbm_budget(device) if cuda else 64.0
    engine = compile_model(model, hbm_budget=hbm_budget, device=device,
                           compute_dtype=torch.bfloat16 if cuda else torch.float32, optimizer=AdamW(lr=1e-4))
    del model
    try:
        plan = engine.prepare(input_ids=ids, labels=ids)
        prediction = predict(plan.program, plan.captured, profile)
        seconds, host = [], []
        for _ in range(steps + 1):       # one step at a time: its latency, and its host optimizer alone
            engine.timeline.clear()
            start = time.perf_counter()
            engine.step(input_ids=ids, labels=ids)
            engine.synchronize()
            seconds.append(time.perf_counter() - start)
            host.append(sum(s.end - s.start for s in engine.timeline.on("host")))
        # Back to back, as a training loop runs them: a step's updates overlap the next forward,
        # which is what the prediction describes.
        start = time.perf_counter()
        for _ in range(steps):
            engine.step(input_ids=ids, labels=ids)
        engine.synchronize()
        measured = (time.perf_counter() - start) / steps
        stats = engine.memory_stats()
    finally:
        engine.close()
    latency = statistics.median(seconds[1:])     # the first step pays for first touches
    return [Row("step", f"{shape} x {layers} layers, {batch} x {seq} tokens", measured, prediction.step_s, None, {
        "predicted_step_s": prediction.step_s, "ratio_measured_to_predicted": measured / prediction.step_s,
        "step_latency_s": latency,
        "predicted_exposed_transfer_s": prediction.exposed_transfer_s,
        "predicted_exposed_update_s": prediction.exposed_update_s,
        "measured_host_optimizer_s": statistics.median(host[1:]), "predicted_host_optimizer_s": prediction.host_s,
        "measured_tflops_6nd": prediction.model_flops / measured / 1e12, "predicted_tflops_6nd": prediction.tflops_6nd,
        "hbm_budget_gib": hbm_budget, "ledger_peak_bytes": stats["device_peak_bytes"],
        "allocator_peak_reserved_bytes": stats.get("allocator_peak_reserved_bytes", float("nan")),
        "allocator_alloc_retries": stats.get("allocator_alloc_retries_total", float("nan")),
        "recomputed_blocks": len(plan.recomputed)})]
