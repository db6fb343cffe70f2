"""Fused Triton kernels for the transformer hot paths (see docs/kernels.md).

One module per kernel, each exposing a differentiable function of the same name
(`from megacompile.kernels.rms_norm import rms_norm`); nothing is re-exported here, so the names
`megacompile.kernels.rms_norm` etc. always mean the modules.

Without a CUDA device the kernels can only run under the Triton interpreter, so importing this
package sets TRITON_INTERPRET=1 when torch sees no GPU and the variable is not already set. Triton
reads it when a kernel is decorated, that is when a kernel module is first imported, which is after
this; set TRITON_INTERPRET=0 yourself to keep it off (the sm_80/sm_90 compile check does).
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
