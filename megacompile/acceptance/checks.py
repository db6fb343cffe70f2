"""The correctness half of the validation: kernels, training parity, and the budget held.

Each section takes the device it runs on, so the tests run the same code on the cpu backend.
"""
from __future__ import annotations

import math

import torch

from .parity import (BF16_LOSS_RTOL, FP32_RTOL, WEIGHT_NOISE_FACTOR, clone, eager_losses, loss_error,
                     megacompile_run, moment_error, weight_bytes, weight_errors)
from .table import Row

GiB = 2 ** 30


def kernel_rows(size: str = "check", only: str | None = None) -> list[Row]:
    """Every kernel against its reference, on the device when there is one (kernels/check.py);
    the tolerances are the device's: exact where a kernel uses IEEE rounding, else the check's."""
    from ..kernels import check
    rows = []
    for r in check.run(size, compile_gpu=False, only=only):
        worst = max((e for e in (r.forward, r.backward) if not math.isnan(e)), default=math.nan)
        rows.append(Row("kernels", f"{r.kernel} {str(r.dtype).replace('torch.', '')}", worst, r.tol,
                        r.passed, {"forward_error": r.forward, "backward_error": r.backward,
                                   "seconds": r.seconds, "device": str(check.DEVICE),
                                   **({"error": r.error} if r.error else {})}))
    return rows


def parity_models(width: int = 128, layers: int = 4) -> dict:
    """name -> model builder; transformers' models only where transformers is installed."""
    from ..models.llama import LlamaConfig, TinyLlama
    builders = {"tinyllama": lambda: TinyLlama(LlamaConfig(vocab=96, dim=width, layers=layers, heads=4, kv_heads=2,
                                                             ffn=2 * width))}
    try:
        import transformers  # noqa: F401
    except ImportError:
        return builders
    from .models import hf_gpt2, hf_llama, hf_qwen2
    return builders | {"llama": lambda: hf_llama(layers, width), "qwen2": lambda: hf_qwen2(layers, width),
                       "gpt2": lambda: hf_gpt2(layers, width)}


def parity_rows(device, width: int = 128, layers: int = 4, steps: int = 10, budget_fraction: float = 0.5,
                dtypes=(torch.float32, torch.bfloat16), only: tuple[str, ...] | None = None) -> list[Row]:
    """Each parity model trained `steps` steps through megacompile on `device` (the plan gets half
    the weights' bytes beside the device reserve, so blocks stream) against eager
    torch.optim.AdamW in float32 on the same device. float32 passes when the losses and the first
    step's gradients agree to FP32_RTOL and the final weights to FP32_RTOL or, off the host, to
    WEIGHT_NOISE_FACTOR times eager's own distance between the device and the host (parity.py)."""
    from .models import batch
    host = torch.device(device).type == "cpu"
    rows = []
    for name, build in parity_models(width, layers).items():
        if only is not None and name not in only:
            continue
        torch.manual_seed(0)
        model = build()
        batches = [batch(96, b=2, t=16, seed=i) for i in range(steps)]
        reference, eager_moments = clone(model), {}
        eager = eager_losses(reference, batches, name, device, first_moments=eager_moments)
        reference.cpu()
        noise = 0.0
        if not host:     # the same eager run on the host: how far two devices' rounding drifts apart
            on_host = clone(model)
            eager_losses(on_host, batches, name)
            noise = max(weight_errors(on_host, reference).values())
        for dtype in dtypes:
            bf16 = dtype == torch.bfloat16
            tol = BF16_LOSS_RTOL if bf16 else FP32_RTOL
            label = f"{name} {str(dtype).replace('torch.', '')}"
            try:
                budget = _streaming_budget(model, name, batches[0], device, dtype, budget_fraction) / GiB
                moments = {}
                run = megacompile_run(clone(model), batches, name, budget, device=device, compute_dtype=dtype,
                                      first_moments=moments)
            except Exception as e:   # noqa: BLE001 - a failed model is a failed row, the others still run
                rows.append(Row("parity", label, math.inf, tol, False, {"error": f"{type(e).__name__}: {e}"}))
                continue
            losses = loss_error(run.losses, eager)
            grads = moment_error(moments, eager_moments)
            weights = max(weight_errors(run.engine, reference).values())
            run.engine.close()
            weight_tol = max(FP32_RTOL, WEIGHT_NOISE_FACTOR * noise)
            ok = losses <= tol and (bf16 or (grads <= FP32_RTOL and weights <= weight_tol))
            rows.append(Row("parity", label, losses, tol, ok,
                            {"first_grad_error": grads, "weight_error": weights, "weight_tolerance": weight_tol,
                             "eager_device_vs_host_weight_error": noise, "steps": steps, "seconds": run.seconds,
                             "budget_bytes": int(budget * GiB), "weight_bytes": weight_bytes(model),
                             "predicted_peak_bytes": run.predicted}))
    return rows



