"""The disk's raw sequential bandwidth, as the tier would see it: O_DIRECT (where the filesystem
takes it) from aligned buffers, `threads` requests of `chunk` bytes in flight, the same code path
as the tier's state files. Calibration puts it in the hardware profile; the tier's benchmark
holds the tier against it."""
from __future__ import annotations

import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from .aligned import aligned_empty, round_up
from .state_files import StateFile, probe_direct


def measure_disk(folder: str, nbytes: int = 1 << 30, chunk: int = 16 << 20, threads: int = 4) -> dict:
    """Writes then reads `nbytes` sequentially in a scratch file in `folder` (removed after).
    Returns read_bw and write_bw (B/s), whether O_DIRECT was used, and the sizes."""
    os.makedirs(folder, exist_ok=True)
    chunk = round_up(chunk)
    nbytes = max(chunk, nbytes // chunk * chunk)
    direct = probe_direct(folder)
    fd, path = tempfile.mkstemp(prefix=".megacompile-disk-probe-", dir=folder)
    os.close(fd)
    state = StateFile(path, nbytes // 4, direct)
    buffers = [aligned_empty(chunk) for _ in range(threads)]
    for b in buffers:
        b.fill_(1)
    offsets = list(range(0, nbytes, chunk))

    def run(op) -> float:
        def task(k: int) -> None:
            buf = buffers[k % threads]
            for i in range(k, len(offsets), threads):   # each thread its own stride of chunks
                op(buf, offsets[i])
        start = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(task, range(threads)))
        return time.perf_counter() - start
    try:
        write_s = run(state.write)
        os.fsync(state.fd)
        read_s = run(state.read)
    finally:
        state.close(remove=True)
    return {"read_bw": nbytes / read_s, "write_bw": nbytes / write_s, "direct": direct, "bytes": nbytes,
            "chunk": chunk, "threads": threads}
