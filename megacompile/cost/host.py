"""The host side of a profile: the machine a GPU sits in, apart from the GPU.

Host memory bandwidth paces the host AdamW (about 28 B/param: fp32 master, m, v and gradient read,
three written back), or on a server the cores a GPU is given, which cannot pull all of it; the disk
tier's disk paces a step whose state does not fit in RAM. A consumer card sits in a desktop (two
DDR5 channels), a workstation card in a workstation, a data-centre card in 16 cores of a server:
`megacompile plan --host desktop|workstation|server` plans a card with another host's figures,
`--host-cores N` with another count of cores, and `megacompile calibrate` measures the real one.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

GB = 1e9
ADAM_BYTES_PER_PARAM = 28
ADAM_BANDWIDTH_SHARE = 0.85      # of peak memory bandwidth a fused, multi-threaded AdamW sustains


@dataclass(frozen=True)
class HostProfile:
    name: str
    host_bw: float                  # peak memory bandwidth, B/s
    host_adam_params_per_s: float   # the host AdamW rate, bandwidth-bound
    # One PCIe Gen4 NVMe drive, sequential O_DIRECT (HardwareProfile's defaults);
    # `megacompile calibrate --nvme-dir PATH` measures the real one.
    disk_read_bw: float = 6.5 * 10**9
    disk_write_bw: float = 5.0 * 10**9


def bandwidth_bound(name: str, bw: float) -> HostProfile:
    """A host whose AdamW runs at ADAM_BANDWIDTH_SHARE of its memory bandwidth."""
    return HostProfile(name, bw, ADAM_BANDWIDTH_SHARE * bw / ADAM_BYTES_PER_PARAM)


# What the host AdamW streams through memory on a cloud GPU's share of a server, 16 cores: the
# calibrated AdamW of the H100 lease's host (5.82e9 params/s, 163 GB/s) and the H200 lease's
# (4.90e9, 137 GB/s), each 16 cores of a two-socket server (benchmarks/results/peers-h100,
# peers-h200-2026-11-30). Sixteen cores cannot pull a socket's bandwidth (each streams about
# 9.4 GB/s), so a server's AdamW is bound by them, not by its DIMMs (docs/decisions.md).
CLOUD_SHARE_STREAM = 150 * GB
CLOUD_SHARE_CORES = 16
CORE_STREAM = CLOUD_SHARE_STREAM / CLOUD_SHARE_CORES    # what one core streams through the AdamW pass


def cloud_share(name: str, bw: float) -> HostProfile:
    """16 cores of a server socket with `bw` of memory bandwidth: the AdamW as bandwidth_bound's,
    at most the CLOUD_SHARE_STREAM those cores stream."""
    bound = bandwidth_bound(name, bw)
    return replace(bound, host_adam_params_per_s=min(bound.host_adam_params_per_s,
                                                     CLOUD_SHARE_STREAM / ADAM_BYTES_PER_PARAM))


def ddr(channels: int, megatransfers: int) -> float:
    """Peak bandwidth of `channels` 64-bit DDR channels at `megatransfers` MT/s (JEDEC), B/s."""
    return channels * 8 * megatransfers * 1e6


HOSTS: dict[str, HostProfile] = {
    # AM5 / LGA1700 desktop: DDR5-5600, two channels (89.6 GB/s)
    "desktop": bandwidth_bound("desktop (DDR5-5600, 2 channels)", ddr(2, 5600)),
    # AM4 / LGA1200 desktop, where many RTX 3090s sit: DDR4-3200, two channels (51.2 GB/s), its
    # AdamW 57% of the DDR5 desktop's
    "desktop-ddr4": bandwidth_bound("desktop (DDR4-3200, 2 channels)", ddr(2, 3200)),
    # TRX50 / W790 workstation: DDR5-5200, four channels (166.4 GB/s)
    "workstation": bandwidth_bound("workstation (DDR5-5200, 4 channels)", ddr(4, 5200)),
    # The host of the H100/H200 profiles: 16 cores of a DDR5-4800 server socket (8 channels,
    # 307 GB/s peak; 300 GB/s), as a cloud GPU is given, its AdamW bound by the cores.
    "server": cloud_share("server (DDR5, 300 GB/s, 16 cores)", 300 * GB),
    # The A100 profile's host: 16 cores of a DDR4-3200 server socket (8 channels, 204.8 GB/s peak).
    "server-ddr4": cloud_share("server (DDR4, 200 GB/s, 16 cores)", 200 * GB),
}


def host_fields(host: HostProfile) -> dict:
    """The HardwareProfile fields a host profile sets."""
    return dict(host_bw=host.host_bw, host_adam_params_per_s=host.host_adam_params_per_s,
                disk_read_bw=host.disk_read_bw, disk_write_bw=host.disk_write_bw)


def get_host(name: str) -> HostProfile:
    if name.lower() not in HOSTS:
        from ..errors import ArgumentError
        raise ArgumentError(f"unknown host '{name}': choose one of {', '.join(HOSTS)}")
    return HOSTS[name.lower()]


def with_cores(profile, cores: int):
    """`profile` with its host AdamW on `cores` cores: the lower of what they stream (CORE_STREAM
    each) and ADAM_BANDWIDTH_SHARE of the host's memory bandwidth, 28 B a parameter."""
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        from ..errors import ArgumentError
        raise ArgumentError(f"--host-cores must be a whole number of cores, 1 or more; got {cores!r}")
    stream = min(ADAM_BANDWIDTH_SHARE * profile.host_bw, cores * CORE_STREAM)
    return replace(profile, name=f"{profile.name}; {cores} host cores",
                   host_adam_params_per_s=stream / ADAM_BYTES_PER_PARAM)


def with_host(profile, host: str | HostProfile):
    """`profile` (a HardwareProfile) with `host`'s memory bandwidth, AdamW rate and disk."""
    host = get_host(host) if isinstance(host, str) else host
    return replace(profile, name=f"{profile.name}; host: {host.name}", **host_fields(host))
