"""The header of a safetensors file, read and checked without touching its tensors.

Layout: 8 bytes (little-endian u64) header length n, n bytes of JSON {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {...}}, then the data; offsets count from the end
of the header. Reading only the header lets a load name the file and tensor that is missing or
cut short before any state changes.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import torch

from ..errors import WeightsFileError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
CODES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int       # absolute byte offsets in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


def read_header(path: str) -> dict[str, Entry]:
    """name -> Entry for every tensor; WeightsFileError naming the file (and the first tensor
    whose bytes lie past its end) when it is missing, not safetensors, or truncated."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsFileError(f"{path} is not a safetensors file: it has {size} bytes, fewer than a header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise WeightsFileError(f"{path} is truncated or not a safetensors file: its header claims {n} bytes, "
                                       f"the file has {size}")
            raw = json.loads(f.read(n))
    except FileNotFoundError as e:
        raise WeightsFileError(f"{path} is missing") from e
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise WeightsFileError(f"cannot read {path} as safetensors: {e}") from e
    start = 8 + n
    out = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], tuple(int(s) for s in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError) as err:
            raise WeightsFileError(f"{path}: the header entry of {name} is malformed ({err})") from err
        if dtype not in DTYPES:
            quantized = (" (an FP8 tensor of a quantized checkpoint: dequantize the checkpoint to bfloat16 or float32 "
                         "first)" if dtype.startswith("F8") else "")
            raise WeightsFileError(f"{path}: {name} has dtype {dtype}, which megacompile does not load{quantized}")
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * SIZES[dtype]:
            raise WeightsFileError(f"{path}: {name} claims {e - b} bytes for shape {shape} {dtype}")
        if start + e > size:
            raise WeightsFileError(f"{path} is truncated: {name} needs bytes up to {start + e}, the file has {size}; "
                                   "copy or download it again")
        out[name] = Entry(dtype, shape, start + b, start + e)
    return out
