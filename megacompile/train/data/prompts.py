"""GRPO's prompt records, as TRL's GRPOTrainer reads them, from TRL's layout or LlamaFactory's
supervised layouts: each read as {"prompt": text or messages, **the columns the reward functions
are handed by name}.

    TRL       {"prompt": text or [messages], ...}: every other column goes to the reward functions
    alpaca    {"instruction", "input", "output", "system", "history"}: the prompt is the messages
              alpaca.py builds before the answer (system, history, instruction + "\\n" + input);
              `output` (the reference answer) and every other column go to the reward functions
    sharegpt  {"conversations" or "messages", "system"}: the prompt is the conversation up to its
              last user turn; the conversation, whole (as [{role, content}], its answers included),
              and every other column go to the reward functions

The reward functions get each column under the file's own name: a dataset_info.json entry whose
`columns` map `response` to `answer` hands them `answer=`, as the file names it. The images column
keeps the file's name too (`PromptRecord.images_column`), and is handed as pictures under it.
"""
from __future__ import annotations

from ...errors import ArgumentError
from . import alpaca, sharegpt
from .entries import COLUMNS

LAYOUTS = ("TRL's {prompt, ...} (text or messages), or LlamaFactory's alpaca {instruction, input, ...} or "
           "sharegpt {conversations, ...}")
# Columns TRL keeps from the reward functions: they are the rollout's own (chat_template_kwargs
# is the prompt's rendering: data/tools.py).
NOT_HANDED = ("prompt", "completion", "completion_ids", "chat_template_kwargs")


def file_names(entry: dict) -> dict[str, str]:
    """A record's keys after dataset_info.json's `columns` renamed them -> the file's names."""
    return {COLUMNS[ours]: theirs for ours, theirs in (entry.get("columns") or {}).items()}


class PromptRecord(dict):
    """A prompt record as the reward functions are handed it; `images_column`: the name its images
    column goes by there (the file's, where dataset_info.json renamed it), whose paths are handed
    as the pictures (stages/prompt_images.handed)."""
    images_column = "images"


def prompt_record(record: dict, where: str, names: dict[str, str] | None = None,
                  vision: bool = False) -> PromptRecord:
    """{"prompt": ..., **columns} for the reward functions; `names`: file_names(entry); `vision`: the
    record has images, and its turns may be lists of content parts (data/image_prompts.py)."""
    names = names or {}
    if "prompt" in record:
        prompt, used, extra = record["prompt"], ("prompt",), {}
        _check_prompt(prompt, where, vision)
    elif "instruction" in record:
        prompt, used, extra = alpaca.prompt(record, where), ("instruction", "input", "system", "history"), {}
        if not prompt[-1]["content"].strip():
            raise ArgumentError(f"{where}: the instruction and input are empty; give the question as the instruction")
    elif "conversations" in record or "messages" in record:
        turns = sharegpt.messages(record)
        _check_turns(turns, where, vision)
        users = [i for i, t in enumerate(turns) if t["role"] == "user"]
        if not users:
            raise ArgumentError(f"{where}: the conversation has no user turn to prompt with; give the question as a "
                                "turn from human (role: user)")
        column = "messages" if "messages" in record else "conversations"
        prompt, used = turns[:users[-1] + 1], (column, "system")
        extra = {names.get(column, column): [t for t in turns if t["role"] != "system"]}
    else:
        raise ArgumentError(f"{where}: a grpo record is {LAYOUTS}; this one has "
                            f"{', '.join(sorted(record)) or 'no keys'}: give each record its prompt")
    columns = {names.get(k, k): v for k, v in record.items() if k not in used}
    out = PromptRecord({"prompt": prompt, **{k: v for k, v in {**columns, **extra}.items() if k not in NOT_HANDED}})
    out.images_column = names.get("images", "images")
    return out


def _check_prompt(prompt, where: str, vision: bool) -> None:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ArgumentError(f"{where}: the prompt is empty; give the question as its text")
        return
    if not isinstance(prompt, list):
        raise ArgumentError(f"{where}: prompt is text or a list of messages {{role, content}}; got {prompt!r}"[:300])
    _check_turns(prompt, where, vision)


def _check_turns(turns, where: str, vision: bool = False) -> None:
    if not isinstance(turns, list) or not turns or not all(_is_message(t, vision) for t in turns):
        raise ArgumentError(f"{where}: the prompt's messages are a non-empty list of {{role, content}} (or sharegpt's "
                            "{from, value}) with string values" + (" or lists of content parts" if vision else ""))


def _is_message(turn, vision: bool) -> bool:
    content = turn.get("content") if isinstance(turn, dict) else None
    return (isinstance(turn, dict) and isinstance(turn.get("role"), str)
            and (isinstance(content, str) or vision and isinstance(content, list)))
