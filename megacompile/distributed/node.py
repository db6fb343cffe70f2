"""One compute copy per node: the ranks of a machine share the host copy of the weights their
devices fetch (bf16 or fp32), instead of one copy per rank (8 x 200 GB for a 100B model on an
8-GPU node).

The copy is one segment of shared memory per node: the node's first rank creates a file in
/dev/shm and reserves its pages (posix_fallocate: a full tmpfs fails here, with a clear error,
not with a SIGBUS at the first write), every rank of the node maps it (torch.from_file, shared),
and once all have mapped it the first rank unlinks the file. The memory lives while a rank maps
it and is returned by the kernel when the last one exits, however it exits: a crashed rank
leaves no file behind. On a GPU machine each rank page-locks its own mapping (cudaHostRegister).

After an update each rank writes its range of an owner into its node's copy; across nodes the
ranges travel over gloo, from each rank to the rank of the same local index on every other node
(which writes them into its own node's copy); then the node's ranks meet at a barrier, so no rank
prefetches an owner before every range of it is in place.

Which ranks share a machine: their host names, gathered (MEGACOMPILE_NODE, when set, names the
node instead: tests run several nodes on one machine).
"""
from __future__ import annotations

import os
import socket
import tempfile
import uuid
import warnings

import torch
import torch.distributed as dist

from ..errors import ArgumentError, HostMemoryError
from .group import Ranks

NODE_ENV = "MEGACOMPILE_NODE"
PREFIX = "megacompile-copy-"
ALIGN = 4096          # each owner's copy starts on its own page


def node_name() -> str:
    return os.environ.get(NODE_ENV) or socket.gethostname()


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def group_by_node(names: list[str]) -> list[list[int]]:
    """The ranks of each node, nodes in the order of their first rank, ranks ascending."""
    nodes: dict[str, list[int]] = {}
    for rank, name in enumerate(names):
        nodes.setdefault(name, []).append(rank)
    return list(nodes.values())


def nodes_of(ranks: Ranks) -> list[list[int]]:
    """The ranks of each node (a collective the first time; kept on `ranks`)."""
    nodes = getattr(ranks, "nodes", None)
    if nodes is None:
        nodes = ranks.nodes = group_by_node(ranks.gather_objects(node_name(), "finding the ranks of each node"))
    return nodes


class NodeCopy:
    """The node's shared compute copy: `view(owner)` is an owner's flat buffer in it."""

    def __init__(self, ranks: Ranks, numels: dict[int, int], dtype: torch.dtype, pin: bool):
        self.ranks = ranks
        self.nodes = nodes_of(ranks)
        sizes = {len(n) for n in self.nodes}
        if len(sizes) > 1:
            raise ArgumentError(f"data parallelism needs as many ranks on every node; the ranks' nodes hold "
                                f"{[len(n) for n in self.nodes]} ranks: start the same number of processes per node")
        self.node = next(i for i, n in enumerate(self.nodes) if ranks.rank in n)
        self.local = self.nodes[self.node]
        self.local_rank = self.local.index(ranks.rank)
        # byte offset of each owner's copy in the segment
        self.offsets, total = {}, 0
        for owner, numel in numels.items():
            self.offsets[owner] = total
            total += -(-numel * dtype.itemsize // ALIGN) * ALIGN
        self.numels, self.dtype, self.nbytes = dict(numels), dtype, max(total, ALIGN)
        self.path, self.segment = self._map()
        self.pinned = bool(pin) and self._pin()
        # Groups are made collectively (every rank makes every group, in the same order): one per
        # node for its barrier, one per local index across the nodes for the exchange.
        members = ranks.members
        node_groups = [dist.new_group([members[r] for r in n], backend="gloo", timeout=ranks.timeout)
                       for n in self.nodes] if len(self.local) > 1 else []
        self.barrier_group = node_groups[self.node] if node_groups else None
        across = [dist.new_group([members[n[i]] for n in self.nodes], backend="gloo", timeout=ranks.timeout)
                  for i in range(len(self.local))] if len(self.nodes) > 1 else []
        self.across = across[self.local_rank] if across else None
        ranks.groups += node_groups + across

    def _map(self) -> tuple[str, torch.Tensor]:
        """Create (first rank of the node), map (every rank), unlink (first rank, once all have)."""
        lead = self.ranks.rank == self.local[0]
        path = error = None
        if lead:
            path = os.path.join(shm_dir(), f"{PREFIX}{uuid.uuid4().hex}-node{self.node}")
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)
                finally:
                    os.close(fd)
            except OSError as e:
                _unlink(path)
                error = HostMemoryError(f"cannot make the node's shared compute copy of {self.nbytes / 2**30:.4g} GiB "
                                        f"in {shm_dir()}: {e}; give /dev/shm room for it (docker: --shm-size)")
        errors = [None]
        try:
            path, error = self.ranks.gather_objects((path, error), "making the node's shared compute copy")[self.local[0]]
            segment = None
            if error is None:
                try:
                    segment = torch.from_file(path, shared=True, size=self.nbytes, dtype=torch.uint8)
                except RuntimeError as e:
                    error = HostMemoryError(f"rank {self.ranks.rank} cannot map the node's shared compute copy "
                                            f"{path}: {e}")
            errors = self.ranks.gather_objects(error, "mapping the node's shared compute copy")
        finally:
            if lead and path is not None:
                _unlink(path)      # mapped by every rank of the node (or failed): the name goes now
        error = next((e for e in errors if e is not None), None)
        if error is not None:
            raise error
        return path, segment

    def _pin(self) -> bool:
        from ..runtime.page_locked import register_host
        if register_host(self.segment):
            return True
        warnings.warn("the node's shared compute copy could not be page-locked (cudaHostRegister failed): "
                      "prefetches from it are synchronous copies", stacklevel=3)
        return False

    def view(self, owner: int) -> torch.Tensor:
        start = self.offsets[owner]
        return self.segment[start:start + self.numels[owner] * self.dtype.itemsize].view(self.dtype)

    def publish(self, owner: int, ranges: list[tuple[int, int]]) -> None:
        """On the host stream, after this rank wrote its range of `owner`: every other node's
        ranges into this node's copy, then the node's barrier (the copy is whole past it)."""
        copy = self.view(owner)
        if self.across is not None:
            group = self.across
            for node in self.nodes:
                rank = node[self.local_rank]
                lo, hi = ranges[rank]
                if hi > lo:
                    part = copy[lo:hi]
                    part = part.view(torch.int16) if part.dtype == torch.bfloat16 else part   # gloo moves bytes
                    self.ranks.call(f"gathering the new weights of owner {owner} across nodes",
                                    lambda: dist.broadcast(part, src=self.ranks.members[rank], group=group))
        if self.barrier_group is not None:
            group = self.barrier_group
            self.ranks.call(f"waiting for the node's ranks to write owner {owner}",
                            lambda: dist.barrier(group=group))


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
