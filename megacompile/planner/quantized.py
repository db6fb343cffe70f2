"""A Hugging Face config of a quantized checkpoint (GPTQ, AWQ, bitsandbytes, FP8, compressed-tensors,
MXFP4, ...): its `quantization_config` says how the stored weights are packed.

megacompile trains every parameter in float32 masters and computes in bfloat16 or float32, so such
a config is planned as the full-precision model it describes (with a note saying so), and its
checkpoint's weights are refused at load: read as plain tensors, packed integers or FP8 values
without their scales would train as wrong numbers.
"""
from __future__ import annotations

import os
from typing import Any

from ..errors import WeightsFileError

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
