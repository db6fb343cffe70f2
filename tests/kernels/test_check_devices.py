"""The kernel check as it runs on a GPU: every operand a case hands a kernel is on the check's
device (a host tensor among them fails the launch there, and only there), and a case that raises
fails its own row while the others still run."""
import math

import pytest
import torch
from torch.utils import _pytree as pytree

from megacompile.kernels import check

KERNELS = ("attention", "embedding_backward", "rms_norm", "layer_norm", "swiglu", "geglu", "gelu", "rope", "softmax",
           "fused_linear_cross_entropy", "linear_logprobs", "grouped_matmul", "adamw_step_", "cast", "accumulate_", "scale")


class Reached(Exception):
    pass


@pytest.mark.parametrize("name,case", [(name, case) for name, case, _, _ in check.CASES])
def test_every_operand_a_case_hands_its_kernel_is_on_the_checks_device(monkeypatch, name, case):
    # "meta" stands for a device that is not the host: what a case builds on the host shows.
    monkeypatch.setattr(check, "DEVICE", torch.device("meta"))
    handed = []

    def kernel(*args, **kwargs):
        handed.extend(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        raise Reached

    for k in KERNELS:
        monkeypatch.setattr(check, k, kernel)
    dtype = torch.bfloat16 if name == "cast_fp32_to_bf16" else torch.float32
    with pytest.raises(Reached):
        case(dtype, check.SHAPES["test"], torch.Generator().manual_seed(0))
    assert handed
    elsewhere = [(tuple(t.shape), str(t.device)) for t in handed if t.device.type != "meta"]
    assert not elsewhere, f"{name} hands its kernel tensors that are not on the check's device: {elsewhere}"


def test_a_case_that_raises_fails_its_row_and_the_others_still_run(monkeypatch):
    def broken(dtype, s, gen):
        raise ValueError("Pointer argument (at 5) cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(check, "CASES", [("broken", broken, (torch.float32,), check.TOLERANCE),
                                         ("scale", check.case_scale, (torch.float32,), {torch.float32: 0.0})])
    rows = check.run("test", compile_gpu=False)
    assert [(r.kernel, r.passed) for r in rows] == [("broken", False), ("scale", True)]
    assert "Pointer argument (at 5)" in rows[0].error and math.isnan(rows[0].forward)
    assert "broken torch.float32: ValueError: Pointer argument" in check.format_table(rows)
