"""Measuring the machine is its own room, above the engine: the cost model only reads profiles,
and a cold cache is measured once, by the planner's default for the cpu backend, without the
fit's own engine asking for the profile being measured."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import megacompile
import megacompile.calibrate.cache as cache
from megacompile.cost import get_profile
from megacompile.models.llama import LlamaConfig, TinyLlama

COST = Path(megacompile.__file__).resolve().parent / "cost"
ABOVE = ("engine", "planner", "calibrate", "io", "train")


def _imported(path: Path) -> list[str]:
    """Every module a file imports, at its top or inside functions, as absolute names."""
    package = ["megacompile", *path.relative_to(COST.parent).parts[:-1]]
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            # `from .. import x` may name a module: count megacompile.x as imported
            names += [module] + ([f"{module}.{a.name}" for a in node.names] if node.module is None else [])
    return names


def test_the_cost_model_imports_nothing_above_it():
    offending = []
    for path in sorted(COST.rglob("*.py")):
        for name in _imported(path):
            parts = name.split(".")
            if parts[0] != "megacompile":
                continue
            # The package root imports the engine; a room above the cost model is out of bounds.
            if len(parts) == 1 or parts[1] in ABOVE or (len(parts) == 2 and parts[1] == "compile"):
                offending.append(f"{path.relative_to(COST.parent)}: {name}")
    assert not offending, f"cost/ imports from above it: {offending}"


def test_a_cold_cache_is_measured_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGACOMPILE_CACHE_DIR", str(tmp_path))
    with pytest.raises(megacompile.MegacompileError, match="cpu profile is not measured yet"):
        get_profile("cpu")      # the cost model reads; it never measures
    fits = []

    def counted(profile, *args, **kwargs):
        fits.append(profile)
        return fit(profile, *args, **kwargs)
    fit = cache.fit_node_overhead
    monkeypatch.setattr(cache, "fit_node_overhead", counted)
    measure = cache.measure      # the host AdamW on 1M parameters, not the full 1 GiB of state
    monkeypatch.setattr(cache, "measure", lambda: measure(host_adam_numel=2**20))
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=2, heads=2, kv_heads=1, ffn=64))
    ids = torch.randint(0, 64, (1, 8))
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    try:
        for _ in range(2):
            engine.step(input_ids=ids, labels=ids)
        engine.synchronize()
    finally:
        engine.close()
    assert len(fits) == 1
    assert list(tmp_path.glob("cpu_profile-*.json"))
    measured = get_profile("cpu")
    assert engine.plan.hardware == measured and measured.node_overhead_s != fits[0].node_overhead_s


def test_an_engine_takes_a_profile_to_plan_with_and_refuses_anything_else():
    from megacompile.engine import Engine
    from megacompile.errors import ArgumentError
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=1, heads=2, kv_heads=1, ffn=64))
    with pytest.raises(ArgumentError, match="hardware is a HardwareProfile"):
        Engine(model, 1.0, device="cpu", hardware="h100")
    engine = Engine(model, 1.0, device="cpu", hardware=get_profile("h100"))
    ids = torch.randint(0, 64, (2, 8))
    assert engine.prepare(input_ids=ids, labels=ids).hardware == get_profile("h100")
    engine.close()


def test_the_planner_never_calls_the_measuring_room():
    """make_plan takes the profile its caller resolved (the Engine, plan(), `megacompile plan`):
    the planner and the passes import nothing from megacompile.calibrate, at their top or inside."""
    import megacompile.passes
    root = COST.parent
    planner = [*sorted((root / "planner").rglob("*.py")),
               *sorted(Path(megacompile.passes.__file__).parent.rglob("*.py"))]
    offending = []
    for path in planner:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] + [a.name for a in node.names] if isinstance(node, ast.ImportFrom)
                     else [])
            offending += [f"{path.name}: {n}" for n in names if "calibrate" in n.split(".")]
    assert not offending, f"the planner imports the measuring room: {offending}"
