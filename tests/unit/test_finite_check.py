"""runtime/host_weights.finite, the check every weight loaded into the host state passes: an inf or a
NaN anywhere, in any float dtype and layout, is found (min and max carry them)."""
import pytest
import torch

from megacompile.runtime.host_weights import finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_an_inf_or_nan_anywhere_is_found(dtype, bad):
    t = torch.randn(64, 48).to(dtype)
    assert finite(t)
    for where in [(0, 0), (63, 47), (17, 5)]:
        poisoned = t.clone()
        poisoned[where] = bad
        assert not finite(poisoned)
        assert not finite(poisoned.t())             # not contiguous
        assert not finite(poisoned[:, where[1]:where[1] + 1])      # a strided view holding it
    mostly = torch.full((1000,), bad, dtype=dtype)
    mostly[3] = 1.0
    assert not finite(mostly)


def test_an_empty_tensor_is_finite():
    assert finite(torch.empty(0)) and finite(torch.empty(3, 0, dtype=torch.bfloat16))
