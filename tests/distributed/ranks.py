"""What each rank of a data-parallel test runs (spawned by torch.multiprocessing, gloo, the cpu
backend), and the single-process reference the ranks are held against."""
from __future__ import annotations

import json
import os
import signal
import traceback

import torch
import torch.distributed as dist

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 10, 4, 16, 96
CLIP = 0.05         # small enough that every step clips
# AdamW moves a weight by about lr whatever its gradient's size, so a weight whose gradient is at
# rounding-noise level (1e-8 against a typical 1e-3: a sum over tokens that cancels) moves by lr
# in a direction the summation order decides, and splitting the batch over ranks changes that
# order. An eps above that level keeps the comparison about the reduce, not that noise.
EPS = 1e-6


def model():
    from tests.models import NanoGPT
    torch.manual_seed(0)
    return NanoGPT(vocab=VOCAB, d=64, layers=2, heads=4, block=SEQ)


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g) for _ in range(steps)]


def optimizer(clip: float | None):
    from megacompile import AdamW
    from megacompile.acceptance.parity import BETAS, LR, WD
    return AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, kernel="torch", max_grad_norm=clip)


def compiled(clip: float | None, **kw):
    import megacompile
    m = model()
    return megacompile.compile(m, hbm_budget=_budget(m), device="cpu", optimizer=optimizer(clip), **kw)


def _budget(m) -> float:
    return 4 * sum(p.numel() * 4 for p in m.parameters()) / 2 ** 30


def eager(clip: float | None, steps: int = STEPS) -> tuple[list[float], dict]:
    """torch.optim.AdamW on the whole global batch: losses and final weights."""
    from megacompile.acceptance.parity import BETAS, LR, WD
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    losses = []
    for ids in batches(steps):
        opt.zero_grad(set_to_none=True)
        loss = m(idx=ids, targets=ids)[-1]
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in m.state_dict().items()}


