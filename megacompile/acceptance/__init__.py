"""`python -m megacompile.acceptance`: one command that says whether megacompile works on this GPU.

In one call, in under ten minutes on an H100: every kernel against its reference on the device;
the parity models trained through the cuda backend against eager torch (float32 to 1e-5, bfloat16
to parity.BF16_LOSS_RTOL); torch's real peak (max_memory_reserved) within the budget at the
smallest budget and three larger ones; the hardware profile calibrated; and a step of a 1B- and a
7B-shaped Llama timed against the prediction. Writes validate.csv (long format) and validate.md
(a table) into --out. Without a GPU it says so and exits 0: the same sections run on the cpu
backend in the tests (tests/acceptance).
"""
from .main import main

__all__ = ["main"]
