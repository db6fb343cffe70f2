"""Hardware profiles as data: what the cost model needs to know about a device and its host.

Datasheet values are starting points (dense, without sparsity); `efficiency` says how much of
a peak a well-tuned kernel reaches. The `cpu` profile, for the simulated device, is measured on
the machine itself (megacompile/calibrate) and read from its cache (cpu_cache.py).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from .host import HOSTS, host_fields

GB = 1e9
TFLOPS = 1e12


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    device_bytes: int            # device memory
    device_bw: float             # device memory bandwidth, B/s
    peak_bf16: float             # dense matmul FLOP/s in bf16
    peak_fp32: float             # FLOP/s in fp32 (no TF32: full-precision compute)
    h2d_bw: float                # host -> device, B/s (per direction; links are full duplex)
    d2h_bw: float                # device -> host, B/s
    host_bw: float               # host memory bandwidth, B/s
    host_adam_params_per_s: float  # host AdamW throughput, the full update path (about 28 B/param)
    op_overhead_s: float         # fixed cost per launched op (kernel launch, or interpreter step)
    matmul_efficiency: float = 0.7   # share of peak FLOP/s real matmuls reach
    # Share of that matmul rate the fused attention (SDPA) kernels reach. FlashAttention-2 runs
    # near 330 TFLOPS on an H100, where a dense bf16 matmul reaches about 692 (0.7 x 989): 0.48 on
    # Hopper. On an A100 it reaches about what a matmul does. Measured profiles measure it.
    attention_efficiency: float = 1.0
    # The same share for megacompile's own attention kernel (kernels/attention.py, what a fused plan
    # runs), counted by the matmuls it runs; None: as torch's (no GPU has timed it against them yet).
    fused_attention_efficiency: float | None = None
    memory_efficiency: float = 0.8   # share of bandwidth elementwise kernels reach
    # The runtime's fixed cost per schedule node, paid by the issuing (compute) thread: Python
    # dispatch, stream handoffs, ledger updates. Negligible at GPU block sizes; on the cpu
    # backend, where several streams share a few cores, it is fitted from a measured step.
    node_overhead_s: float = 10e-6
    # Device memory the ledger cannot see (cost/reserve.py): cuBLAS + cuBLASLt workspaces, and the
    # share of the budget lost to allocator rounding and fragmentation. The simulated device
    # reserves nothing.
    workspace_bytes: int = 64 * 2**20
    fragmentation: float = 0.05
    hidden_scratch: bool = True      # ops allocate scratch the ledger does not see (a real device)
    # The disk tier's disk (megacompile/disk), sequential O_DIRECT, B/s. Defaults: one PCIe
    # Gen4 NVMe drive; `megacompile calibrate --nvme-dir PATH` measures the real one.
    disk_read_bw: float = 6.5 * 10**9
    disk_write_bw: float = 5.0 * 10**9
    # Data parallelism (megacompile/distributed): B/s each rank's share of a ring collective moves
    # at between ranks of one node (NVLink-class on a GPU server; NCCL's bus bandwidth) and across
    # nodes (one 400 Gb/s NIC per GPU).
    intra_node_bw: float = 360 * 10**9
    inter_node_bw: float = 40 * 10**9

    def peak_flops(self, dtype: torch.dtype) -> float:
        return self.peak_bf16 if dtype in (torch.bfloat16, torch.float16) else self.peak_fp32

    def to_dict(self) -> dict:
        return asdict(self)


def _host(bw: float) -> tuple[float, float]:
    """A host whose cores are all the GPU's (a Grace superchip): memory bandwidth and the AdamW rate
    it sustains (28 B/param at 85%)."""
    return bw, 0.85 * bw / 28


def _share(name: str) -> tuple[float, float]:
    """A cloud GPU's host (cost/host.py's server hosts, 16 cores): memory bandwidth and AdamW rate."""
    return HOSTS[name].host_bw, HOSTS[name].host_adam_params_per_s


_H100_HOST = _share("server")
HOPPER_ATTENTION = 0.48
# What torch reports an H100 80GB HBM3 to hold (get_device_properties().total_memory, measured on
# one: benchmarks/results/peers-h100), 79.18 GiB: compile() takes its default budget from that
# figure, so a plan for the card takes it too.
H100_MEMORY = 85_017_493_504
# The other profiles hold what torch reports for their cards too, as public reports quote it: the
# repr of get_device_properties() ("total_memory=48622MB", whole MiB, rounded down) or a CUDA OOM
# message ("GPU 0 has a total capacity of 23.52 GiB", GiB to two decimals), for which a profile
# takes the smallest whole MiB that prints as that figure. The figure falls as drivers reserve
# more (a 3090 printed 23.70 GiB on older drivers and 23.56 on 2025-26 ones): where reports differ,
# a profile takes the lowest a current Linux driver gives, so a plan errs towards not fitting.
# With ECC on, the GDDR workstation cards report less still. gh200 holds its datasheet's GB (10**9),
# below what the card reports. tests/unit/test_hardware_profiles.py holds each figure.
MiB = 2**20

PROFILES: dict[str, HardwareProfile] = {
    "h100": HardwareProfile("h100 (SXM, 80 GB, PCIe Gen5 host link)", H100_MEMORY, 3.35e12, 989 * TFLOPS,
                            67 * TFLOPS, 55 * GB, 55 * GB, *_H100_HOST, 5e-6, attention_efficiency=HOPPER_ATTENTION),
    # 79.11 GiB: "_CudaDeviceProperties(name='NVIDIA H100 PCIe', major=9, minor=0, total_memory=81008MB".
    "h100-pcie": HardwareProfile("h100 (PCIe, 80 GB)", 81008 * MiB, 2.0e12, 756 * TFLOPS, 51 * TFLOPS,
                                 55 * GB, 55 * GB, *_H100_HOST, 5e-6, attention_efficiency=HOPPER_ATTENTION),
    # 139.72 GiB: "GPU 0 has a total capacity of 139.72 GiB" in several H200 (141 GB) training logs; the
    # get_device_properties() repr in modal-labs examples, on an older driver, says 143156MB (139.80).
    "h200": HardwareProfile("h200 (141 GB, PCIe Gen5 host link)", 143069 * MiB, 4.8e12, 989 * TFLOPS,
                            67 * TFLOPS, 55 * GB, 55 * GB, *_H100_HOST, 5e-6, attention_efficiency=HOPPER_ATTENTION),
    # Datasheet GB: no report of what torch gives a GH200's 96 GB HBM3 was found.
    "gh200": HardwareProfile("gh200 (96 GB HBM3, NVLink-C2C to LPDDR5X)", 96 * 10**9, 4.0e12, 989 * TFLOPS,
                             67 * TFLOPS, 450 * GB, 450 * GB, *_host(500 * GB), 5e-6,
                             attention_efficiency=HOPPER_ATTENTION),
    # 79.25 GiB: "GPU 0; 79.25 GiB total capacity" (github.com/levihsu/OOTDiffusion/issues/235, an A100)
    # and "GPU 0 has a total capacity of 79.25 GiB" in reports from 80 GB A100s; older drivers gave 79.35
    # (github.com/MoonshotAI/Kimi-VL/issues/54, 8 x A100).
    "a100": HardwareProfile("a100 (SXM, 80 GB, PCIe Gen4 host link)", 81147 * MiB, 2.0e12, 312 * TFLOPS,
                            19.5 * TFLOPS, 25 * GB, 25 * GB, *_share("server-ddr4"), 5e-6),
}

# Host links, per direction: PCIe Gen4 x16 is 32 GB/s raw and Gen5 x16 64 GB/s (PCI-SIG); pinned
# copies reach about 25 and 55, the figures the a100 and h100 profiles above use.
PCIE_GEN4 = 25 * GB
PCIE_GEN5 = 55 * GB
_DESKTOP, _WORKSTATION, _SERVER = (host_fields(HOSTS[k]) for k in ("desktop", "workstation", "server"))

# Dense figures (no 2:4 sparsity); for GeForce cards bf16 with fp32 accumulate, which runs at half
# the fp16-accumulate rate the box quotes. Memory as torch reports it (above): the source follows each card.
PROFILES.update({
    # NVIDIA Ampere GA102 GPU Architecture whitepaper, RTX 3090: 24 GB GDDR6X, 936 GB/s;
    # peak FP32 35.6 TFLOPS; peak BF16 tensor TFLOPS with FP32 accumulate 71 (142 sparse); PCIe Gen4 x16.
    # 23.56 GiB: "GPU 0 has a total capacity of 23.56 GiB" from 3090s on 2025-26 drivers (a "24GB RTX 3090"
    # LongBench run; torch 2.10 on a 3090); the repr on older ones says 24268MB and 24259MB (23.70, 23.69).
    "rtx3090": HardwareProfile("rtx3090 (24 GB, PCIe Gen4 host link)", 24121 * MiB, 936 * GB, 71 * TFLOPS,
                               35.6 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_DESKTOP),
    # NVIDIA Ada GPU Architecture whitepaper, RTX 4090: 24 GB GDDR6X, 1008 GB/s; peak FP32 82.6
    # TFLOPS; peak BF16 tensor TFLOPS with FP32 accumulate 165.2 (330.4 sparse); PCIe Gen4 x16.
    # 23.52 GiB: "GPU 0 has a total capacity of 23.52 GiB" (github.com/Soul-AILab/SoulX-FlashTalk/issues/5,
    # "4090 24G"; a 4090 on driver 595.84, nvidia-smi 24564 MiB). Older drivers gave 23.64
    # (github.com/ali-vilab/VGen/issues/104) and 23.65 (github.com/MotrixLab/AiOS/issues/29).
    "rtx4090": HardwareProfile("rtx4090 (24 GB, PCIe Gen4 host link)", 24080 * MiB, 1008 * GB, 165.2 * TFLOPS,
                               82.6 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_DESKTOP),
    # NVIDIA RTX Blackwell GPU Architecture whitepaper, RTX 5090: 32 GB GDDR7, 1792 GB/s; peak FP32
    # 104.8 TFLOPS; peak FP16/BF16 tensor TFLOPS with FP32 accumulate 209.5 (419 sparse; 838 sparse
    # with FP16 accumulate, the box figure); PCIe Gen5 x16.
    # 31.36 GiB: "GPU 0 has a total capacity of 31.36 GiB" (github.com/TrajectoryCrafter/TrajectoryCrafter
    # issue 20, an RTX 5090); 31.37 in github.com/Wan-Video/Wan2.1/issues/465 (a 5090).
    "rtx5090": HardwareProfile("rtx5090 (32 GB, PCIe Gen5 host link)", 32108 * MiB, 1792 * GB, 209.5 * TFLOPS,
                               104.8 * TFLOPS, PCIE_GEN5, PCIE_GEN5, op_overhead_s=5e-6, **_DESKTOP),
    # NVIDIA RTX 6000 Ada Generation datasheet: 48 GB GDDR6 ECC, 960 GB/s; FP32 91.1 TFLOPS; tensor
    # 1457 TFLOPS is FP8 with sparsity, so BF16 dense (FP32 accumulate, full rate) 364.2; PCIe Gen4 x16.
    # 47.48 GiB, ECC off: "(name='NVIDIA RTX 6000 Ada Generation', major=8, minor=9, total_memory=48622MB";
    # with ECC on, 44.43 GiB (github.com/DINGYANB/MTVCrafter/issues/21, nvidia-smi 46068MiB).
    "rtx6000-ada": HardwareProfile("rtx6000-ada (48 GB, PCIe Gen4 host link)", 48622 * MiB, 960 * GB,
                                   364.2 * TFLOPS, 91.1 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6,
                                   **_WORKSTATION),
    # NVIDIA L40S datasheet: 48 GB GDDR6 ECC, 864 GB/s; FP32 91.6 TFLOPS; BF16 tensor 362.05 TFLOPS
    # (733 sparse); PCIe Gen4 x16 (64 GB/s bidirectional).
    # 44.39 GiB: "GPU 0 has a total capacity of 44.39 GiB" in reports from 48 GB L40S (AWS g6e) vLLM and
    # training runs; 44.42 in github.com/stepfun-ai/Step-Video-T2V/issues/8 (8 x L40S), and the repr
    # on an older driver says total_memory=45589MB (44.52).
    "l40s": HardwareProfile("l40s (48 GB, PCIe Gen4 host link)", 45451 * MiB, 864 * GB, 362.05 * TFLOPS,
                            91.6 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_SERVER),
    # NVIDIA A100 Tensor Core GPU datasheet, A100 40GB: 40 GB HBM2, 1555 GB/s; FP32 19.5 TFLOPS;
    # BF16 tensor 312 TFLOPS (624 sparse); PCIe Gen4 x16. Host as the a100 (80 GB) profile's.
    # 39.38 GiB: "GPU 0 has a total capacity of 39.38 GiB" on Perlmutter's 40 GB A100s (a training
    # guide's OOM) and in vLLM deployment notes; the repr on an older driver says
    # "name='A100-SXM4-40GB', ... total_memory=40536MB" (39.59).
    "a100-40gb": HardwareProfile("a100 (40 GB, PCIe Gen4 host link)", 40321 * MiB, 1555 * GB, 312 * TFLOPS,
                                 19.5 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6,
                                 **host_fields(HOSTS["server-ddr4"])),
    # NVIDIA RTX A6000 datasheet: 48 GB GDDR6 ECC, 768 GB/s; FP32 38.7 TFLOPS; tensor 309.7 TFLOPS
    # is BF16 with sparsity, so 154.8 dense (FP32 accumulate at full rate on the professional card);
    # PCIe Gen4 x16.
    # 47.54 GiB, ECC off: "_CudaDeviceProperties(name='NVIDIA RTX A6000', major=8, minor=6,
    # total_memory=48676MB" (a Triton kernel's benchmark notes). No second report found.
    "rtx-a6000": HardwareProfile("rtx-a6000 (48 GB, PCIe Gen4 host link)", 48676 * MiB, 768 * GB, 154.8 * TFLOPS,
                                 38.7 * TFLOPS, PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_WORKSTATION),
    # NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s; FP32 31.2 TFLOPS; BF16 tensor 125
    # TFLOPS (250 sparse); PCIe Gen4 x16. AWS's A10G is planned as it: a variant clocked lower.
    # 22.06 GiB: "(name='NVIDIA A10G', major=8, minor=6, total_memory=22587MB" (torch 2.15) and "GPU 0;
    # 22.06 GiB total capacity" on "24G A10" (github.com/vllm-project/vllm/issues/928).
    "a10": HardwareProfile("a10 (24 GB, PCIe Gen4 host link)", 22587 * MiB, 600 * GB, 125 * TFLOPS, 31.2 * TFLOPS,
                           PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_SERVER),
    # NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s; FP32 30.3 TFLOPS; BF16 tensor 242
    # TFLOPS with sparsity, so 121 dense; PCIe Gen4 x16.
    # 21.96 GiB: "GPU 0 has a total capacity of 21.96 GiB" from vLLM on a Cloud Run L4 task; the figure
    # recurs in other vLLM logs from L4s (github.com/rhymes-ai/Aria/issues/24 quotes it too).
    "l4": HardwareProfile("l4 (24 GB, PCIe Gen4 host link)", 22482 * MiB, 300 * GB, 121 * TFLOPS, 30.3 * TFLOPS,
                          PCIE_GEN4, PCIE_GEN4, op_overhead_s=5e-6, **_SERVER),
    # NVIDIA HGX B200 datasheet, 8-GPU totals / 8: 1.44 TB HBM3e -> 180 GB, 64 TB/s -> 8 TB/s;
    # FP16/BF16 tensor 36 PFLOPS sparse -> 2.25 PFLOPS dense; FP32 600 TFLOPS -> 75; PCIe Gen5 x16
    # to the host. No attention figure measured yet: attention runs at the matmul rate.
    # 178.35 GiB: "_CudaDeviceProperties(name='NVIDIA B200', major=10, minor=0, total_memory=182631MB" and,
    # from another B200, total_memory=182642MB (178.36).
    "b200": HardwareProfile("b200 (180 GB HBM3e, PCIe Gen5 host link)", 182631 * MiB, 8000 * GB, 2250 * TFLOPS,
                            75 * TFLOPS, PCIE_GEN5, PCIE_GEN5, op_overhead_s=5e-6, **_SERVER),
})

# The CUDA compute capability each profile's kernels are built for (kernels/gpu_compile.py and
# megacompile/fusion/gpu_check.py compile every one of them in the tests).
TARGETS: dict[str, int] = {"a100": 80, "a100-40gb": 80, "rtx3090": 86, "rtx-a6000": 86, "a10": 86, "rtx4090": 89,
                           "rtx6000-ada": 89, "l40s": 89, "l4": 89, "h100": 90, "h100-pcie": 90, "h200": 90,
                           "gh200": 90, "b200": 100, "rtx5090": 120}


__all__ = ["HardwareProfile", "PROFILES", "TARGETS", "replace"]
