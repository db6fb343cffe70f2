"""DeepSpeed ZeRO's partitions read back as whole tensors: each parameter's fp32 master and AdamW
moments, by the name DeepSpeed saved it under.

    save_dir/ (or a Trainer's checkpoint-N)
        latest                                      the tag of the last save: global_stepN
        global_stepN/
            mp_rank_00_model_states.pt              ZeRO 1/2: param_shapes, global_steps, ...
            zero_pp_rank_R_mp_rank_00_model_states.pt    ZeRO 3: the same, one per rank
            [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   rank R's share of the masters and moments

param_shapes lists the trained parameters, group by group, in the order they were flattened.
ZeRO 1/2 flatten a param group into one buffer, a parameter after another (each followed by its
param_alignment_paddings entry, where the file has them), split over the ranks: the ranks' shares
(single_partition_of_fp32_groups) back to back are that buffer, the padding DeepSpeed aligns it
with cut from the last rank's share as it saves. ZeRO 3 splits every parameter itself: rank R holds elements
[R x ceil(n / ranks), ...) of each one, the shares of a sub-group's parameters back to back
(fp32_flat_groups; param_shapes then has one entry per sub-group). The moments
(exp_avg, exp_avg_sq) lie as the masters do, one torch AdamW state per flat group.

The files pickle a few DeepSpeed objects (the ZeRO stage enum, the loss scaler); they are read
with torch's weights_only loader, each such object stood in for by an inert _Opaque: DeepSpeed need
not be installed, and nothing in the files runs. Flats are memory-mapped: a tensor is gathered from
the ranks' files when asked for, and the pages it read are given back (pages.py), so a model's
partitions are never held whole beside the host state.
"""
from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass

import torch

from ..errors import WeightsFileError
from . import pages



def tag_folder(path: str) -> str | None:
    """The global_stepN folder of the checkpoint `path` (the tag `latest` names, else the one
    global_step* folder; `path` itself when it is one), or None when `path` holds no ZeRO files."""
    if glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            folder = os.path.join(path, f.read().strip())
        return folder if os.path.isdir(folder) else None
    found = [d for d in glob.glob(os.path.join(path, "global_step*")) if os.path.isdir(d)]
    return found[0] if len(found) == 1 else None


def holds(path: str) -> bool:
    """Whether `path` is a DeepSpeed checkpoint with ZeRO partitions (module docstring)."""
    folder = tag_folder(path) if os.path.isdir(path) else None
    return folder is not None and bool(glob.glob(os.path.join(folder, "*zero_pp_rank_*_optim_states.pt")))


class _Opaque:
    """A DeepSpeed object of a checkpoint file: what it was built from, nothing of it run."""
    def __init__(self, *args, **kwargs):
        self.args, self.kwargs, self.state = args, kwargs, None

    def __setstate__(self, state):
        self.state = state


_UNSUPPORTED = re.compile(r"GLOBAL (\S+) was not an allowed global")


def load(path: str) -> dict:
    """torch.load(weights_only, memory-mapped) of a DeepSpeed file, its deepspeed.* objects opaque."""
    stand_ins: list[tuple] = []
    while True:
        try:
            with torch.serialization.safe_globals(stand_ins):
                saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            break
        except Exception as e:  # noqa: BLE001 - any unreadable file: name it
            found = _UNSUPPORTED.search(str(e))
            if found and found.group(1).startswith("deepspeed.") and len(stand_ins) < 32:
                stand_ins.append((_Opaque, found.group(1)))
                continue
            raise WeightsFileError(f"cannot read {path} as a DeepSpeed checkpoint file: {str(e)[:300]}") from e
    if not isinstance(saved, dict):
        raise WeightsFileError(f"{path} holds {type(saved).__name__}, not a DeepSpeed checkpoint's dict")
    return saved


