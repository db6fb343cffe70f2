"""An engine's threads end cleanly: when the script ends right after step() (the update still
running on the host stream), when the engine is dropped without close(), and from a finaliser."""
from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import pytest
import torch

import megacompile
from megacompile.runtime import make_backend, shutdown

_MODEL = """
import torch, megacompile
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
kernel = {kernel!r}
ids = torch.randint(0, 256, (2, 17))
def adamw():
    return megacompile.AdamW(lr=1e-3, kernel=kernel)
"""

# Each script ends right after step(): its host update is still running when the interpreter exits.
_ENDINGS = {
    "compile": """
e = megacompile.compile(LlamaForCausalLM(config), hbm_budget=1.0, optimizer=adamw(),
                        compute_dtype=torch.float32, device="cpu")
e.step(input_ids=ids, labels=ids)
""",
    "from_pretrained": """
LlamaForCausalLM(config).save_pretrained({folder!r})
e = megacompile.from_pretrained({folder!r}, hbm_budget=1.0, optimizer=adamw(), device="cpu")
e.step(input_ids=ids, labels=ids)
""",
    # Masters and moments on disk: the last update reads and writes its pieces on the tier's
    # I/O pool, which the interpreter's exit would stop first.
    "disk tier": """
from megacompile.cost.host_memory import host_costs
model = LlamaForCausalLM(config)
probe = megacompile.compile(model, hbm_budget=1.0, device="cpu")
probe.step(input_ids=ids, labels=ids)
budget = host_costs(probe.plan.captured, torch.float32)[1].ram_bytes / 2**30
probe.close()
e = megacompile.compile(model, hbm_budget=1.0, optimizer=adamw(), device="cpu", nvme_dir={folder!r},
                        host_budget=budget)
e.step(input_ids=ids, labels=ids)
assert e.host.disk is not None, "the plan put nothing on disk"
""",
}


# torch's kernel is the one that aborted (it runs inside torch's C++ thread pool); the fused one
# (ctypes) exited cleanly already, so its run is in the slow tier.
@pytest.mark.parametrize("kernel", ["torch", pytest.param("fused", marks=pytest.mark.slow)])
def test_a_script_that_ends_right_after_step_exits_cleanly(tmp_path, monkeypatch, kernel):
    monkeypatch.setenv("MEGACOMPILE_TIER_PIECE", "4096")     # the disk update runs in many pieces
    runs = {}
    for name, ending in _ENDINGS.items():       # all at once: each script pays the imports
        folder = tmp_path / name.replace(" ", "_")
        script = _MODEL.format(kernel=kernel) + ending.format(folder=str(folder))
        runs[f"{name} with kernel={kernel!r}"] = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, f"{name}: exit status {run.returncode}\n{err}"
        assert "terminate" not in err, f"{name}:\n{err}"


def _tiny_engine():
    from megacompile.models.llama import LlamaConfig, TinyLlama
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=64, dim=32, layers=2, heads=4, kv_heads=2, ffn=64))
    return megacompile.compile(model, hbm_budget=1.0, device="cpu",
                               optimizer=megacompile.AdamW(lr=1e-3, kernel="torch"))


def _wait_until(condition, seconds: float = 1.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_a_dropped_engine_ends_its_threads_and_frees_its_device():
    before = set(threading.enumerate())
    engine = _tiny_engine()
    ids = torch.randint(0, 64, (2, 8))
    engine.step(input_ids=ids, labels=ids)       # the update may still run when the engine goes
    own = [t for t in threading.enumerate() if t not in before]
    assert own, "the engine started no threads"
    backend = weakref.ref(engine.backend)
    del engine      # no close(); no gc.collect(): nothing may hold the engine in a cycle
    assert _wait_until(lambda: not any(t.is_alive() for t in own)), [t.name for t in own if t.is_alive()]
    assert backend() is None, "the dropped engine's backend (its device memory) is still referenced"
    fresh = _tiny_engine()
    assert fresh.memory_stats()["device_live_bytes"] == 0
    fresh.close()


def test_close_is_idempotent_and_safe_from_a_finaliser():
    engine = _tiny_engine()
    ids = torch.randint(0, 64, (2, 8))
    engine.step(input_ids=ids, labels=ids)
    closed = []

    class Owner:        # a user's object that closes its engine when it goes
        def __del__(self):
            engine.close()
            closed.append(True)
    Owner()
    gc.collect()
    assert closed
    engine.close()
    assert engine.state_dict()      # the host state stays readable after close()
    with pytest.raises(megacompile.MegacompileError, match="closed engine"):
        engine.step(input_ids=ids, labels=ids)


def test_a_backend_ended_from_its_own_stream_does_not_wait_for_itself():
    # A dropped engine's last reference can go on its own host stream; ending the backend there
    # must hand the drain to another thread instead of deadlocking.
    backend = make_backend("cpu", 1 << 20)
    shutdown.watch(backend)
    threads = [backend.h2d._thread, backend.d2h._thread, backend.host._thread]
    backend.host_task(lambda: shutdown.end(backend), "end from the host stream").wait()
    assert _wait_until(lambda: not any(t.is_alive() for t in threads), seconds=5.0)
    shutdown.end(backend)    # a second end is a no-op
