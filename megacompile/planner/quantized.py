"""A Hugging Face config of a quantized checkpoint (GPTQ, AWQ, bitsandbytes, FP8, compressed-tensors,
MXFP4, ...): its `quantization_config` says how the stored weights are packed.

megacompile trains every parameter in float32 masters and computes in bfloat16 or float32, so such
a config is planned as the full-precision model it describes (with a note saying so), and its
checkpoint's weights are refused at load: read as plain tensors, packed integers or FP8 values
without their scales would train as wrong numbers. A model already quantized in memory (quantized by
transformers as it loaded, or holding integer, FP8 or packed weights) is refused by
compile() and plan() alike, before anything is captured or allocated.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn as nn

from ..errors import MegacompileError, WeightsFileError

# quant_method -> how transformers writes a dequantized copy of such a checkpoint (`path`, `folder`
# stand for the quantized folder and the new one).
_DEQUANTIZE = {
    "fp8": "AutoModelForCausalLM.from_pretrained(path, quantization_config=FineGrainedFP8Config(dequantize=True), "
           "dtype=torch.bfloat16).save_pretrained(folder)",
    "mxfp4": "AutoModelForCausalLM.from_pretrained(path, quantization_config=Mxfp4Config(dequantize=True), "
             "dtype=torch.bfloat16).save_pretrained(folder)",
    "compressed-tensors": "AutoModelForCausalLM.from_pretrained(path, quantization_config=CompressedTensorsConfig("
                          "dequantize=True), dtype=torch.bfloat16).save_pretrained(folder)",
    "bitsandbytes": "model = AutoModelForCausalLM.from_pretrained(path); model.dequantize(); "
                    "model.save_pretrained(folder) (bitsandbytes needs a GPU)",
}


def quantization(config: Any) -> str | None:
    """The config's quantization as a reader names it ("fp8", "gptq 4-bit", "bitsandbytes 4-bit");
    None for a config without quantization_config. `config`: a PretrainedConfig or a dict."""
    method, details = _method(config)
    if method is None:
        return None
    bits = details.get("bits")
    if details.get("load_in_4bit"):
        bits = 4
    elif details.get("load_in_8bit"):
        bits = 8
    return f"{method} {bits}-bit" if isinstance(bits, int) and not isinstance(bits, bool) else method


def planning_note(config: Any, compute: str) -> str | None:
    """The plan's note for a quantized checkpoint's config; None for any other. `compute`: the
    compute dtype's name."""
    described = quantization(config)
    if described is None:
        return None
    return (f"the config is a quantized checkpoint's (quantization_config: {described}): planned as the full-precision "
            f"model megacompile trains, fp32 masters and {compute} compute; its quantized weights must be "
            "dequantized before a run loads them (megacompile train and from_pretrained refuse them as they are)")


def refuse_quantized_weights(config: Any, folder: str) -> None:
    """WeightsFileError when the model folder's config.json says its weights are quantized: naming
    the quantization and how to make a full-precision copy to train from."""
    described = quantization(config)
    if described is None:
        return
    method = _method(config)[0]
    how = _DEQUANTIZE.get(method)
    copy = (f"write a dequantized copy with transformers, {how}, and train from that folder (or from the "
            "full-precision checkpoint it was quantized from)" if how is not None else
            f"train from the full-precision checkpoint it was quantized from (transformers does not dequantize "
            f"{method} checkpoints), or from a copy dequantized with the tool that quantized it")
    raise WeightsFileError(
        f"{os.path.join(folder, 'config.json')} has quantization_config ({described}): the weights in {folder} are "
        "stored quantized, and megacompile reads weights as plain tensors into float32 masters without dequantizing "
        f"them; {copy}. If the folder's weights are full precision already, remove quantization_config from its "
        "config.json")


# Where the modules and tensor classes of quantization libraries come from (bitsandbytes' Linear4bit
# and Params4bit, GPTQ's and AWQ's QuantLinear, HQQLinear, quanto's QLinear, torchao's quantized
# tensors, ...): a prefix of their __module__.
_LIBRARIES = ("bitsandbytes", "torchao.dtypes", "torchao.quantization", "torchao.prototype", "hqq", "auto_gptq",
              "gptqmodel", "awq", "optimum.gptq", "optimum.quanto", "quanto", "compressed_tensors", "eetq",
              "fbgemm_gpu", "aqlm", "vptq", "spqr", "fp_quant", "quark", "flute")
