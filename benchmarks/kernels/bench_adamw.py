"""Device AdamW (fp32 master, m, v in place; bf16 copy out): megacompile vs torch.optim.AdamW
(single-tensor, foreach, fused) on the same buffers, GB/s at 28 B/param.

    python benchmarks/kernels/bench_adamw.py [--smoke]
"""
import sys

import torch
from _common import Point, device, kernel_module, main

adamw = kernel_module("adamw")
HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _torch_step(variant: str):
    state = {}

    def step(p, g, m, v, out):
        if "opt" not in state:
            param = torch.nn.Parameter(p, requires_grad=False)
            param.grad = torch.empty_like(p)
            flags = {"single": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}[variant]
            state["opt"] = torch.optim.AdamW([param], **HYPER, **flags)
            state["opt"].state[param] = {"step": torch.tensor(0.0, device=p.device if variant == "fused" else "cpu"),
                                         "exp_avg": m, "exp_avg_sq": v}
            state["param"] = param
        state["param"].grad.copy_(g)  # the bf16 gradient, widened as torch needs it
        state["opt"].step()
        out.copy_(p)
    return step


def points(smoke: bool) -> list[Point]:
    sizes = [37 * 129] if smoke else [2**24, 2**28]
    out = []
    for n in sizes:
        for grad_dtype in (torch.float32, torch.bfloat16):
            def make(n=n, grad_dtype=grad_dtype):
                p = torch.randn(n, device=device())
                return (p, torch.randn(n, device=device()).to(grad_dtype), torch.zeros_like(p), torch.zeros_like(p),
                        torch.empty(n, device=device(), dtype=torch.bfloat16))
            steps = {"n": 0}

            def ours(p, g, m, v, o):
                steps["n"] += 1
                adamw.adamw_step_(p, g, m, v, step=steps["n"], out=o, **HYPER)
            impls = {"megacompile": ours, "torch_single": _torch_step("single"),
                     "torch_foreach": _torch_step("foreach")}
            if torch.cuda.is_available():
                impls["torch_fused"] = _torch_step("fused")
            # p, m, v read and written (24 B) + g read + bf16 copy written
            out.append(Point("adamw", f"{n}", grad_dtype, make, impls,
                             bytes_fwd=n * (24 + grad_dtype.itemsize + 2), backward=False))
    return out


if __name__ == "__main__":
    sys.exit(main("adamw", points))
