"""Data parallelism: every rank runs the same plan on its own micro-batch; the engine calls in here
at three points of a step (runtime/host.py's HostState is replaced by ShardedHostState, which
does the reduce and the sharded update).

Loss semantics: each rank's loss is its own (a mean over its micro-batch, for the usual losses);
the gradient the optimizer sees is the mean of the ranks' gradients. That equals one process on
the whole global batch when the loss is a mean over examples or tokens and every rank's
micro-batch holds the same number of them (equal batch shapes, no padding masked out unevenly).
"""
from __future__ import annotations

import math
import os

import torch

from . import timeouts
from .group import Ranks
from .node import nodes_of
from .shard import ShardedHostState


class DataParallel:
    def __init__(self, ranks: Ranks):
        self.ranks = ranks
        nodes = nodes_of(ranks)
        self.per_node = max(len(n) for n in nodes)    # ranks per node (node.py refuses unequal nodes)
        self._paced: dict[int, object] = {}     # id(plan) -> the collectives' wait in its steps

    @property
    def rank(self) -> int:
        return self.ranks.rank

    @property
    def size(self) -> int:
        return self.ranks.size

    def default_device(self) -> str | None:
        """On a machine with GPUs each rank takes its own: LOCAL_RANK (torchrun sets it)."""
        if torch.cuda.is_available():
            return f"cuda:{int(os.environ.get('LOCAL_RANK', self.rank % torch.cuda.device_count()))}"
        return None

    @property
    def shape(self) -> tuple[int, int]:
        """(ranks, ranks per node): what the host memory check needs (cost/host_shards.py)."""
        return self.size, self.per_node

    def host_state(self, *args, **kwargs) -> ShardedHostState:
        return ShardedHostState(*args, ranks=self.ranks, **kwargs)

    def agree(self, host: ShardedHostState, loss: float, last: bool) -> tuple[str, str] | None:
        """After every micro-batch, on every rank: (what, why) when the step must be skipped
        everywhere (a rank's loss is inf or NaN); else the gradients only some ranks' programs
        reached are summed over the host (the others were summed as the backward produced them:
        reach.py), and, at a step's last micro-batch, the gradients' norms over the ranks
        (host.nonfinite_grads() then speaks for all ranks)."""
        bad = torch.zeros(self.size, dtype=torch.float64)
        bad[self.rank] = 0.0 if math.isfinite(loss) else 1.0
        self.ranks.sum_(bad, "agreeing on the step's losses")
        if bad.any():
            which = [r for r in range(self.size) if bad[r]]
            return "loss", f"the loss is inf or NaN on rank{'s' * (len(which) > 1)} {', '.join(map(str, which))}"
        host.sum_deferred()
        if last:
            host.sum_grad_norms()
        return None

    def before_step(self, plan) -> None:
        """The collectives' wait for a step of `plan`: the long one until the plan has run a step
        here (the ranks may have planned and traced it at different speeds), then its own
        (timeouts.py)."""
        self.ranks.pace(self._paced.get(id(plan), timeouts.long()))

    def step_done(self, plan, seconds: float | None) -> None:
        """After a step of `plan` that took `seconds`: the wait for its next steps."""
        predicted = plan.prediction.step_s if plan.prediction is not None else None
        self._paced[id(plan)] = timeouts.for_steps(predicted, seconds)
        self.ranks.pace(self._paced[id(plan)])

    def on_rank_zero(self, host, write) -> None:
        """write() on rank 0 with every master readable there (gathered, with bf16 compute); every
        rank returns when it is done, or raises its error."""
        with self.ranks.patient():
            self._on_rank_zero(host, write)

    def _on_rank_zero(self, host, write) -> None:
        host.wait_updates()
        host.gather_masters()
        error = None
        try:
            if self.rank == 0:
                write()
        except Exception as e:  # noqa: BLE001 - every rank must hear of it
            error = e
        finally:
            host.gathered.clear()
        error = self.ranks.gather_objects(error, "exporting the weights")[0]
        if error is not None:
            raise error

    def failed(self, e: BaseException) -> None:
        self.ranks.note_failure(e)


def data_parallel_for(process_group) -> DataParallel | None:
    from .group import ranks_for
    ranks = ranks_for(process_group)
    return None if ranks is None else DataParallel(ranks)

