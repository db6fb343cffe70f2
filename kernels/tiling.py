"""How much work one program instance takes: the tile sizes every launcher in this package uses.

One policy serves both places the kernels run. On a GPU a tile of ~8K fp32 elements per program
(32 per thread at 8 warps) keeps loads vectorized without spilling. Under the Triton interpreter
every program instance costs ~0.5-1 ms of Python regardless of its size, so the same large tiles
keep the instance count, and so the run time, low. Row kernels hold a whole row (BLOCK_N >= n_cols)
and stack rows until the tile is full.
"""
import torch
import triton

TILE = 8192  # elements per program instance (fp32 registers: 32 per thread at 8 warps)


def _warps(tile: int) -> int:
    return max(4, min(32, tile // 1024))


def flat_block(n: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for an elementwise kernel over n elements."""
    block = max(128, min(TILE, triton.next_power_of_2(n)))
    return block, _warps(block)


def row_tile(n_rows: int, n_cols: int, tile: int = TILE) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a kernel that keeps whole rows of n_cols in registers."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = max(1, min(tile // block_n, triton.next_power_of_2(max(n_rows, 1))))
    return block_m, block_n, _warps(block_m * block_n)


def persistent_programs(device: torch.device, n_blocks: int) -> int:
    """Programs for a kernel that loops over row blocks and keeps a per-program partial sum.

    One per SM on a GPU (the partial-sum buffer is then n_SM rows); a handful on the CPU, where the
    interpreter's cost is per loop iteration anyway.
    """
    if device.type == "cuda":
        slots = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        slots = 4
    return max(1, min(n_blocks, slots))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """View t [..., N] as [M, N] rows with unit column stride (copies only when it must)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()
