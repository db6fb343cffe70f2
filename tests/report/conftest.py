from __future__ import annotations

import pytest

import megacompile
from tests import models


@pytest.fixture(scope="module")
def planned_engine():
    """A small NanoGPT's engine with its plan made (prepared), not yet run."""
    model = models.NanoGPT(vocab=96, d=32, layers=2, heads=4)
    engine = megacompile.compile(model, hbm_budget=1.0, device="cpu")
    ids = models.batch(96, 2, 16)
    engine.prepare(idx=ids, targets=ids)
    yield engine
    engine.close()