def rank_slice(ids: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    per = ids.shape[0] // size
    return ids[rank * per:(rank + 1) * per]


def spawn(scenario: str, size: int, folder: str, **kw) -> None:
    """Run `scenario` on `size` ranks to the end of each (a failing rank does not stop the
    others: they must find out themselves); raise the first failed rank's error."""
    import torch.multiprocessing as mp
    os.environ.setdefault("MEGACOMPILE_DIST_TIMEOUT", "60")
    context = mp.start_processes(_entry, args=(scenario, size, folder, kw), nprocs=size, join=False,
                                 start_method="spawn")
    for process in context.processes:
        process.join(300)
    for rank, process in enumerate(context.processes):
        if process.exitcode != 0:
            error = os.path.join(folder, f"rank{rank}.error")
            raise RuntimeError(f"rank {rank} exited with {process.exitcode}: "
                               + (open(error).read() if os.path.exists(error) else "no error written"))


def _entry(rank: int, scenario: str, size: int, folder: str, kw: dict) -> None:
    torch.set_num_threads(1)
    os.environ["LOCAL_WORLD_SIZE"] = str(size)    # as torchrun says: the ranks share this machine's cores
    nodes = kw.pop("nodes", None)
    if nodes is not None:       # several nodes on this machine: the ranks grouped by MEGACOMPILE_NODE
        from megacompile.distributed.node import NODE_ENV
        os.environ[NODE_ENV] = f"node-{rank * nodes // size}"
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=size)
    try:
        out = _scenario(scenario)(rank, size, folder, **kw)
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(out, f)
    except BaseException:
        with open(os.path.join(folder, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def train(rank: int, size: int, folder: str, clip: float | None = None, save: str | None = None,
          resume: str | None = None, accum: int = 1) -> dict:
    """10 steps on this rank's slice of each global batch (from the checkpoint `resume` on: the
    steps after it). With `save`: a checkpoint after step 5, and this rank's masters and moments
    as they were then (state-<rank>.pt). With `resume`: whether the masters and moments this
    rank holds after the load equal, bit for bit, those the saving ranks held. With `accum`, each
    step is that many micro-batches of the rank's slice (the step's loss: their mean)."""
    engine = compiled(clip, grad_accum=accum)
    out = {"nvme_refused": _refusal(lambda: compiled(clip, nvme_dir=folder))}
    first = 0
    if resume is not None:
        first = engine.load_checkpoint(resume)["next"]
        engine.prepare(**_inputs(batches()[0], rank, size))     # builds the host state: the load lands
        saved = {}
        for f in os.listdir(os.path.dirname(resume)):
            if f.startswith("state-"):
                saved.update(torch.load(os.path.join(os.path.dirname(resume), f)))
        host = engine.host
        out["exact"] = all(torch.equal(host.view(t, n), saved[f"{t}/{n}"]) for n in host.slots if host.mine(n)
                           for t in ("master", "exp_avg", "exp_avg_sq"))
        out["held"] = sum(host.mine(n) for n in host.slots)
    losses, issued = [], []
    for i, ids in enumerate(batches()[first:], start=first):
        if i == STEPS - 1:
            _record_issues(engine, issued)
        parts = rank_slice(ids, rank, size).chunk(accum)
        losses.append(sum(engine.step(idx=part, targets=part) for part in parts) / accum)
        if save is not None and i + 1 == STEPS // 2:
            engine.save_checkpoint(save, extra={"next": i + 1}, keep_last=1)     # rotates this run's only
            host = engine.host
            torch.save({f"{t}/{n}": host.view(t, n).clone() for n in host.slots if host.mine(n)
                        for t in ("master", "exp_avg", "exp_avg_sq")},
                       os.path.join(os.path.dirname(save), f"state-{rank}.pt"))
    weights = engine.state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(folder, "weights.pt"))
    return {**out, "losses": losses, **host_figures(engine.host), "issued": issued, **_reduce_spans(engine),
            "model_read": _model_read(engine)}


def _model_read(engine) -> str | None:
    """What model.state_dict() answers on a rank after training (None: it returned)."""
    from megacompile.errors import MegacompileError
    try:
        engine.model.state_dict()
    except MegacompileError as e:
        return str(e)
    return None


def _record_issues(engine, issued: list) -> None:
    """The compute thread's order of issue from here on: each stage graph it runs and each
    collective it hands to the network stream."""
    backend = engine.backend
    reduce, span = backend.reduce, backend.compute_span
    backend.reduce = lambda tensors, issue, what: issued.append(what) or reduce(tensors, issue, what)
    backend.compute_span = lambda what, start: issued.append(what) or span(what, start)


def _reduce_spans(engine) -> dict:
    """When the last step's gradient reduces ran, against its backward."""
    from megacompile.ir.program import Op
    engine.backend.synchronize()        # the network stream's last span is recorded
    program, timeline = engine.plan.program, engine.timeline
    backward = [s for s in timeline.on("compute") if program.nodes[s.node].op is Op.BACKWARD]
    reduces = timeline.on("network")
    return {"reduce_nodes": sorted(s.node for s in reduces),
            "grad_offload_nodes": [i for i, n in enumerate(program.nodes) if n.op is Op.OFFLOAD
                                   and program.values[n.reads[0]].kind == "grads"],
            "backward_nodes": sorted(s.node for s in backward),
            "first_reduce_start": min(s.start for s in reduces), "last_backward_end": max(s.end for s in backward)}


def _refusal(make) -> str | None:
    from megacompile.errors import ArgumentError
    try:
        make()
    except ArgumentError as e:
        return str(e)
    return None


def host_figures(host) -> dict:
    """What this rank holds in host RAM, and which segment its node's compute copy is."""
    copy = host.node_copy
    return {"state_bytes": host.state_bytes, "grad_bytes": host.grad_bytes, "shared_bytes": host.shared_bytes,
            "nbytes": host.nbytes, "const_bytes": sum(t.untyped_storage().nbytes() for t in host.consts.values()),
            "local": copy.local, "segment": copy.path,
            "segment_left": os.path.exists(copy.path), "mapped": mapped_inode(copy.path)}


def mapped_inode(path: str) -> int | None:
    """The inode of this process's mapping of `path` (unlinked: the kernel keeps it while mapped)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            if path in line:
                return int(line.split()[4])
    return None


def fail(rank: int, size: int, folder: str, kill: bool = False) -> dict:
    """Rank 1 raises inside its second step (`kill`: is killed outright before it); rank 0 must
    say so, not hang. Each rank writes which segment its node's compute copy was."""
    engine = compiled(None)
    ids = batches()[0]
    engine.step(**_inputs(ids, rank, size))
    with open(os.path.join(folder, f"segment{rank}"), "w") as f:
        f.write(engine.host.node_copy.path)
    if rank == 1 and kill:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("out of paper")
        engine._last_train.executor.run = broken
    engine.step(**_inputs(ids, rank, size))
    return {}


# Per step, whether rank 0's and rank 1's micro-batch holds images. Rank 0's first program lays
# out the host state of every rank, rank 1's first has no image; after the step with none on
# either rank (which leaves the vision side as it was) only rank 1's reaches the tower.
MIXED = [(True, False), (True, True), (False, False), (False, True)]
NO_IMAGE_STEP = MIXED.index((False, False))


def mixed_micro_batches() -> list[list[dict]]:
    """Each step's micro-batches, rank 0's then rank 1's: two rows each, with an image per row or
    with none (tests/vlm.py's tiny LLaVA)."""
    from tests.e2e.test_step_without_gradient import text_only
    from tests.vlm import batch
    return [[batch(seed=10 * i + r) if image else text_only(10 * i + r) for r, image in enumerate(step)]
            for i, step in enumerate(MIXED)]


def llava_model():
    """The tiny LLaVA with a tower wider than its text model: the ranks' shares cut through the
    tower, so a rank without an image holds some of it."""
    from tests.vlm import llava
    return llava(tower_width=128)


def llava_trained(grad_accum: int = 1):
    """The tiny LLaVA, its vision tower and projector trainable, clipped every step."""
    import megacompile
    return megacompile.compile(llava_model(), hbm_budget=1.0, device="cpu", retrace=True, grad_accum=grad_accum,
                               optimizer=optimizer(CLIP))


def image_side(host, names) -> dict[str, tuple[torch.Tensor, ...]]:
    """The masters and moments of `names` (those this state holds), copied once its updates are done."""
    host.wait_updates()
    return {n: tuple(host.view(t, n).clone() for t in ("master", "exp_avg", "exp_avg_sq")) for n in names}


def mixed_images(rank: int, size: int, folder: str) -> dict:
    """The tiny LLaVA over MIXED, this rank's micro-batch of each step: its losses, the AdamW
    counts it keeps, its layout, and which vision parameters it holds that the step without images
    left bit for bit as they were."""
    from tests.e2e.test_step_without_gradient import IMAGE_SIDE
    engine = llava_trained()
    losses, unchanged, held = [], [], []
    for i, micro_batches in enumerate(mixed_micro_batches()):
        if i == NO_IMAGE_STEP:
            host = engine.host
            held = [n for n in host.slots if n.startswith(IMAGE_SIDE) and host.mine(n)]
            before = image_side(host, held)
        losses.append(engine.step(**micro_batches[rank]))
        if i == NO_IMAGE_STEP:
            after = image_side(engine.host, held)
            unchanged = [n for n in held if all(torch.equal(a, b) for a, b in zip(before[n], after[n]))]
    weights = engine.state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(folder, "weights.pt"))
    slots = engine.host.slots
    return {"losses": losses, "missed": dict(engine.state.missed_steps), "held": held, "unchanged": unchanged,
            "layout": [[n, s.owner, s.offset] for n, s in slots.items()],
            "holds": [n for n in slots if engine.host.mine(n)]}