def _streaming_budget(model, kind: str, ids, device, dtype, fraction: float) -> int:
    """The budget that leaves the plan `fraction` of the weights' bytes after the device reserve
    (or the smallest budget, if more): blocks must stream, on a GPU as on the simulated device."""
    from .. import compile as compile_model
    from ..cost.reserve import smallest_budget
    from .parity import make_inputs
    probe = compile_model(clone(model), hbm_budget=_probe_budget(device), device=device, compute_dtype=dtype)
    try:
        plan = probe.prepare(**make_inputs(kind, ids))
    finally:
        probe.close()
    target = smallest_budget(int(weight_bytes(model) * fraction), plan.captured, plan.hardware, plan.backend)
    return max(target, plan.minimum_budget_bytes)


def _probe_budget(device) -> float:
    """GiB for an engine that only plans (to read the smallest budget): most of the device."""
    if torch.device(device).type == "cpu":
        return 64.0
    from ..settings import default_hbm_budget
    return default_hbm_budget(device)


def _empty_cache(device) -> None:
    import gc
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def budget_rows(device, model=None, kind: str = "tinyllama", ids=None, factors=(1.5, 2.5, 4.0)) -> list[Row]:
    """torch's real peak (max_memory_reserved) within the budget at the smallest budget the planner
    reports and at `factors` times it. On the cpu backend the ledger is the allocator."""
    from .models import batch
    from .parity import make_inputs
    if model is None:
        from ..models.llama import LlamaConfig, TinyLlama
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig(vocab=256, dim=256, layers=6, heads=8, kv_heads=4, ffn=704))
        ids = batch(256, b=4, t=128)
    inputs = make_inputs(kind, ids)
    from .. import compile as compile_model, minimum_budget
    from ..calibrate import profile_for
    # As compile() plans on this device: its profile, float32 (compile()'s compute dtype).
    minimum = int(minimum_budget(model, hardware=profile_for(torch.device(device).type), inputs=inputs,
                                 compute_dtype=torch.float32) * GiB)
    rows = []
    for factor in (1.0, *factors):
        budget = int(minimum * factor)
        _empty_cache(device)      # the last engine's cached blocks would count as this one's reserved
        engine = compile_model(clone(model), hbm_budget=budget / GiB, device=device)
        try:
            for _ in range(2):
                engine.step(**inputs)
            engine.synchronize()
            stats = engine.memory_stats()
        finally:
            engine.close()
        real = stats.get("allocator_peak_reserved_bytes", stats["device_peak_bytes"])
        rows.append(Row("budget", f"{kind} at {factor:g}x the smallest budget", real, budget, real <= budget,
                        {"ledger_peak_bytes": stats["device_peak_bytes"],
                         "predicted_peak_bytes": stats["predicted_device_peak_bytes"],
                         "allocator_peak_allocated_bytes": stats.get("allocator_peak_allocated_bytes", math.nan),
                         "allocator_alloc_retries": stats.get("allocator_alloc_retries_total", math.nan),
                         "reserve_bytes": engine.plan.reserve.total}))
    return rows
