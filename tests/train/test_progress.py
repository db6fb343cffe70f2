"""The progress bar on a terminal shows the latest eval loss beside the training loss, from the
first step that has one on; off a terminal the lines say it on the steps that evaluated."""
from __future__ import annotations

import io
import sys

from megacompile.train.log import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _frame(progress: Progress, screen: Terminal) -> str:
    """The bar as drawn now (tqdm redraws at most every 0.1 s by itself; frames start with \\r)."""
    progress.bar.refresh()
    return screen.getvalue().rsplit("\r", 1)[-1]


def test_the_bar_shows_the_latest_eval_loss_once_there_is_one(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    progress = Progress(total=4, start=0, every=1)
    assert progress.tty
    progress.update(1, "", {"loss": "3.9000"})
    assert "loss=3.9000" in _frame(progress, screen) and "eval" not in screen.getvalue()
    progress.update(2, "", {"loss": "3.8000"}, eval_loss=3.85)
    assert "eval=3.8500" in _frame(progress, screen)
    progress.update(3, "", {"loss": "3.7000"})
    frame = _frame(progress, screen)
    assert "loss=3.7000" in frame and "eval=3.8500" in frame        # kept until the next eval
    progress.update(4, "", {"loss": "3.6000"}, eval_loss=3.5)
    assert "eval=3.5000" in _frame(progress, screen)
    progress.close()


def test_off_a_terminal_the_line_carries_the_text(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    progress = Progress(total=2, start=0, every=1)
    progress.update(1, "loss 3.9000 | eval loss 3.8500", {"loss": "3.9000"}, eval_loss=3.85)
    progress.close()
    assert "step     1/2 | loss 3.9000 | eval loss 3.8500" in capsys.readouterr().out
