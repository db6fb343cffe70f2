"""Benchmarks a user runs: `python -m megacompile.bench peers` trains one model through megacompile
and through the systems a user would pick instead (DeepSpeed ZeRO-3 offload, FSDP2 CPU offload),
side by side in one table."""
