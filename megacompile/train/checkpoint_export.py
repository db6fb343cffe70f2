"""A checkpoint of a run written as the run writes its trained model (`megacompile export`): the
best step of a run that went on past it, or the last of a run that was stopped.

    run.yaml (the run's) -> the model as the run builds it (added tokens, rope_scaling, LoRA or
                            frozen layers), on meta
    checkpoint           -> checked against it: stage, fine-tuning keys, model config, tensors
    engine               -> never built nor stepped: its weights wait in the checkpoint's files
    trained_model.write  -> the run's own writers (save_pretrained, lora_export, policy_export: a
                            policy, or stage rm's sequence classifier), with a vision-language
                            model's processor files

A checkpoint keeps the model's config and fine-tuning keys but not the model folder, tokenizer or
template the run read: those come from the training_args.yaml the run left in its folder
(run_args.py), or from a run.yaml given beside it, as LlamaFactory's export takes its YAML beside
the adapter. The run's data is never read nor looked for (config.load's model_only), nor its tools
file, reward functions or starting adapter: a run folder exports with them gone.

Memory: the weights stream from the checkpoint's files into the export one tensor at a time for a
full or freeze run's model; a LoRA export holds what the run's own export holds (the adapters, or
for a merged model the base and the merged weights).
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import warnings

import torch
import torch.nn as nn

from ..errors import ArgumentError, MegacompileError
from . import methods, resume, resume_model, run_args, trained_model, vocab
from .resume import checkpoint_of
from .config import load

DTYPES = ("float32", "bfloat16", "float16")
_CHOICES = 3            # how many times a run folder's latest is chosen again, each removed before its pin


class _Policy(nn.Module):
    """The module a post-training run trained (its objective holds the model as `policy` and
    nothing else): the checkpoint's `policy.` names, and what the run's writers read."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy


def export(checkpoint: str, out: str, config: str | None = None, overrides: list[str] = (),
           merge_adapter: bool | None = None, dtype: str | None = None, overwrite: bool = False) -> str:
    """The model of `checkpoint` (a checkpoint folder, or a run folder: its latest) written into
    `out` as the run of `config` (its run.yaml, `overrides` laid over it as train takes them;
    None: the training_args.yaml its run left in the run folder) writes its model; merge_adapter
    and dtype in place of the run.yaml's merge_adapter and export_dtype. The checkpoint is pinned
    against the keep_last of a run still training in its folder while it is read
    (io/checkpoint_pin.py). Returns the lines that say which checkpoint it was, what `out` holds
    and what loads it."""
    with _pinned(checkpoint) as path:
        return _export(path, out, config, overrides, merge_adapter, dtype, overwrite)


@contextlib.contextmanager
def _pinned(checkpoint: str):
    """The checkpoint `checkpoint` names, pinned while inside (yielded). A run folder's latest that
    a rotation removed between its choice and its pin (a run that saved meanwhile): the latest
    again. A checkpoint folder named is read as found: one removed is refused by resume.read."""
    from ..io.checkpoint_pin import pinned
    from ..io.durable import committed
    for _ in range(_CHOICES):
        path = checkpoint_of(checkpoint)
        with pinned(path):
            if path == os.path.normpath(checkpoint) or committed(path):
                yield path
                return
    raise ArgumentError(f"the latest checkpoint of {checkpoint} was removed {_CHOICES} times before it could be "
                        "read (the run's keep_last, as it saves): give a checkpoint folder "
                        "(RUN/checkpoints/step-NNNNNN)")


