"""Feedback records (stage kto): completions each marked desirable or undesirable, read as TRL's
unpaired layout {prompt, completion, label} for posttrain/preference.py to tokenise.

    TRL unpaired   {"prompt", "completion", "label": true | false}: text, or lists of messages
    TRL paired     {"prompt", "chosen", "rejected"} (any of dpo's layouts): two examples, the chosen
                   completion desirable, the rejected one not, as TRL's KTOTrainer unpairs them
                   (unpair_preference_dataset: each 1000 records' chosen ones, then their rejected)
    LlamaFactory   a sharegpt conversation (or messages) ending with the assistant's answer, or an
                   alpaca record (instruction, input, output), with the `kto_tag` column (bool),
                   which dataset_info.json's columns rename to `label`: the answer is the completion,
                   the turns before it the prompt

A record's `tools` and chat_template_kwargs go with it (posttrain/preference.py renders them).
"""
from __future__ import annotations

from ...errors import ArgumentError
from ...posttrain import trl_record
from . import alpaca, sharegpt
from .ranking import preference

LAYOUTS = ("TRL's unpaired {prompt, completion, label} or paired {prompt, chosen, rejected}, or LlamaFactory's "
           "kto_tag datasets (a sharegpt conversation or an alpaca record, with its kto_tag column as label)")
UNPAIR_BATCH = 1000     # datasets' map batch in which TRL's unpair_preference_dataset orders its examples


def llamafactory_pairing(entries: list) -> bool:
    """Whether a KTO run's KL rows are paired as LlamaFactory pairs them (stages/kto.py): every
    training entry is one of its kto_tag datasets (dataset_info.json names the column)."""
    return bool(entries) and all("kto_tag" in (e.get("columns") or {}) for e in entries)


def is_paired(record: dict) -> bool:
    return "chosen" in record or "rejected" in record


def unpaired(record: dict, where: str, shown: bool = False) -> list[dict]:
    """A paired record's two examples, {prompt, completion, label}: the chosen one, the rejected one.
    `shown`: the record has images, read by a vision-language model's processor, and is laid out as
    stage dpo reads such a pair (ranking.py; its turns may be content parts, data/image_answers.py)."""
    pair = preference(record, where) if shown else trl_record(record, where)
    return [{"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
            {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False}]


def example(record: dict, where: str) -> dict:
    """An unpaired record as {prompt, completion, label}, prompt and completion both text or both
    lists of messages."""
    if "label" not in record:
        raise ArgumentError(f"{where}: a KTO record is {LAYOUTS}; this one has no label (kto_tag): "
                            f"it has {', '.join(sorted(record)) or 'no keys'}")
    label = record["label"]
    if not isinstance(label, bool):
        raise ArgumentError(f"{where}: label (kto_tag) says whether the completion is desirable: true or false; got "
                            f"{label!r}")
    if "messages" in record or "conversations" in record:
        turns = sharegpt.messages(record, where)
        if not isinstance(turns, list) or len(turns) < 2 or not isinstance(turns[-1], dict) or \
                turns[-1].get("role") != "assistant":
            raise ArgumentError(f"{where}: a KTO conversation ends with the assistant's answer (the completion the "
                                "label judges), after the turns of its prompt")
        prompt, completion = turns[:-1], turns[-1:]
    elif "instruction" in record:
        if not isinstance(record.get("output"), str):
            raise ArgumentError(f"{where}: an alpaca KTO record's output (the completion the label judges) is a "
                                "string")
        prompt, completion = alpaca.prompt(record, where), [{"role": "assistant", "content": record["output"]}]
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
    else:
        raise ArgumentError(f"{where}: a KTO record is {LAYOUTS}; this one has {', '.join(sorted(record))}")
    text = isinstance(prompt, str) and isinstance(completion, str)
    turns = all(isinstance(x, list) and x and all(isinstance(m, dict) for m in x) for x in (prompt, completion))
    if not (text or turns):
        raise ArgumentError(f"{where}: prompt and completion are both text or both lists of messages "
                            '([{"role": "user", "content": ...}] and [{"role": "assistant", "content": ...}])')
    if text and not prompt.strip():
        raise ArgumentError(f"{where}: the prompt is empty; KTO judges each completion given its prompt: give one")
    return {"prompt": prompt, "completion": completion, "label": label}
