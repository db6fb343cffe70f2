"""One record's tokens and targets (the loss mask, masking.py), in whichever layout it comes
(text, chat messages, ShareGPT, Alpaca, prompt/completion; chats with tool calls: tools.py; turns
of content parts: parts.py), with
the tokenizer's EOS closing it; a supervised record longer than the row is truncated as
LlamaFactory truncates it (cutoff.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import ArgumentError
from . import alpaca, images, list_contents, masking, parts, sharegpt, tools, turn_ends
from . import cutoff as cutoff_len


@dataclass
class Document:
    """One record's tokens: `record` is a supervised record (chat, Alpaca, prompt/completion),
    truncated to the row (cutoff.py) and never split across rows; plain text is not
    (`record` False). `cut`: the tokens the truncation dropped."""
    ids: list
    targets: list
    record: bool
    cut: int = 0


LOSS_KEYS = ("assistant_only_loss", "completion_only_loss")


def loss_keys(entry: dict) -> dict:
    """TRL's assistant_only_loss and completion_only_loss, where the data entry gives them
    (config_data.py): document()'s keywords."""
    return {k: entry[k] for k in LOSS_KEYS if entry.get(k) is not None}


def encode(tokenizer, record: dict, train_on_prompt: bool, where: str, media=None,
           cutoff: int | None = None, mask_history: bool = False, **loss: bool) -> tuple[list[int], list[bool]]:
    """One record's tokens and targets (document())."""
    made = document(tokenizer, record, train_on_prompt, where, media, cutoff, mask_history, **loss)
    return made.ids, made.targets


