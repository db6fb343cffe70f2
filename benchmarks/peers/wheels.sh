#!/usr/bin/env bash
# Wheels the GPU lease needs on a machine without network (benchmarks/peers/lease.sh installs them),
# into a git-ignored folder that travels with the checkout (default: .whl at the repository root).
#
#   PYTHON=.venv/bin/python benchmarks/peers/wheels.sh [DIR]     # here, where pip reaches its registry
#
# megacompile is wheeled from this checkout every time. The others are fetched or built only when
# DIR has none of them yet:
# - DeepSpeed, published only as a source distribution: built here as a pure-Python wheel
#   (DS_BUILD_OPS=0); its CPUAdam op builds itself there, with that machine's compiler and ninja
#   (lease.sh builds it in a call of its own). Its needs that a CUDA PyTorch image usually lacks
#   (hjson, pydantic) are downloaded for the target's Python (PYTHON_VERSION, default 3.12,
#   manylinux x86-64).
# - Liger-Kernel, a pure-Python wheel (Triton kernels compiled there), for the kernel benchmarks.
# FSDP2 is part of torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.whl}
py=${PYTHON_VERSION:-3.12}
python=${PYTHON:-python3}     # one with torch installed: DeepSpeed's setup imports it
mkdir -p "$dir"
have() { compgen -G "$dir/$1" > /dev/null; }
rm -f "$dir"/megacompile-*.whl
$python -m pip wheel -q --no-deps "$root" -w "$dir"
have "deepspeed-*.whl" || DS_BUILD_OPS=0 $python -m pip wheel -q --no-deps --no-build-isolation \
    "deepspeed${DEEPSPEED_VERSION:+==$DEEPSPEED_VERSION}" -w "$dir"
have "liger_kernel-*.whl" || $python -m pip download -q --no-deps --only-binary=:all: \
    "liger-kernel${LIGER_VERSION:+==$LIGER_VERSION}" -d "$dir"
# With their own needs resolved for the target (pydantic pins pydantic-core exactly).
have "pydantic-*.whl" && have "hjson-*.whl" || $python -m pip download -q --only-binary=:all: --implementation cp \
    --python-version "$py" --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$dir" hjson pydantic
ls "$dir"
