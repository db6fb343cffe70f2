"""Preference records (stage dpo) in TRL's layout or in LlamaFactory's ranking layouts, read as
TRL's {prompt, chosen, rejected} for posttrain/preference.py to tokenise.

    TRL        {"prompt", "chosen", "rejected"}: each text, or lists of messages; or
               {"chosen", "rejected"} with an implicit prompt (posttrain/preference_format.py)
    alpaca     {"instruction", "input", "chosen", "rejected"}, optional "system" and "history"
               (LlamaFactory's `ranking: true` with formatting alpaca): the prompt is built as
               alpaca.py builds an instruction record's (system, history, instruction + "\\n" + input),
               each answer one assistant turn
    sharegpt   {"conversations": [turns, the user's last], "chosen": {"from": "gpt", "value": ...},
               "rejected": {...}}, optional "system" (ranking with formatting sharegpt; OpenAI-style
               `messages` with role/content too): the turns mapped as sharegpt.py maps them

A record's `tools` (TRL's column, LlamaFactory's tools column) reach the template with its pair
(posttrain/preference.py); a chosen or rejected turn may call them (function_call). Its chat
template settings are preference_kwargs(): the prompt's earlier answers lose their thoughts under
LlamaFactory's reasoning layouts, as its pairwise encoding drops them.
A dataset_info.json entry's `columns` (prompt, query, chosen, rejected, messages, system, history)
and `tags` rename a file's own names first (reading.py), as for supervised data.
"""
from __future__ import annotations

from ...errors import ArgumentError
from . import alpaca, masking, sharegpt, tools

LAYOUTS = ("TRL's {prompt, chosen, rejected} (text or messages; the prompt may be left implicit), or "
           "LlamaFactory's ranking layouts: alpaca {instruction, input, chosen, rejected} or sharegpt "
           "{conversations, chosen, rejected}")


def preference(record: dict, where: str) -> dict:
    """The record as TRL's {prompt, chosen, rejected}, or as it is when it is in a TRL layout
    (posttrain/preference_format.py reads those, the implicit prompt included)."""
    if "chosen" not in record and "rejected" not in record and "prompt" not in record:
        raise ArgumentError(f"{where}: a preference record is {LAYOUTS}; this one has "
                            f"{', '.join(sorted(record)) or 'no keys'}")
    if "instruction" in record:
        _both(record, where, "alpaca")
        answers = [record["chosen"], record["rejected"]]
        if not all(isinstance(a, str) for a in answers):
            raise ArgumentError(f"{where}: in the alpaca ranking layout chosen and rejected are strings (the two "
                                "answers to the instruction)")
        prompt = alpaca.prompt(record, where)
        return {"prompt": prompt, **{k: [{"role": "assistant", "content": a}]
                                     for k, a in zip(("chosen", "rejected"), answers)}}
    if "prompt" not in record and ("conversations" in record or "messages" in record):
        _both(record, where, "sharegpt")
        prompt = sharegpt.messages(record, where)
        _check_turns(prompt, where, "conversations")
        if prompt[-1]["role"] not in ("user", "tool"):
            raise ArgumentError(f"{where}: in the sharegpt ranking layout the conversation ends with the user's turn "
                                "or a tool's answer (observation; chosen and rejected answer it); its last turn is "
                                f"{prompt[-1]['role']!r}")
        out = {"prompt": prompt}
        for k in ("chosen", "rejected"):
            answer = sharegpt.messages({"messages": [record[k]]}, where)
            _check_turns(answer, where, k)
            if answer[0]["role"] != "assistant":
                raise ArgumentError(f"{where}: {k} is the model's turn (from: gpt, or role: assistant); got role "
                                    f"{answer[0]['role']!r}")
            out[k] = answer
        return out
    return record


def preference_kwargs(record: dict, where: str) -> dict:
    """The chat template settings a preference or feedback record (stages dpo, rm and kto) is rendered
    with: its own (tools.template_kwargs) and mask_history, as stage sft sets it (masking.py).
    LlamaFactory's pairwise and feedback encodings (its ReasoningTemplate's encode_oneturn) write
    the prompt's earlier answers without their thoughts unless preserve_thinking is set, whatever
    enable_thinking says, and give them no empty think block; the answer keeps its own thoughts
    (enable_thinking false drops them, and writes the empty block before it, as prompt). The
    reasoning layouts (named_template.py) write that under mask_history, the answer being the last."""
    return masking.masked_history(tools.template_kwargs(record, where))


def _both(record: dict, where: str, layout: str) -> None:
    missing = [k for k in ("chosen", "rejected") if k not in record]
    if missing:
        raise ArgumentError(f"{where}: a record in LlamaFactory's {layout} ranking layout needs chosen and rejected; "
                            f"missing {', '.join(missing)}: give each record both answers")


def _check_turns(turns, where: str, key: str) -> None:
    if not isinstance(turns, list) or not turns or not all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str) for t in turns):
        raise ArgumentError(f"{where}: {key} holds turns {{from, value}} (or {{role, content}}) with string values")