def llama_bf16(clip: float | None = CLIP):
    """A 2-layer Llama (transformers) in bf16 compute: what the export and bf16 tests train."""
    import megacompile
    from tests.models import hf_llama
    torch.manual_seed(0)
    return megacompile.compile(hf_llama(layers=2, d=32, vocab=VOCAB), hbm_budget=1.0, device="cpu",
                               compute_dtype=torch.bfloat16, optimizer=optimizer(clip))


def bf16_export(rank: int, size: int, folder: str, steps: int = 4) -> dict:
    """`steps` bf16 steps on this rank's slice, then save_pretrained (every rank calls it) and the
    gathered masters (rank 0: weights.pt)."""
    engine = llama_bf16()
    losses = []
    for ids in batches(steps):
        mine = rank_slice(ids, rank, size)
        losses.append(engine.step(input_ids=mine, labels=mine))
    engine.save_pretrained(os.path.join(folder, "export"), max_shard_size="100KB")
    weights = engine.state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(folder, "weights.pt"))
    return {"losses": losses, **host_figures(engine.host)}


def measure(rank: int, size: int, folder: str, dtype: str = "float32") -> dict:
    """The host state of one rank, built and not trained (benchmarks/dp_host_memory.py)."""
    engine = compiled(None, compute_dtype=getattr(torch, dtype))
    engine.prepare(**_inputs(batches(1)[0], rank, size))
    return host_figures(engine.host)


def _inputs(ids: torch.Tensor, rank: int, size: int) -> dict:
    mine = rank_slice(ids, rank, size)
    return {"idx": mine, "targets": mine}


def _scenario(name: str):
    """A scenario of SCENARIOS, or "module:function" of another file's."""
    if ":" not in name:
        return SCENARIOS[name]
    import importlib
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


SCENARIOS = {"train": train, "fail": fail, "mixed_images": mixed_images, "bf16_export": bf16_export,
             "measure": measure}