# FP8 and FP4 dtypes: stored values that mean a weight only beside their scales.
_NARROW_FLOATS = {getattr(torch, name) for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz",
                                                    "float8_e8m0fnu", "float4_e2m1fn_x2") if hasattr(torch, name)}


def refuse_quantized_model(model: nn.Module) -> None:
    """MegacompileError when `model` is quantized in memory: transformers quantized it as it loaded
    (`hf_quantizer`, `is_quantized` or its config's `_is_quantized` set), or a parameter is stored
    quantized (integer or FP8 values, a quantization library's tensor) or a module is a quantization
    library's. A model only built from a quantized checkpoint's config (its quantization_config
    set, nothing quantized) holds full-precision weights: it is planned and trained as such."""
    what = _quantized_in_memory(model)
    if what is None:
        return
    described = _described(model)
    label = f" (quantization_config: {described})" if described is not None else ""
    dequantize = ("; or call model.dequantize() first (transformers turns bitsandbytes weights back into full "
                  "precision, on a GPU)" if described is not None and described.startswith("bitsandbytes") else "")
    raise MegacompileError(
        f"{type(model).__name__} is quantized{label}: {what}. megacompile trains every parameter in float32 masters "
        "and reads the weights as plain tensors, without dequantizing them, so a quantized model would train as "
        "wrong numbers. Load the model in full precision instead, from_pretrained(path, dtype=torch.float32) "
        "without a quantization_config, or point megacompile at a full-precision copy "
        f"(megacompile.from_pretrained(folder)){dequantize}. Training adapters on a quantized base (QLoRA) is not "
        "supported")


def _quantized_in_memory(model: nn.Module) -> str | None:
    """What says `model` is quantized, as the refusal names it; None for a full-precision model."""
    for name, p in model.named_parameters():
        stored = _stored_quantized(p)
        if stored is not None:
            return f"its parameter {name} is {stored}"
    for name, module in model.named_modules():
        library = _library(type(module))
        if library is not None:
            return f"its module {name or '(the model)'} is a {type(module).__name__} of {library}"
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        return f"transformers quantized it as it loaded (model.hf_quantizer is a {type(quantizer).__name__})"
    if getattr(model, "is_quantized", False) is True:
        return "model.is_quantized is True"
    config = getattr(model, "config", None)
    if getattr(config, "_is_quantized", False) is True:
        return "its config says transformers quantized it (config._is_quantized is True)"
    return None


def _stored_quantized(p: torch.Tensor) -> str | None:
    """How a parameter is stored quantized ("int8", "float8_e4m3fn", "a Params4bit of bitsandbytes"); None for
    a plain floating-point one."""
    for cls in (type(p), type(getattr(p, "data", p))):
        library = _library(cls)
        if library is not None:
            return f"a {cls.__name__} of {library}"
    if p.dtype in _NARROW_FLOATS or not (p.is_floating_point() or p.is_complex()):
        return f"{str(p.dtype).replace('torch.', '')} ({type(p).__name__} of shape {tuple(p.shape)})"
    return None


def _library(cls: type) -> str | None:
    """The quantization library that defines `cls` (its top package), or None."""
    module = getattr(cls, "__module__", "") or ""
    for prefix in _LIBRARIES:
        if module == prefix or module.startswith(prefix + "."):
            return prefix.split(".")[0]
    return None


def _described(model: nn.Module) -> str | None:
    """quantization() of the model's config, or of its hf_quantizer's quantization_config."""
    config = getattr(model, "config", None)
    described = None if config is None else quantization(config)
    if described is None:
        found = getattr(getattr(model, "hf_quantizer", None), "quantization_config", None)
        described = None if found is None else quantization({"quantization_config": found})
    return described


def _method(config: Any) -> tuple[str | None, dict]:
    """(quant_method, the quantization_config as a dict), or (None, {}) without one."""
    found = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config",
                                                                                      None)
    if found is None and not isinstance(config, dict) and hasattr(config, "get_text_config"):
        found = getattr(config.get_text_config(), "quantization_config", None)
    if found is None:
        return None, {}
    details = found if isinstance(found, dict) else found.to_dict() if hasattr(found, "to_dict") else vars(found)
    method = details.get("quant_method")
    method = getattr(method, "value", method)      # transformers' QuantizationMethod is a str Enum
    return (str(method).lower() if method else "unnamed method"), details
