"""pissa_init (LlamaFactory's pissa_init and pissa_iter; PEFT's init_lora_weights "pissa" and
"pissa_niter_N"): LoRA whose adapters start as each adapted weight's principal part, the base
keeping the rest.

For a weight W (out, in) and rank r, with W = U S V^T, the adapters start as

    B0 = U_r sqrt(S_r / s),   A0 = sqrt(S_r / s) V_r^T,     s the adapters' scaling (lora_alpha / r)

so s B0 A0 is W's best rank-r part, and the base the run trains beside them is the residual
W - s B0 A0: the model starts as the folder's model, to rounding. U_r, S_r, V_r come from the full
SVD (pissa_iter -1) or from torch's randomised low-rank SVD with pissa_iter subspace iterations
(LlamaFactory's default 16), its draws seeded by the run's seed and the weight's name. Both in
float32 from the weight as the files hold it, as PEFT computes them.

The base is never loaded whole: the adapters are made from each weight read from its file in turn
(initialise), and the residual is made as each weight streams into the host state (Residual.route,
the load's in-memory source, as io/grown_vocab.py's), held in the base's dtype. The initial
adapters are kept in the run folder (INITIAL) before the first step and read from there after, so a
resumed run streams the same residual, the export can write an adapter for the folder's own weights
(converted), and the process holds no copy of them beside the plan's host state.
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from ...errors import ArgumentError
from ...io.source import made_as_read

INITIAL = "pissa_init.safetensors"      # the initial adapters, A0 and B0 by file key, in the run folder
_MARK = "<pissa>"                       # an item's source: its file, read through Residual.memory


class Residual:
    """The initial adapters of a PiSSA run, and the residual base they leave. They are held in memory
    until the run folder keeps them (kept), then read from there a weight at a time: the process
    holds the plan's host state, not a second copy of the adapters beside it."""

    def __init__(self, initial: dict[str, tuple[torch.Tensor, torch.Tensor]] | None, scaling: float,
                 transposed: frozenset[str] = frozenset(), keys: frozenset[str] | None = None,
                 path: str | None = None):
        self.initial = initial          # file key of W -> (A0 (r, in), B0 (out, r)); None: read from `path`
        self.keys = frozenset(initial) if keys is None else keys
        self.scaling, self.transposed, self.path = scaling, transposed, path   # transposed: GPT-2's Conv1D

    def pair(self, key: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A0, B0) of the weight `key`."""
        if self.initial is not None:
            return self.initial[key]
        from safetensors import safe_open
        with safe_open(self.path, framework="pt", backend="pread") as f:
            return f.get_tensor(f"{key}.lora_A"), f.get_tensor(f"{key}.lora_B")

    def kept(self, path: str) -> None:
        """The initial adapters are in the file `path` now: read from there, dropped from memory."""
        self.initial, self.path = None, path

    def residual(self, key: str, weight: torch.Tensor) -> torch.Tensor:
        """The file's weight `key` less its initial adapters' product, float32."""
        a0, b0 = self.pair(key)
        w = weight.float()
        w = w.T if key in self.transposed else w
        out = w - self.scaling * b0 @ a0
        return out.T.contiguous() if key in self.transposed else out

    def route(self, items: list) -> tuple[list, dict]:
        """The load's items with the adapted weights read through `memory` (io/source.py's
        PendingLoad.memory), each as the residual: (items, memory)."""
        return made_as_read(items, self.keys, _MARK, lambda f, key: self.residual(key, f.get_tensor(key)))

    def save(self, path: str) -> None:
        from safetensors.torch import save_file
        tensors = {f"{k}.lora_A": a for k, (a, _) in self.initial.items()}
        tensors |= {f"{k}.lora_B": b for k, (_, b) in self.initial.items()}
        save_file({k: t.contiguous() for k, t in tensors.items()}, path,
                  metadata={"scaling": repr(self.scaling), "transposed": ",".join(sorted(self.transposed))})


def principal(weight: torch.Tensor, rank: int, scaling: float, niter: int, seed: int) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """(A0, B0) of `weight` (out, in) at `rank` (module docstring); niter -1: the full SVD."""
    w = weight.float()
    if niter < 0:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        u, s, vh = u[:, :rank], s[:rank], vh[:rank]
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            u, s, v = torch.svd_lowrank(w, rank, niter=niter)
        vh = v.T
    root = torch.sqrt(s / scaling)
    return root[:, None] * vh, u * root[None, :]


def _seed(seed: int, key: str) -> int:
    import hashlib
    return int.from_bytes(hashlib.sha256(f"{seed}:pissa:{key}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


def initialise(wrapped: nn.Module, c) -> Residual:
    """The adapters of `wrapped` (PEFT's LoRA model, its base uninitialised) set to PiSSA's initial
    ones, read from the run folder where a resumed run kept them (c.pissa_kept), else made from the
    model folder's weights one at a time; the Residual the base streams as."""
    from .lora import file_key, scaling, transposed
    s = scaling(wrapped.peft_config["default"])
    layers = _adapted(wrapped)
    flipped = frozenset(file_key(f"{n}.base_layer.weight") for n in transposed(wrapped)) & set(layers)
    if c.pissa_kept is not None:
        initial = _read(c.pissa_kept, layers)
    else:
        initial = _made(layers, c.model, c.lora_rank, s, c.pissa_iter, c.seed, flipped)
    for key, module in layers.items():
        a0, b0 = initial[key]
        with torch.no_grad():
            module.lora_A["default"].weight.copy_(a0)
            module.lora_B["default"].weight.copy_(b0)
    if c.pissa_kept is not None:        # a resumed run's: read from the run folder as the base streams
        return Residual(None, s, flipped, frozenset(initial), c.pissa_kept)
    return Residual(initial, s, flipped)


def _made(layers: dict, folder: str, rank: int, s: float, niter: int, seed: int,
          flipped: frozenset[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import safe_open
    from ...io.hf_load import shard_map
    wanted, out = set(layers), {}
    for path, keys in shard_map(folder).items():
        with safe_open(path, framework="pt", backend="pread") as f:
            for key in (keys if keys is not None else f.keys()):
                if key in wanted:
                    w = f.get_tensor(key)
                    out[key] = principal(w.T if key in flipped else w, rank, s, niter, _seed(seed, key))
    missing = wanted - set(out)
    if missing:
        raise ArgumentError(f"pissa_init: {folder} holds no {sorted(missing)[0]}, whose principal part the adapter "
                            "starts as")
    return out


def _read(path: str, layers: dict) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise ArgumentError(f"resume: {path} is missing: a PiSSA run's base is its weights less the initial adapters "
                            "kept there, which cannot be made again exactly; start a new run_dir")
    kept = load_file(path)
    out = {}
    for key, module in layers.items():
        a0, b0 = kept.get(f"{key}.lora_A"), kept.get(f"{key}.lora_B")
        if a0 is None or b0 is None or a0.shape != module.lora_A["default"].weight.shape \
                or b0.shape != module.lora_B["default"].weight.shape:
            raise ArgumentError(f"resume: {path} does not hold the initial adapters of {key} at this run's rank; "
                                "it belongs to another run: start a new run_dir")
        out[key] = (a0, b0)
    return out


def converted(adapters: dict[str, torch.Tensor], residual: Residual, key_of) -> dict[str, torch.Tensor]:
    """The trained adapters `adapters` (PEFT's state_dict names) as a LoRA of twice the rank on the
    folder's own weights: W_res + s B A = W + s [B, -B0] [A; A0], as PEFT's and LlamaFactory's
    pissa_convert write it (lora_alpha doubled with the rank keeps s). `key_of`: a lora_A or lora_B
    name -> the file key of the weight it adapts."""
    out = {}
    for name, t in adapters.items():
        if ".lora_A." in name:
            out[name] = torch.cat([t, residual.pair(key_of(name))[0].to(t.dtype)], dim=0)
        elif ".lora_B." in name:
            out[name] = torch.cat([t, -residual.pair(key_of(name))[1].to(t.dtype)], dim=1)
        else:
            out[name] = t
    return out


def _adapted(wrapped: nn.Module) -> dict[str, nn.Module]:
    """The LoRA layers of `wrapped` by the file key of the weight each adapts."""
    from .lora import file_key
    return {file_key(f"{n}.base_layer.weight"): m for n, m in wrapped.named_modules()
            if hasattr(m, "lora_A") and "default" in m.lora_A}


def check_start(c, meta: nn.Module, run_dir: str, resumed: bool, imported: str | None) -> None:
    """Where a PiSSA run's initial adapters come from (c.pissa_kept), checked before anything of the
    run is written: a resumed run's from its run folder, a new run's made from the weights of
    `meta` (the run's LoRA model on the meta device)."""
    if not c.pissa_init:
        return
    grows = sorted(set(_adapted(meta)) & (c.grown.keys if c.grown is not None else set()))
    if grows:
        raise ArgumentError(f"pissa_init: {grows[0]} takes an adapter and grows by the tokens the run adds, so its "
                            "principal part would be the file's smaller weight's: leave it out of lora_target, or add "
                            "the tokens without pissa_init")
    if imported is not None:
        raise ArgumentError(f"pissa_init: {imported} is a Trainer's checkpoint, whose adapters were trained over the "
                            "residual its own PiSSA start left, which it does not hold; start a new run without "
                            "resume, or without pissa_init")
    path = os.path.join(run_dir, INITIAL)
    if resumed and not os.path.isfile(path):
        raise ArgumentError(f"resume: {path} is missing: a PiSSA run's base is its weights less the initial adapters "
                            "kept there, which cannot be made again exactly; start a new run_dir")
    c.pissa_kept = path if resumed else None


def keep(c, run_dir: str) -> None:
    """A new PiSSA run's initial adapters, written to its run folder (once, durably) before its first
    step: a resume and the export read them."""
    if c.pissa is None or c.pissa_kept is not None:
        return
    from ...io.durable import fsync_dir, fsync_file
    path = os.path.join(run_dir, INITIAL)
    partial = path + ".partial"
    c.pissa.save(partial)
    fsync_file(partial)
    os.replace(partial, path)
    fsync_dir(run_dir)
    c.pissa_kept = path
    c.pissa.kept(path)


def check(c, lora: bool) -> None:
    """pissa_init and its keys, refused where the run cannot take them (before anything is opened);
    `lora`: the run trains LoRA adapters."""
    from ..config_values import flag
    c.pissa_init = flag("pissa_init", c.pissa_init)
    c.pissa_convert = flag("pissa_convert", c.pissa_convert)
    if isinstance(c.pissa_iter, bool) or not isinstance(c.pissa_iter, int) or c.pissa_iter < -1:
        raise ArgumentError(f"pissa_iter is the randomised SVD's subspace iterations (>= 0), or -1 for the full SVD; "
                            f"got {c.pissa_iter!r}")
    if not c.pissa_init:
        return
    why = ("finetuning_type is not lora" if not lora
           else f"stage {c.stage}'s reference is the base with the adapters off, which under PiSSA is the residual, "
                "not the model" if c.stage not in ("sft", "pt")
           else "use_dora's magnitudes start from the weight's norms, not the residual's" if c.use_dora
           else "use_rslora's scaling does not survive the conversion to a LoRA of twice the rank" if c.use_rslora
           else "an adapter_name_or_path start trains that adapter, not PiSSA's" if c.adapter is not None
           else None)
    if why:
        raise ArgumentError(f"pissa_init: {why}; leave pissa_init out" + ("" if lora else
                                                                           " or set finetuning_type: lora"))
