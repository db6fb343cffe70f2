"""run.yaml's data keys: which records a run reads, and how each data entry reads them (its chat
template, media folder, system prompt, tools, masking), laid into the entries before any file is
opened; LlamaFactory's image and video keys. `c` is the RunConfig being checked (config.py), `raw`
the keys as given."""
from __future__ import annotations

import os

from ..errors import ArgumentError
from .config_values import flag, integer, number, pixels, text
from .data import entries, named_template, run_tools, template_file, tools


def check_data(c, raw: dict, files: bool = True) -> None:
    """The data keys, checked and laid into each data entry: the files or LlamaFactory's named
    datasets, the held-out data, the mixture, the chat template, media folder, system prompt and
    masking that each record is read with, and what streaming cannot do. files False: the data
    files, dataset_info.json and media_dir are not looked at (a run read for its model alone)."""
    if c.dataset is not None:       # LlamaFactory's keys: names in dataset_dir/dataset_info.json
        if "data" in raw:
            raise ArgumentError("data and dataset both name the training data: give one of them")
        c.data = entries.llamafactory(c.dataset, c.dataset_dir, stage=c.stage, files=files)
    elif c.dataset_dir is not None and c.eval_dataset is None:
        raise ArgumentError("dataset_dir is the folder of dataset_info.json, read for dataset: name the datasets")
    if c.eval_dataset is not None:
        if raw.get("eval"):
            raise ArgumentError("eval and eval_dataset both name the held-out data: give one of them")
        c.eval = entries.llamafactory(c.eval_dataset, c.dataset_dir, key="eval_dataset", stage=c.stage, files=files)
    c.data = entries.check("data", c.data, allow_bundled=True, allow_weights=True, files=files)
    if not c.data:
        raise ArgumentError("data: name at least one data file")
    c.mix_strategy, weights = entries.mixture(c.data, c.mix_strategy, c.interleave_probs)
    for entry, weight in zip(c.data, weights or [None] * len(c.data)):
        entry["weight"] = weight
    c.eval = entries.check("eval", c.eval if c.eval is not None else [], allow_bundled=False, allow_weights=False,
                           files=files)
    entries.by_line(c.data if c.dataset is not None else [])
    entries.by_line(c.eval if c.eval_dataset is not None else [])
    if c.max_samples is not None:       # LlamaFactory's: the first N records of each entry
        c.max_samples = integer("max_samples", c.max_samples)
        for entry in c.data + c.eval:
            entry["limit"] = c.max_samples
    if c.dataset_text_field is not None:      # renames that column to `text`, as an entry's columns do
        c.dataset_text_field = text("dataset_text_field", c.dataset_text_field)
        for entry in c.data + c.eval:
            if entry["path"] != entries.BUNDLED:
                entry["columns"] = {"text": c.dataset_text_field, **entry["columns"]}
    c.chat_template = text("chat_template", c.chat_template, optional=True)
    if c.chat_template is not None:     # its digest keys the token files made with it (tokens.py)
        if c.bundled:
            raise ArgumentError("chat_template: the bundled model reads bytes and takes no chat template; leave it "
                                "out")
        digest = template_file.digest(template_file.read(c.chat_template))
        for entry in c.data + c.eval:
            entry["chat_template"] = digest
    if c.template is not None:
        if c.bundled:
            raise ArgumentError(f"template {c.template!r}: the bundled model reads bytes and has no chat template; "
                                "leave template out")
        if c.chat_template is not None:
            raise ArgumentError(f"template {c.template!r} and chat_template both say how chats are written: give one "
                                "of them")
        digest = template_file.digest(named_template.text(named_template.check(c.template)))
        for entry in c.data + c.eval:
            entry["chat_template"] = digest
    c.media_dir = text("media_dir", c.media_dir, optional=True)
    if c.media_dir is not None:
        if files and not os.path.isdir(c.media_dir):
            raise ArgumentError(f"media_dir {c.media_dir} is not a folder; give the folder the records' image and "
                                "video paths are relative to, or leave it out (the data file's folder)")
        for entry in c.data + c.eval:
            entry["media_dir"] = os.path.abspath(c.media_dir)
    else:       # LlamaFactory's datasets: their media paths are relative to dataset_dir, its default media_dir
        named = (c.data if c.dataset is not None else []) + (c.eval if c.eval_dataset is not None else [])
        for entry in named:
            entry["media_dir"] = os.path.abspath(c.dataset_dir)
    c.default_system = text("default_system", c.default_system, optional=True)
    if c.default_system is not None:
        if c.bundled:
            raise ArgumentError("default_system: the bundled model reads bytes and has no chat template; leave it "
                                "out")
        for entry in c.data + c.eval:       # laid into each chat record that has no system message (system.py)
            entry["default_system"] = c.default_system
    c.chat_template_kwargs = tools.checked_kwargs(c.chat_template_kwargs, "chat_template_kwargs") or None
    for entry in c.data + c.eval:       # laid under each record's own as the data is read
        entry["chat_template_kwargs"] = c.chat_template_kwargs
    c.eval_fraction = number("eval_fraction", c.eval_fraction, 0.0, below=1.0)
    if c.eval and c.eval_fraction:
        raise ArgumentError("eval and eval_fraction both choose the held-out data: give one of them")
    c.train_on_prompt = flag("train_on_prompt", c.train_on_prompt)
    _trl_loss(c)
    c.mask_history = flag("mask_history", c.mask_history)
    for entry in c.data + c.eval:       # read where each record is tokenised (tokens.py, streaming.py)
        entry["mask_history"] = c.mask_history or None
    if c.stage in ("sft", "kto"):       # LlamaFactory's converter skips them; grpo's prompts end on a user turn
        for entry in c.data + c.eval:
            if entry["formatting"] == "sharegpt":
                entry["skip_broken"] = True     # conversations whose turns do not pair up (data/reading.py)
    c.streaming = flag("streaming", c.streaming)
    if c.streaming and c.eval_fraction:
        raise ArgumentError("streaming reads the data once, in order, and cannot hold out a fraction of it: give "
                            "eval files instead of eval_fraction, or streaming: false")
    if c.streaming and any(e["num_samples"] for e in c.data):
        raise ArgumentError("num_samples draws records from the whole of a dataset, which streaming does not hold: "
                            "give streaming: false, or leave num_samples out")
    if c.streaming and raw.get("epochs") is not None:
        raise ArgumentError("streaming does not know the data's size ahead, so epochs cannot be turned into steps: "
                            "give steps, or streaming: false")


