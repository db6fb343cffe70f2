"""Data parallelism on torch.distributed: the same plan on every rank, host optimizer state
sharded across ranks (docs/distributed.md)."""
from .data_parallel import DataParallel, data_parallel_for
from .shard import ShardedHostState, shard_of

__all__ = ["DataParallel", "data_parallel_for", "ShardedHostState", "shard_of"]
