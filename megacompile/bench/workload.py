"""What every system in the peers bench trains: one model shape, one seed, the same batches.

Each system builds the model in its own process from the same seed (so from the same fp32
weights; megacompile and DeepSpeed read them from a folder written once from that build, bench/weights.py),
and draws the same token batches; only the training system differs."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

# Llama-3.2-3B's shape (untied head) for a GPU; a few-layer toy of it for the cpu half.
SHAPES = {
    "llama-3b": dict(vocab=128256, dim=3072, ffn=8192, heads=24, kv_heads=8, layers=28),
    "llama-7b": dict(vocab=32000, dim=4096, ffn=11008, heads=32, kv_heads=32, layers=32),
    "tiny": dict(vocab=256, dim=64, ffn=128, heads=4, kv_heads=2, layers=4),
}


def width_lr(dim: int) -> float:
    """The learning rate a deep random-init shape of width `dim` trains at in a few steps: 1e-4 at
    1024 wide or less, 1e-4 x 1024 / dim above. AdamW moves every weight by about lr a step whatever
    its gradient's size, so a matmul's output moves by about lr x its width against outputs that grow
    as the square root of it: the relative move grows with the square root of the width. On the H100 the
    Llama-2-7B shape (4096 wide, 32 layers) went 11.19 -> 28.75 in one step at 1e-4 and FSDP2's 3B
    rows (3072 wide) rose from 12.44 to 19.13; on the host 32 layers 1024 wide fell at 1e-4
    (10.57 -> 9.19 in 5 steps, bf16 autocast)."""
    return 1e-4 * min(1.0, 1024 / dim)


@dataclass
class Workload:
    shape: str = "llama-3b"
    batch: int = 4
    seq: int = 2048
    steps: int = 3          # timed steps, after the warmup
    warmup: int = 1
    # With Zipf-distributed tokens (batches()), lr 1e-4 lowers a random-init model's loss by ~0.2 nats a
    # step (on the host, a 1-layer Llama 4096 wide with a 32k vocabulary: 11.2 to 9.6 in 7 steps, ~25 bf16 ulps).
    # Deep and wide, it diverges: width_lr() is what the bench's GPU rows train at.
    lr: float = 1e-4
    # Steps over which the rate rises linearly to lr (lr / lr_warmup at the first, as a user's run
    # warms up); 0: lr from the first step. AdamW's first update moves every weight by about lr,
    # whatever its gradient: at lr 3.3e-5 the 3B shape's loss rose from 12.44 to 14.6 in two steps
    # on the H200 in every system, and their roundings then drew them apart (docs/gpu.md).
    lr_warmup: int = 0
    weight_decay: float = 0.0
    seed: int = 0
    data_seed: int | None = None    # the batches' seed (default: seed + 1)
    device: str = "cuda"
    dims: dict = field(default_factory=dict)   # overrides of the shape's dimensions

    @property
    def config(self) -> dict:
        return {**SHAPES[self.shape], **self.dims}

    def lr_at(self, step: int) -> float:
        """The learning rate of the 1-based optimizer step `step`: every system steps at these."""
        return self.lr * min(1.0, step / self.lr_warmup) if self.lr_warmup > 0 else self.lr

    @property
    def compute_dtype(self) -> torch.dtype:
        # bf16 compute on a GPU, as a user trains; fp32 on the cpu half, where every system can match it exactly
        return torch.bfloat16 if self.device.startswith("cuda") else torch.float32

    @property
    def parameters(self) -> int:
        c = self.config
        kv = c["dim"] * c["kv_heads"] // c["heads"]
        block = 2 * c["dim"] * c["dim"] + 2 * c["dim"] * kv + 3 * c["dim"] * c["ffn"] + 2 * c["dim"]
        return 2 * c["vocab"] * c["dim"] + c["layers"] * block + c["dim"]

    @property
    def flop_parameters(self) -> int:
        """The N of 6ND: the parameters but the token embedding, a lookup with no matmul (the head is
        untied, and counts)."""
        c = self.config
        return self.parameters - c["vocab"] * c["dim"]

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq

    def model(self) -> torch.nn.Module:
        """The model in fp32 on the host, from the seed: the same weights in every process."""
        from ..models.llama import TinyLlama
        torch.manual_seed(self.seed)
        return TinyLlama(self.llama_config())

    def meta_model(self) -> torch.nn.Module:
        """The same model with its parameters on the meta device: no weight memory."""
        from ..models.llama import TinyLlama
        with torch.device("meta"):
            return TinyLlama(self.llama_config())

    def llama_config(self):
        from ..models.llama import LlamaConfig
        c = self.config
        return LlamaConfig(vocab=c["vocab"], dim=c["dim"], ffn=c["ffn"], heads=c["heads"], kv_heads=c["kv_heads"],
                           layers=c["layers"])

    @property
    def weights_name(self) -> str:
        """Names the weights model() builds (the shape, its overrides and the seed), for their folder."""
        dims = "".join(f"-{k}{v}" for k, v in sorted(self.dims.items()))
        return f"{self.shape}{dims}-seed{self.seed}"

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, labels) for every step, warmup included; labels are the next tokens. Token k
        is drawn with probability proportional to 1/(k+1) (Zipf, as words in text): a model learns
        that in a few steps, so the losses fall and the systems' agreement says something.
        Uniform tokens leave nothing to learn: the loss stays at ln(vocab) within a bf16 ulp."""
        g = torch.Generator().manual_seed(self.seed + 1 if self.data_seed is None else self.data_seed)
        zipf = 1.0 / torch.arange(1, self.config["vocab"] + 1, dtype=torch.float64)
        out = []
        for _ in range(self.warmup + self.steps):
            ids = torch.multinomial(zipf, self.batch * (self.seq + 1), replacement=True, generator=g)
            ids = ids.view(self.batch, self.seq + 1)
            out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        return out

    def to_dict(self) -> dict:
        return asdict(self)
