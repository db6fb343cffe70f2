"""Lets torchvision's Python half import over the CPU build of torch (tests/torchvision_env.py).

PyPI's torchvision wheels are built against the CUDA build of torch: over the CPU build their
compiled ops fail to load (torchvision catches that), and then torchvision._meta_registrations
fails to register fake kernels for ops that do not exist ("operator torchvision::nms does not
exist"), which stops `import torchvision`. The fake kernels serve tracing those ops only; the
transforms transformers' video and image processors run (resize, normalize on tensors) are plain
torch. So, in the processes that put this folder first on PYTHONPATH, that module is an empty one.
"""
import sys
import types

sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