def _trl_loss(c) -> None:
    """TRL's assistant_only_loss and completion_only_loss, two settings, each laid where given into
    every data entry (read as its records are tokenised, data/encoding.py): assistant_only_loss
    governs conversations (messages), completion_only_loss prompt/completion records, and both a
    conversational prompt/completion record. Null (TRL's completion_only_loss default) is not given:
    megacompile's default stands, as TRL's null means on prompt/completion records."""
    for key in ("assistant_only_loss", "completion_only_loss"):
        value = getattr(c, key)
        if value is None:
            continue
        flag(key, value)
        if value and c.train_on_prompt:
            raise ArgumentError(f"train_on_prompt: true trains every token, and {key}: true only the "
                                f"{'assistant turns' if key == 'assistant_only_loss' else 'completion'}: give one "
                                "of them")
        for entry in c.data + c.eval:
            entry[key] = value


def check_media(c) -> None:
    """LlamaFactory's image and video keys: pixel counts (whole numbers >= 1, min <= max), frames a
    second and most frames (numbers > 0). The image keys reach the processor (data/pixels.py), the
    video keys the reading of a record's videos (data/videos.py)."""
    for kind in ("image", "video"):
        low, high = f"{kind}_min_pixels", f"{kind}_max_pixels"
        for key in (low, high):
            if getattr(c, key) is not None:
                setattr(c, key, pixels(key, getattr(c, key)))
        if getattr(c, low) is not None and getattr(c, high) is not None and getattr(c, low) > getattr(c, high):
            raise ArgumentError(f"{low} {getattr(c, low):,} is above {high} {getattr(c, high):,}: an image is "
                                f"resized to at most {high} and at least {low} pixels (width x height)")
    if c.video_fps is not None:
        c.video_fps = number("video_fps", c.video_fps, 0.0, strict=True)
    if c.video_maxlen is not None:
        c.video_maxlen = integer("video_maxlen", c.video_maxlen)


def lay_tools(c, folder: str | None, files: bool = True) -> None:
    """run.yaml's tools (data/run_tools.py), laid into each data entry for its conversations;
    files False: as given, a tools file not read (a run read for its model alone)."""
    if c.tools is None or c.tools == []:
        c.tools = None
        return
    if c.bundled:
        raise ArgumentError("tools: the bundled model reads bytes and has no chat template to write tools; leave "
                            "them out")
    if c.stage == "grpo":
        raise ArgumentError("tools: stage grpo hands a record's tools column to the reward functions, and its "
                            "rollouts call no tools (TRL's GRPOTrainer(tools=...) runs them while generating); "
                            "give the tools in the prompts' records, or leave tools out")
    if files:
        c.tools = run_tools.resolve(c.tools, folder)
    for entry in c.data + c.eval:
        entry["tools"] = c.tools
