"""The Engine that compile() returns, and its way in from a Hugging Face folder.

    engine.py            Engine: plans per input signature, step(), the forward, the memory picture
    host_setup.py        its host state, placed in the host budget, allocated and filled once
    state_io.py          reading and writing its state: state_dict, checkpoints, Trainer checkpoints,
                         adapters, the Hugging Face export (through io/ and distributed/, which
                         receive the TrainingState, never the engine)
    step.py              the step protocol, once: commit or leave nothing; StepRecord
    layer_major_step.py  a step's micro-batches held until the last, then run as one program
    from_pretrained.py   megacompile.from_pretrained
    prepared.py          a capture and plan made before the engine, handed to it (Engine.adopt)
"""
from .engine import Engine
from .from_pretrained import compile_folder, from_pretrained
from .prepared import Prepared, prepare, training_capture
from .skip_streak import SkipStreak
from .step import StepRecord

__all__ = ["Engine", "Prepared", "SkipStreak", "StepRecord", "compile_folder", "from_pretrained", "prepare",
           "training_capture"]
