"""The project's own errors: each names what is wrong and how to fix it."""


class MegacompileError(Exception):
    """Base class of every error megacompile raises on purpose."""


class BudgetTooSmallError(MegacompileError):
    """No schedule fits the device-memory budget."""

    def __init__(self, message: str, minimum_bytes: int):
        super().__init__(message)
        self.minimum_bytes = minimum_bytes


class HostMemoryError(MegacompileError):
    """The host RAM budget cannot hold the fp32 masters and AdamW state. `facts`: what a script
    needs beside the message, where the planner knows it (smallest_host_budget_bytes,
    trainable_params, host_placements: each placement's RAM, disk and tier bytes); `megacompile
    plan --json` writes them as fields."""

    def __init__(self, message: str, facts: dict | None = None):
        super().__init__(message)
        self.facts = dict(facts or {})


class BudgetExceededError(MegacompileError):
    """The runtime was asked to hold more device bytes than the budget allows."""


class CaptureError(MegacompileError):
    """The model could not be captured as a graph."""


class LossError(MegacompileError):
    """The model's output does not give a scalar loss."""


class InputMismatchError(MegacompileError):
    """step() or forward was called with inputs unlike the ones the plan was built for, or that
    the model cannot take (token ids outside the vocabulary, tensors on another device)."""


class PlanVerificationError(MegacompileError):
    """A schedule broke an invariant (use before definition, read after evict, peak over budget)."""


class OptimizerInputError(MegacompileError, ValueError):
    """Bad arguments or buffers given to the host optimizer."""


class NonFiniteError(MegacompileError):
    """A step's loss or a gradient is inf or NaN (with compile(..., on_nonfinite="raise")); nothing
    was updated."""


class PartialStepError(MegacompileError):
    """A step failed after some of its host updates had run (compile(..., updates="as_gradients_land")):
    the masters hold part of a step, so the engine trains, saves and exports nothing more until
    load_checkpoint() puts a whole state back."""


class ArgumentError(MegacompileError, ValueError):
    """An argument of compile(), plan(), AdamW or the command line has the wrong type or lies out
    of range (a budget of inf or True, a device "gpu", a sequence length of 0)."""


class CheckpointError(MegacompileError, OSError):
    """A checkpoint (or a training run's log) could not be written (the path is a folder, lies under
    a file, is not writable, or the disk is full); the previous file at that path, if any, is
    untouched, and a log keeps every row before the one refused."""


class RetraceWarning(UserWarning):
    """Inputs keep changing shape, and each new shape is traced and planned again."""


class StorageError(MegacompileError, OSError):
    """The disk tier that holds AdamW state or masters failed: the disk is full, a state file was
    deleted or truncated under the run, an I/O error, or a block read back does not match its
    checksum. The message names the file; the run cannot go on from that state."""


class WeightsFileError(MegacompileError):
    """A weights or checkpoint file is missing, truncated, corrupt, uncommitted or of another
    model; nothing was loaded."""


class DistributedError(MegacompileError):
    """A collective between the ranks of a data-parallel run failed: a rank raised, died or stopped
    answering within the timeout. The message names the rank that failed first, when it said so."""
