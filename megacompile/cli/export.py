"""`megacompile export CHECKPOINT OUT [--config run.yaml]`: a checkpoint of a run (its best step, or
the last of a run that was stopped) written as the run writes its model at its end
(train/checkpoint_export.py)."""
from __future__ import annotations

import argparse

from ..errors import ArgumentError


def add_to(sub) -> None:
    """The `export` subcommand on the command line's subparsers."""
    from ..train.checkpoint_export import DTYPES
    e = sub.add_parser("export", help="write a checkpoint of a run as a Hugging Face model folder (with LoRA, the "
                                      "adapter in PEFT's format or the merged model), as the run writes its model")
    e.add_argument("checkpoint", metavar="CHECKPOINT",
                   help="a checkpoint folder (RUN/checkpoints/step-NNNNNN), or a run folder (RUN, RUN/checkpoints or "
                        "RUN/checkpoints/latest): its latest checkpoint, pinned against the run's keep_last while "
                        "it is read")
    e.add_argument("out", metavar="OUT", help="the folder to write the model into (made if new; its other files kept)")
    # The overrides ride on --config: argparse gives a positional list after CHECKPOINT OUT nothing
    # that follows an option.
    e.add_argument("--config", nargs="+", default=None, metavar=("RUN_YAML", "key=value"),
                   help="the run.yaml of the run that saved the checkpoint: its model folder, tokenizer, template, "
                        "added tokens and fine-tuning keys; settings after it are laid over it, as train takes "
                        "them (default: the training_args.yaml the run left in its folder)")
    e.add_argument("--merge-adapter", action=argparse.BooleanOptionalAction, default=None,
                   help="a LoRA run's checkpoint: the merged model (--merge-adapter) or the adapter in PEFT's format "
                        "(--no-merge-adapter); default: the run.yaml's merge_adapter")
    e.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="the weights' dtype (default: the run.yaml's export_dtype; a LoRA adapter is float32)")
    e.add_argument("--overwrite", action="store_true",
                   help="replace the model files OUT holds already (its other files are kept either way)")
    e.set_defaults(run=export)


def export(args: argparse.Namespace) -> int:
    from ..train.checkpoint_export import export as write
    config, overrides = (None, []) if args.config is None else (args.config[0], args.config[1:])
    odd = [item for item in overrides if "=" not in item]
    if odd:
        raise ArgumentError(f"--config {config} {' '.join(overrides)}: {odd[0]!r} is no key=value setting; give "
                            "CHECKPOINT and OUT before --config")
    print(write(args.checkpoint, args.out, config, overrides, merge_adapter=args.merge_adapter,
                dtype=args.dtype, overwrite=args.overwrite), flush=True)
    return 0
