import pytest


@pytest.fixture(autouse=True)
def torch_order_adamw(monkeypatch):
    """Parity runs use the host AdamW that follows torch's own operation order, so the eager
    reference and megacompile round alike; the fused kernel has its own tests (tests/optim)."""
    monkeypatch.setenv("MEGACOMPILE_HOST_ADAM", "torch")