@dataclass
class Slot:
    """Where one parameter lies: its flat group, its offset in the gathered flat (ZeRO 1/2) or in
    each rank's share (ZeRO 3), and its shape."""
    flat: int
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class Partitions:
    """The ranks' optimizer files of one save, read as whole tensors per parameter (tensor())."""

    def __init__(self, path: str):
        self.path = path
        self.describe = f"the DeepSpeed checkpoint {path}"
        folder = tag_folder(path)
        if folder is None:
            raise WeightsFileError(f"{path} holds no DeepSpeed ZeRO checkpoint (no global_step*/ of "
                                   "*zero_pp_rank_*_optim_states.pt files, nor a `latest` naming one)")
        self.folder = folder
        _refuse_model_parallel(folder)
        model_states = sorted(glob.glob(os.path.join(folder, "*model_states.pt")))
        if not model_states:
            raise WeightsFileError(f"{folder} holds no *model_states.pt: the save did not finish, or its files were "
                                   "not all copied")
        self.model_states = load(model_states[0])
        self.ranks = self._rank_files()
        optim = [load(f).get("optimizer_state_dict") for f in self.ranks]
        if any(not isinstance(o, dict) for o in optim):
            raise WeightsFileError(f"{folder}: an optim_states file holds no optimizer_state_dict")
        self.stage = 3 if "fp32_flat_groups" in optim[0] else 1      # the layout: stages 1 and 2 share one
        written = getattr(optim[0].get("zero_stage"), "args", ())     # DeepSpeed's ZeroStageEnum(n)
        self.named = f"ZeRO stage {written[0] if len(written) == 1 and isinstance(written[0], int) else self.stage}"
        key = "fp32_flat_groups" if self.stage == 3 else "single_partition_of_fp32_groups"
        inner = "optimizer_state_dict" if self.stage == 3 else "base_optimizer_state"
        try:
            self.flats = [list(o[key]) for o in optim]
            self.states = [o[inner]["state"] for o in optim]
            self.param_groups = optim[0][inner]["param_groups"]
        except (KeyError, TypeError) as e:
            raise WeightsFileError(f"{folder}: its optim_states files lack {e} of {self.named}'s "
                                   "layout; nothing was loaded") from e
        kinds = [set(entry) for st in self.states for entry in st.values()]
        if any(not {"exp_avg", "exp_avg_sq"} <= k or k - {"step", "exp_avg", "exp_avg_sq"} for k in kinds):
            held = sorted(set().union(*kinds))
            raise WeightsFileError(f"{folder}: its optimizer state is not AdamW's (it holds {', '.join(held[:5])}, not "
                                   "exp_avg and exp_avg_sq): megacompile's AdamW cannot go on from it; nothing was "
                                   "loaded")
        if any(g.get("amsgrad") for g in self.param_groups):
            raise WeightsFileError(f"{folder} was written by AdamW with amsgrad=True, which megacompile's AdamW does not "
                                   "run; nothing was loaded")
        self.paddings = optim[0].get("param_alignment_paddings")
        self.slots = self._slots()

    def _rank_files(self) -> list[str]:
        found = {}
        for f in glob.glob(os.path.join(self.folder, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")):
            found[int(re.search(r"zero_pp_rank_(\d+)_", os.path.basename(f)).group(1))] = f
        world = self.model_states.get("dp_world_size", len(found))
        if sorted(found) != list(range(world)):
            raise WeightsFileError(f"{self.folder} holds the optimizer files of ranks {sorted(found)}, the save was "
                                   f"made by {world} ranks: a rank's file is missing; nothing was loaded")
        return [found[r] for r in range(world)]

    def _slots(self) -> dict[str, Slot]:
        shapes = self.model_states.get("param_shapes")
        if not isinstance(shapes, list) or len(shapes) != len(self.flats[0]):
            raise WeightsFileError(f"{self.folder}: param_shapes has {len(shapes or ())} groups, the optimizer files "
                                   f"{len(self.flats[0])} flat groups; nothing was loaded")
        world, slots = len(self.ranks), {}
        for flat, group in enumerate(shapes):
            offset = 0
            pads = self.paddings[flat] if self.paddings else [0] * len(group)
            for (name, shape), pad in zip(group.items(), pads):
                slots[name] = Slot(flat, offset, tuple(shape))
                offset += -(-slots[name].numel // world) if self.stage == 3 else slots[name].numel + pad
            held = [f[flat].numel() for f in self.flats]
            fits = all(h == offset for h in held) if self.stage == 3 else offset <= sum(held)
            if not fits:
                raise WeightsFileError(f"{self.folder}: flat group {flat} holds {held} elements on its ranks, its "
                                       f"parameters need {offset} ({self.named}); nothing was loaded")
        return slots

    # -- what io/sharded_checkpoint.py reads of a source ---------------------------------------
    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The trained parameters, by the name DeepSpeed saved them under."""
        return {name: slot.shape for name, slot in self.slots.items()}

    @property
    def frozen(self) -> dict[str, tuple[int, ...]] | None:
        """The parameters the run froze, where the save records them (ZeRO 2 and 3 do)."""
        recorded = self.model_states.get("frozen_param_shapes")
        return None if recorded is None else {n: tuple(shape) for n, shape in recorded.items()}

    @property
    def global_steps(self) -> int | None:
        return self.model_states.get("global_steps")

    @property
    def first_group(self) -> dict:
        return self.param_groups[0]

    def step(self, name: str) -> int | None:
        """The AdamW steps the parameter took; None when its flat group holds no state (never stepped)."""
        entry = self.states[0].get(self.slots[name].flat)
        return None if not entry else int(entry["step"])

    def weight_decay(self, name: str) -> float:
        """The weight decay of the param group the parameter was trained in."""
        return self._group(name)["weight_decay"]

    def lr(self, name: str) -> float | None:
        """The learning rate of that group when it saved."""
        return self._group(name).get("lr")

    def _group(self, name: str) -> dict:
        flat = self.slots[name].flat
        if self.stage != 3:
            return self.param_groups[flat]
        return next(g for g in self.param_groups if flat in g["params"])

    def tensor(self, table: str, name: str) -> torch.Tensor:
        """The whole fp32 `table` (TABLES) of the parameter `name`, gathered from the ranks; a
        tensor of the process's own (the files' pages it read are given back)."""
        slot = self.slots[name]
        if table == "master":
            sources = [f[slot.flat] for f in self.flats]
        else:
            sources = [s[slot.flat][table] for s in self.states]
        if self.stage == 3:
            share = -(-slot.numel // len(sources))
            pieces = [s.narrow(0, slot.offset, share) for s in sources]
        else:   # the ranks' shares back to back are the group's flat
            starts = [0]
            for s in sources:
                starts.append(starts[-1] + s.numel())
            begin, end = slot.offset, slot.offset + slot.numel
            pieces = [s.narrow(0, max(begin - lo, 0), min(end, hi) - max(begin, lo))
                      for s, lo, hi in zip(sources, starts, starts[1:]) if lo < end and begin < hi]
        return _gathered(pieces, slot.numel).view(slot.shape)


CHUNK = 4 << 20      # elements copied out of the mapping before their pages are given back


def _gathered(pieces: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The first `numel` elements of the mapped `pieces` back to back, in float32: copied into one
    new tensor a chunk at a time, each chunk's file pages given back once copied, so the resident
    set grows by the tensor and a chunk, not by the file's pages under it too."""
    out = torch.empty(numel, dtype=torch.float32)
    done = 0
    for piece in pieces:
        for start in range(0, min(piece.numel(), numel - done), CHUNK):
            part = piece.narrow(0, start, min(CHUNK, piece.numel() - start, numel - done - start))
            out.narrow(0, done + start, part.numel()).copy_(part)
            pages.drop_view(part)
        done += min(piece.numel(), numel - done)
    return out


def _refuse_model_parallel(folder: str) -> None:
    """A save split by tensor, pipeline or expert parallelism as well: its shards are not whole
    parameters, or not all of them (an MoE's experts are saved apart)."""
    other = [f for f in os.listdir(folder)
             if re.search(r"mp_rank_0*[1-9]\d*_", f) or f.startswith(("layer_", "expp_rank_"))]
    if other:
        raise WeightsFileError(f"{folder} was saved with tensor, pipeline or expert parallelism ({sorted(other)[0]}): its "
                               "files hold slices of parameters, which are not taken in; gather it into one "
                               "model first (DeepSpeed's universal checkpoint, ds_to_universal.py), then start from "
                               "its weights; nothing was loaded")