def document(tokenizer, record: dict, train_on_prompt: bool, where: str, media=None,
             cutoff: int | None = None, mask_history: bool = False, assistant_only_loss: bool | None = None,
             completion_only_loss: bool | None = None) -> Document:
    """One record's tokens and targets, with the tokenizer's EOS closing the document (unless a
    chat template closed it with a token that ends a turn, _closed()); a supervised record longer than `cutoff`
    tokens truncated as LlamaFactory truncates it (cutoff.py). `media` (images.Media, a
    vision-language model's processor): its image paths resolved and checked, the document written
    as the processor writes it (images.py; such a record is never truncated: a row too short for it
    is refused); without it a record with images is refused. `mask_history` (LlamaFactory's): a conversation's last answer alone is
    trained, and its truncation keeps the last turns.

    Which tokens are targets: `train_on_prompt` (LlamaFactory's): every token of every layout.
    Else TRL's two settings, where given (None: not given, megacompile's default, true for both),
    each for its layouts as TRL reads it: `assistant_only_loss` false trains every token of a
    conversation (messages, ShareGPT's conversations), true its assistant turns; `completion_only_loss`
    false trains the prompt of a prompt/completion record too, true (or null) its completion alone.
    A conversational prompt/completion record (both lists of messages) takes both, as TRL's
    targets are those in both masks: the completion's assistant turns (both true, the default); the
    whole completion, its tool turns and template text among them (assistant_only_loss false);
    every assistant turn, the prompt's too (completion_only_loss false); every token (both false).
    Alpaca records (LlamaFactory's layout) follow train_on_prompt alone; text trains every token."""
    paths = media.paths(record, where) if media is not None else []
    if media is None and images.held(record):
        kind = "videos" if record.get("videos") else "images"
        raise ArgumentError(f"{where}: the record has {kind}, and they are read only with the model folder's "
                            f"processor ({' or '.join(images.PROCESSOR_FILES)}) into a token file: give a "
                            "vision-language model saved with its processor, and streaming: false")
    answers = None          # [start, end) of each answer; None: plain text
    if "messages" in record or "conversations" in record:
        messages = parts.read(sharegpt.messages(record, where), media is not None, where)
        listed, options = tools.tools(record, where), tools.template_kwargs(record, where)
        if media is not None:
            messages = media.messages(messages, paths, where, list_contents.reads_lists_only(tokenizer))
        ids, targets, answers = masking.chat(tokenizer, messages, train_on_prompt or assistant_only_loss is False,
                                             where, listed, options, last_only=mask_history)
        if paths:
            ids, targets = media.widen(ids, targets, paths, where, tokenizer, messages,
                                       {**options, **({"tools": listed} if listed else {})})
    elif paths:
        raise ArgumentError(f"{where}: a record with images or videos is a conversation (messages, or ShareGPT's "
                            "conversations) whose turns hold an <image> placeholder per image (<video> per video)")
    elif alpaca.is_alpaca(record):
        ids, targets, answers = masking.chat(tokenizer, alpaca.messages(record, where), train_on_prompt, where,
                                             template_kwargs=tools.template_kwargs(record, where),
                                             last_only=mask_history)
    elif "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) and isinstance(completion, list):     # TRL's conversational layout
            messages = parts.read(sharegpt.messages({"messages": prompt + completion}, where), False, where)
            every = train_on_prompt or (assistant_only_loss is False and completion_only_loss is False)
            ids, targets, answers = masking.chat(tokenizer, messages, every, where,
                                                 tools.tools(record, where), tools.template_kwargs(record, where),
                                                 first=len(prompt), prompt_turns=completion_only_loss is False,
                                                 whole_completion=assistant_only_loss is False)
            if not answers:
                raise ArgumentError(f"{where}: the completion holds no assistant turn; give the answer as "
                                    '[{"role": "assistant", "content": ...}]')
        elif not (isinstance(prompt, str) and isinstance(completion, str)):
            raise ArgumentError(f"{where}: a prompt/completion record needs both, as strings or both as lists of "
                                "messages (TRL's conversational layout)")
        else:
            ids, targets, answers = masking.prompt_completion(tokenizer, prompt, completion,
                                                              train_on_prompt or completion_only_loss is False)
    elif isinstance(record.get("text"), str):
        ids, targets = masking.text(tokenizer, record["text"])
    elif "text" in record:
        held = "null" if record["text"] is None else f"a {type(record['text']).__name__}"
        raise ArgumentError(f"{where}: text is {held}; a text record's text is a string (leave the record out, or "
                            "give it its text)")
    else:
        raise ArgumentError(f"{where}: a record is in none of the layouts read: text; messages; ShareGPT's "
                            "conversations (from/value); prompt and completion; Alpaca's instruction, input, output "
                            f"(history, system); this one has {', '.join(sorted(record)) or 'no keys'}")
    eos = tokenizer.eos_token_id
    if eos is not None and (not ids or ids[-1] != eos) and not _closed(tokenizer, ids, answers):
        if answers and answers[-1][1] == len(ids):      # the EOS closes the last answer
            answers[-1] = (answers[-1][0], len(ids) + 1)
        ids, targets = ids + [eos], targets + [targets[-1] if targets else True]
    whole = len(ids)
    if cutoff is not None and answers is not None and not paths:
        ids, targets = cutoff_len.truncate(ids, targets, answers, cutoff, last_first=mask_history)
    return Document(ids, targets, answers is not None, whole - len(ids))


def _closed(tokenizer, ids: list[int], answers: list | None) -> bool:
    """Whether the chat template closed the last answer with a token that ends a turn, only
    whitespace after it: the EOS, or a token the model folder's generation config stops at
    (turn_ends.py). ChatML's <|im_end|> and a newline, where <|im_end|> is the EOS (Qwen's
    tokenizers); Gemma's <end_of_turn> and a newline. TRL and LlamaFactory add nothing after such
    a conversation, and neither does megacompile."""
    if not answers:
        return False
    ends = turn_ends.of(tokenizer)
    tail = ids[answers[-1][0]:]
    last = max((i for i, t in enumerate(tail) if t in ends), default=None)
    if last is None:
        return False
    after = tail[last + 1:]
    return not after or not tokenizer.decode(after).strip()
