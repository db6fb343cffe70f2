"""While capturing, every Hugging Face experts module runs the static-shape forward of moe/experts.py.

Whatever `config._experts_implementation` the model selected ("eager", "grouped_mm",
"batched_mm", ...), the traced graph runs the sorted, grouped computation: the same results, with
shapes that do not depend on the routing. The model itself is left as it was.

LoRA on the experts' weights (PEFT's `target_parameters`) wraps the module in one `ParamWrapper`
per adapted weight, each the next one's `base_layer`; eagerly each adds its adapters to its weight
by a parametrization registered on the experts module for the call, which a trace cannot hold (the
module's parameters are the trace's then). While capturing, the outermost wrapper runs the static
forward itself with the adapted weights computed as PEFT computes them (`adapted_weights`).

The load-balancing loss of some transformers releases (5.17's Mixtral, Qwen2-MoE, GPT-OSS) counts
each expert's tokens with `torch.bincount(ids, minlength=E)`, whose length, max(ids) + 1 at least,
depends on the values; while capturing, a count with a `minlength` has that length (expert ids
are below E), computed as a scatter-add of ones, which fails on an id at or past it rather than
giving a longer count.
"""
from __future__ import annotations

import contextlib
import types

import torch
import torch.nn as nn

from ..errors import CaptureError
from ..moe.experts import is_hf_experts, static_experts_forward


def hf_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules() if is_hf_experts(m)]


_WRAPPED = ".base_layer"


def adapter_wrappers(model: nn.Module, path: str) -> list[nn.Module]:
    """PEFT's ParamWrappers around the experts module at `path`, outermost first (none without LoRA)."""
    wrappers = []
    while path.endswith(_WRAPPED):
        path = path[:-len(_WRAPPED)]
        wrapper = model.get_submodule(path)
        if not (hasattr(wrapper, "parameter_name") and hasattr(wrapper, "get_delta_factors")):
            break
        wrappers.insert(0, wrapper)
    return wrappers


def adapted_weights(experts: nn.Module, wrappers: list[nn.Module], path: str) -> dict[str, torch.Tensor]:
    """The experts' weights with the wrappers' active adapters added, as PEFT's ParamWrapper adds them
    (_activate_lora): with one adapter, W + s lhs rhs in one baddbmm over the experts' stack; with
    more, W plus the sum of each adapter's delta."""
    weights = {}
    for wrapper in wrappers:
        if wrapper.merged:
            raise CaptureError(f"'{path}': the LoRA adapters on the experts' {wrapper.parameter_name} are merged "
                               "into it, and adapters train unmerged: call unmerge_adapter() before compiling")
        active = [] if wrapper.disable_adapters else [a for a in wrapper.active_adapters if a in wrapper.lora_A]
        if not active:
            continue
        base = getattr(experts, wrapper.parameter_name)     # [E, out, in], or [E, in, out] transposed
        if len(active) == 1 and wrapper.num_experts > 1:
            lhs, rhs, scaling = wrapper.get_delta_factors(active[0])
            weights[wrapper.parameter_name] = torch.baddbmm(base, lhs, rhs, alpha=scaling)
        else:
            weights[wrapper.parameter_name] = base + sum(wrapper.get_delta_weight(a) for a in active)
    return weights


def routed_fractions(model: nn.Module, routed: dict[str, int]) -> dict[str, float]:
    """For each parameter of a routed experts module: the share of it one token uses (top_k / E).
    `routed`: top_k per experts module path, as the trace saw it."""
    fractions = {}
    for path, module in hf_experts(model):
        if path in routed:
            for name, _ in module.named_parameters():
                fractions[f"{path}.{name}"] = routed[path] / module.num_experts
    return fractions


def spread_over_templates(fractions: dict[str, float], stages: list) -> dict[str, float]:
    """The fractions of every block that shares a template with a block the trace ran.

    Planning traces only a few blocks of each group built alike (top.blocks_grouped_once; a later
    micro-batch size, only the first), so only their experts report a top_k. Stages on one
    template compute the same graph: the parameter in the same slot of another such stage is used
    in the same share."""
    spread = dict(fractions)
    by_template: dict[int, list] = {}
    for stage in stages:
        by_template.setdefault(id(stage.template), []).append(stage)
    for group in by_template.values():
        for slot in range(len(group[0].params)):
            known = next((fractions[s.params[slot]] for s in group if s.params[slot] in fractions), None)
            if known is not None:
                for s in group:
                    spread.setdefault(s.params[slot], known)
    return spread


_bincount = torch.bincount


def _static_bincount(input: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    if weights is not None or minlength <= 0 or input.dim() != 1:
        return _bincount(input, weights=weights, minlength=minlength)
    ones = torch.ones_like(input, dtype=torch.int64)
    return torch.zeros(minlength, dtype=torch.int64, device=input.device).scatter_add(0, input.long(), ones)


@contextlib.contextmanager
def static_bincount():
    """While tracing: torch.bincount with a minlength has that length (the module's docstring)."""
    torch.bincount = _static_bincount
    try:
        yield
    finally:
        torch.bincount = _bincount


@contextlib.contextmanager
def static_experts(model: nn.Module):
    """Yields {experts module path: top_k}, filled as the trace runs each experts module; while it
    holds, torch.bincount with a minlength is static too (static_bincount)."""
    patched = []
    routed: dict[str, int] = {}
    paths: dict[int, str] = {}

    wrapped: dict[int, tuple[nn.Module, list[nn.Module]]] = {}

    # One function for every experts module, and one for every module of adapters around one, so
    # blocks built alike still look alike to planning's grouping (alike.py compares a bound forward
    # by its function).
    def forward(self, hidden_states, top_k_index, top_k_weights):
        routed[paths[id(self)]] = top_k_index.size(-1)
        return static_experts_forward(self, hidden_states, top_k_index, top_k_weights)

    def adapted_forward(self, hidden_states, top_k_index, top_k_weights):
        experts, wrappers = wrapped[id(self)]
        routed[paths[id(experts)]] = top_k_index.size(-1)
        weights = adapted_weights(experts, wrappers, paths[id(experts)])
        return static_experts_forward(experts, hidden_states, top_k_index, top_k_weights, weights)
    try:
        for path, module in hf_experts(model):
            if getattr(module, "_is_expert_parallel", False):
                raise CaptureError(f"'{path}' ({type(module).__name__}) is sharded for expert parallelism; "
                                   "megacompile trains every expert of a layer on one device: load the model "
                                   "without an expert-parallel plan")
            paths[id(module)] = path
            module.forward = types.MethodType(forward, module)
            patched.append(module)
            wrappers = adapter_wrappers(model, path)
            if wrappers:
                wrapped[id(wrappers[0])] = (module, wrappers)
                wrappers[0].forward = types.MethodType(adapted_forward, wrappers[0])
                patched.append(wrappers[0])
        with static_bincount():
            yield routed
    finally:
        for module in patched:
            del module.forward   # back to the class's forward
