#!/usr/bin/env bash
# Wheels the peers bench needs on a GPU machine without network, into a git-ignored folder that
# travels with the checkout (default: .whl at the repository root).
#
#   PYTHON=.venv/bin/python benchmarks/peers/wheels.sh [DIR]     # here, where pip reaches its registry
#   # there:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
#   python3 -m megacompile.bench peers --out bench-results
#
# DeepSpeed is published only as a source distribution: it is built here as a pure-Python wheel
# (DS_BUILD_OPS=0); DeepSpeedCPUAdam then builds itself at first use there, with that machine's
# compiler and ninja. Its needs that a CUDA PyTorch image usually lacks are downloaded as wheels
# for the target's Python (PYTHON_VERSION, default 3.12, manylinux x86-64). megacompile itself is
# wheeled from this checkout. FSDP2 is part of torch.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dir=${1:-$root/.whl}
py=${PYTHON_VERSION:-3.12}
python=${PYTHON:-python3}     # one with torch installed: DeepSpeed's setup imports it
mkdir -p "$dir"
$python -m pip wheel -q --no-deps "$root" -w "$dir"
DS_BUILD_OPS=0 $python -m pip wheel -q --no-deps --no-build-isolation "deepspeed${DEEPSPEED_VERSION:+==$DEEPSPEED_VERSION}" -w "$dir"
# With their own needs resolved for the target (pydantic pins pydantic-core exactly).
$python -m pip download -q --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$dir" hjson pydantic
ls "$dir"
