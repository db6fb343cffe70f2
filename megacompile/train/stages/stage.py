"""What a stage is to the run's one loop (train/loop.py): it reads its data, gives the engine its
objective and the shapes of a training step, makes each optimizer step and its log row, evaluates,
and names what its checkpoints carry beside the data position."""
from __future__ import annotations

CHECKPOINTS = "checkpoints"     # the run folder's folder of checkpoints (one step-NNNNNN each)


class Stage:
    columns: tuple = ()         # the log's columns (log.COLUMNS and the stage's own figures)
    tokenizer = None            # what the trained model's folder saves beside it
    fingerprint: str = ""       # what the data position refers to (a resume checks it)
    # how the data tokenizes (train/tokenized.py), which a resume checks too; None where the
    # fingerprint is the tokens' own sha256 (a token file)
    tokenized: dict | None = None
    needs_reference = False     # a second engine over the model as loaded, forward only (`reference`)
    media = None                # a vision-language run's processor (data/images.Media): its pixels are host memory

    @staticmethod
    def check_model(c, meta) -> None:
        """Refuse, before any data is read, a model this stage cannot train as configured."""

    @staticmethod
    def check_resume(c, saved) -> None:
        """Refuse a checkpoint this stage cannot go on from (beyond the checks every stage makes)."""

    def steps_for(self, epochs: float) -> int:
        raise NotImplementedError

    def epoch_items(self) -> tuple[int, str] | None:
        """The items an epoch holds and what they are ("rows", "pairs"), where a step takes
        epochs.per_step of them; None where an epoch's length is unknown or counted otherwise."""
        return None

    def commit(self, run_dir: str) -> None:
        """Put what the stage made while reading its data in the run folder (every check passed)."""

    def discard(self) -> None:
        """Drop what the stage made while reading its data (a check failed: nothing is left)."""

    # objective(policy) -> the module the engine trains in place of the model (a post-training
    # objective, posttrain/); None: the engine trains the model itself.
    objective = None

    def first_inputs(self, batch: int) -> dict:
        raise NotImplementedError

    def heaviest_inputs(self, batch: int) -> dict | None:
        """A micro-batch whose shapes need more device memory than the first's, for the default
        budget to fit too; None: the first micro-batch stands for all."""
        return None

    def forward_inputs(self, batch: int) -> dict | None:
        """The inputs of the stage's forward-only pass at its heaviest, where its smallest plan may
        need more device memory than a training step's (a vision-language model's), for the default
        budget to fit it too; None: the training step's budget fits it."""
        return None

    def device_beside(self, meta, card_bytes: int) -> list:
        """What the stage holds on a GPU of `card_bytes` beside the engine's plans for the whole run
        (train/beside.py's Beside): taken out of the device budget before planning."""
        return []

    def host_beside(self, meta, device: str) -> list:
        """What the stage holds in host memory beside the engine's state for the whole run
        (train/beside.py's Beside): taken out of the host budget before the state is placed. With
        images (`media`), the pixels kept for the images read again and the heaviest micro-batch's
        pixel inputs."""
        if self.media is None:
            return []
        from .. import beside
        batch = self.c.global_batch or self.c.batch      # the largest micro-batch the planner may choose
        inputs = self.heaviest_inputs(batch) or self.first_inputs(batch)
        pixels = beside.pixel_inputs(inputs, f"a micro-batch's pixel inputs, at the heaviest {batch} rows'")
        return beside.kept_pixels() + pixels if pixels else []       # a model shown no images reads none

    def begin(self, engine, run_dir: str, saved: dict | None, batch: int) -> None:
        """The engine is built and resumed: the stage's own state from the checkpoint's `saved`."""

    def describe(self, setup) -> list[str]:
        """Lines the run prints under the plan's summary."""
        return []

    def step(self, engine, position: int) -> tuple[dict, list, int | None, int]:
        """One optimizer step from data position `position`: (the row's own figures, the
        micro-batches' losses, tokens trained on, the position after)."""
        raise NotImplementedError

    def step_loss(self, losses: list[float]) -> float:
        """The logged loss of a step whose micro-batches' losses are `losses` (at least one): their mean."""
        return sum(losses) / len(losses)

    def evaluate(self, engine, step: int) -> dict:
        return {}

    def progress(self, row: dict, budget_bytes: int) -> tuple[str, dict]:
        """The progress line's text after the loss, and the bar's figures."""
        return "", {}

    def checkpoint_extra(self) -> dict:
        """What a checkpoint carries beside the data position and the settings."""
        return {}

    def same_rows(self, saved: dict) -> bool:
        """Whether the data, changed since a checkpoint (its `saved` extra), gives the rows it was
        trained on before it: then the resume goes on (a streamed run's, train/data/stream_digest.py)."""
        return False

    def close(self) -> None:
        pass