def _export(path: str, out: str, config: str | None, overrides: list[str], merge_adapter: bool | None,
            dtype: str | None, overwrite: bool) -> str:
    saved = resume.read(path)       # a folder that is no committed checkpoint is refused here, by name
    if config is None:
        config = run_args.beside(path)
        if config is None:
            raise ArgumentError(f"export needs --config, the run.yaml of the run that saved {path}: its run folder "
                                f"holds no {run_args.NAME} (which a run writes as it starts) to read the model "
                                "folder, tokenizer and template from")
    _check_out(out, path, overwrite)
    c = _config(config, overrides, path)
    _check_run(c, saved, config, merge_adapter, dtype)
    if merge_adapter is not None:
        c.merge_adapter = merge_adapter
    if dtype is not None:
        c.export_dtype = dtype
    meta = _meta(c, saved, config)
    policy = _trained_as_policy(path)
    engine = _engine(c, meta, _objective(c, policy))
    try:
        _load(engine, path, config)
        trained_model.write(c, engine, _tokenizer(c), out, overwrite=overwrite, policy=policy)
    finally:
        engine.close()
    return f"checkpoint: {path} (step {saved.steps_done})\n" + trained_model.last_line(c, out, path)


def _config(config: str, overrides: list[str], path: str):
    """The run's settings for its model alone: its data files may be gone since (config.load's
    model_only). A model folder or tokenizer gone is refused, saying how to name where it is now."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):     # its notes are of training, not of the export
            return load(config, list(overrides), model_only=True)
    except ArgumentError as e:
        if not re.search(r"\b(model|tokenizer): .+ does not exist; give", str(e)):
            raise
        raise ArgumentError(f"{e} ({config}, the settings of the run that saved {path}: export reads the model "
                            f"folder and tokenizer the run trained from; where they are elsewhere now, give --config "
                            f"{config} model=FOLDER (or tokenizer=FOLDER))") from e


def _check_out(out: str, checkpoint: str, overwrite: bool) -> None:
    """Before anything is read: `out` is a folder (or none yet) holding no model, unless overwrite."""
    from ..io.hf_save import export_files
    if os.path.exists(out) and not os.path.isdir(out):
        raise ArgumentError(f"OUT {out} is a file: give a folder to write the model into")
    if os.path.realpath(out) == os.path.realpath(checkpoint):
        raise ArgumentError(f"OUT {out} is the checkpoint itself: give another folder")
    inside = _checkpoint_around(out)
    if inside is not None:
        raise ArgumentError(f"OUT {out} lies inside the checkpoint {inside}, which the run's keep_last removes with "
                            "everything in it: give a folder outside it")
    found = export_files(out)
    if found and not overwrite:
        shown = ", ".join(found[:6]) + (", ..." if len(found) > 6 else "")
        raise ArgumentError(f"OUT {out} already holds a model ({shown}): give another folder, or --overwrite to "
                            "replace those files (the folder's other files are kept either way)")


def _checkpoint_around(out: str) -> str | None:
    """The committed checkpoint folder `out` lies in, if any."""
    from ..io.checkpoint import MARKER
    folder = os.path.realpath(out)
    while True:
        if os.path.isfile(os.path.join(folder, MARKER)):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def _check_run(c, saved: resume.Saved, config: str, merge_adapter: bool | None, dtype: str | None) -> None:
    """The run file describes the run that saved the checkpoint, and asks for an export this
    command writes."""
    if c.bundled:
        raise ArgumentError(f"{config} trains the bundled model, which is no Hugging Face model: its weights are in "
                            "the checkpoint itself (engine.load_checkpoint reads it)")
    stage = (saved.extra.get("stage") or {}).get("stage", "sft")
    if stage != c.stage:
        raise ArgumentError(f"{saved.path} was saved by a stage {stage} run and {config} is a stage {c.stage} run: "
                            "give the run.yaml of the run that saved it")
    before, now = saved.extra.get("finetuning") or {"finetuning_type": "full"}, methods.saved(c)
    # A key only one side holds (one added since the checkpoint was saved) is not compared.
    changed = [f"{k} {before[k]!r} -> {now[k]!r}" for k in before if k in now and before[k] != now[k]]
    if changed:
        raise ArgumentError(f"{saved.path} trained other parameters than {config} says ({', '.join(changed[:4])}): "
                            "give the run.yaml of the run that saved it, or set those keys back (key=value)")
    if merge_adapter is not None and not methods.adapters(c):
        raise ArgumentError(f"--merge-adapter: {saved.path} is of a finetuning_type "
                            f"{now.get('finetuning_type')} run, which "
                            "has no adapter to merge; leave the flag out")
    if c.pissa_init:
        # The adapters trained over the residual base, made from the initial adapters the run keeps
        # in its folder (methods/pissa.py's INITIAL); the checkpoint holds neither.
        raise ArgumentError(f"{saved.path} is of a PiSSA run (pissa_init), whose adapters trained over the residual "
                            "base its run made from the initial adapters it keeps in its folder, not in the "
                            "checkpoint: the run writes its model at its end (export, merge_adapter)")
    if dtype is not None and dtype not in DTYPES:
        raise ArgumentError(f"--dtype is one of {', '.join(DTYPES)}; got {dtype!r}")


def _meta(c, saved: resume.Saved, config: str) -> nn.Module:
    """The run's model on meta, as loop.py builds it, its config checked against the checkpoint's."""
    from .model import meta_model
    meta = meta_model(c)
    for said in vocab.resolve(c, meta):
        print(said, flush=True)
    if c.grown is not None:
        meta = meta_model(c)      # built again with the grown vocabulary
    before = saved.extra.get(resume_model.KEY)
    changed = resume_model.changes(before, resume_model.saved(meta)) if isinstance(before, dict) else []
    if changed:
        raise ArgumentError(f"{saved.path} was saved by a run of a model configured otherwise than {config} builds "
                            f"it ({', '.join(changed[:4])}): give the run.yaml of the run that saved it")
    return methods.apply(c, meta, [])


def _trained_as_policy(path: str) -> bool:
    """Whether the checkpoint's names are an objective's (`policy.`): every stage but sft and pt,
    and those under an objective of their own (loss_type dft, moe_aux_loss_coef)."""
    import json

    from ..io.checkpoint import MANIFEST
    from ..io.header import read_header
    with open(os.path.join(path, MANIFEST)) as f:     # checked by resume.read; the files' hashes by the load
        files = json.load(f)["files"]
    return any(key.partition("/")[2].startswith("policy.") for file in files
               if os.path.isfile(os.path.join(path, file))       # one missing: the load names it
               for key in read_header(os.path.join(path, file)))


def _objective(c, policy: bool):
    """What the run wrapped its model in (its stage's objective), as far as the checkpoint's names
    and the writers go: a reward model's decoder and head (stage rm), a policy, or nothing."""
    if c.stage == "rm":
        from .stages.rm import reward_model
        return lambda model: reward_model(c, model)
    return _Policy if policy else None


def _engine(c, meta: nn.Module, wrap):
    """An engine over the module the run trained, its weights waiting in the model folder's files
    until the checkpoint's take their place; on the cpu, since it never steps."""
    from .model import adamw, compile_module, make_module
    module = make_module(c, meta, wrap, quiet=True)
    return compile_module(c, module, c.hbm_budget or 1.0, wrap, optimizer=adamw(c, c.lr), device="cpu",
                          compute_dtype=getattr(torch, c.compute_dtype))


def _load(engine, path: str, config: str) -> None:
    """The checkpoint's weights in place of the folder's (its files read when written). The run's
    optimizer settings are not the export's: a difference is no note here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            engine.load_checkpoint(path, strict=False)
        except MegacompileError as e:
            raise type(e)(f"{e} (the model {config} builds)") from e


def _tokenizer(c):
    """What the run saves beside its model: its tokenizer (its folder's, with the run's template and
    added tokens), or for a vision-language model folder the processor the stages read images with."""
    from .data import grid_images
    from .data.tokens import load_tokenizer
    folder = c.tokenizer or c.model
    grid_images.check_template(c, folder)
    tokenizer = load_tokenizer(folder, c.chat_template, c.template, c.model)
    vocab.add(tokenizer, c)
    return grid_images.for_run(c, tokenizer, folder) or tokenizer
