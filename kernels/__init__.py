"""Fused Triton kernels for the transformer hot paths (see docs/kernels.md).

Without a CUDA device the kernels can only run under the Triton interpreter, so importing this
package sets TRITON_INTERPRET=1 when torch sees no GPU and the variable is not already set. Triton
reads it when a kernel is decorated, so it happens here, before the kernel modules are imported;
set TRITON_INTERPRET=0 yourself to keep it off (the sm_80/sm_90 compile check does).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from .adamw import adamw_step_, adamw_step_all_  # noqa: E402
from .cast import accumulate_, cast  # noqa: E402
from .fused_linear_cross_entropy import fused_linear_cross_entropy  # noqa: E402
from .gelu import geglu, gelu  # noqa: E402
from .layer_norm import layer_norm  # noqa: E402
from .rms_norm import rms_norm  # noqa: E402
from .rope import rope  # noqa: E402
from .softmax import softmax  # noqa: E402
from .swiglu import swiglu  # noqa: E402

__all__ = [
    "accumulate_", "adamw_step_", "adamw_step_all_", "cast", "fused_linear_cross_entropy", "geglu", "gelu",
    "layer_norm", "rms_norm", "rope", "softmax", "swiglu",
]
