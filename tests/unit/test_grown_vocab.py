"""io/grown_vocab.py: which stored tensors may grow into the model's rows, and the rows they get
(the stored ones kept, the padding drawn at initializer_range, the new tokens' at the mean of the
others plus noise), the same on every load and another for each tensor."""
from __future__ import annotations

import math

import torch

from megacompile.io.grown_vocab import GrownVocab

KEY, OTHER = "model.embed_tokens.weight", "lm_head.weight"


def _grown(**changes) -> GrownVocab:
    return GrownVocab(**dict(rows=64, new_ids=(50, 51), keys=frozenset({KEY, OTHER}), std=0.02, seed=3) | changes)


def test_only_its_tensors_grow_and_only_in_rows():
    grown = _grown()
    assert grown.holds(KEY, (50, 16), (64, 16)) and grown.holds(OTHER, (64, 16), (64, 16))
    assert not grown.holds("model.norm.weight", (16,), (16,))
    assert not grown.holds(KEY, (50, 8), (64, 16))          # another hidden size: another model
    assert not grown.holds(KEY, (80, 16), (64, 16))         # more rows than the model's
    assert not grown.holds(KEY, (50, 16), (128, 16))        # a model of other rows than the run's


def test_the_rows_are_the_files_the_padding_and_the_new_tokens():
    stored = torch.randn(50, 256)
    grown = _grown()
    out = grown.grow(KEY, stored)
    assert out.shape == (64, 256) and torch.equal(out[:50], stored)
    assert 0.015 < out[52:].std().item() < 0.025                           # N(0, initializer_range)
    others = torch.ones(64, dtype=torch.bool)
    others[[50, 51]] = False
    noise = out[[50, 51]] - out[others].mean(dim=0)
    assert 0.8 < noise.std().item() * math.sqrt(256) < 1.2                 # N(0, 1/sqrt(hidden)) about the mean
    assert torch.equal(out, grown.grow(KEY, stored))                       # every load makes the same rows
    assert not torch.equal(out[50:], grown.grow(OTHER, stored)[50:])       # each tensor draws its own
    assert not torch.equal(out[50:], _grown(seed=4).grow(KEY, stored)[50:])


def test_a_new_token_in_rows_the_model_had_padded_is_made_again():
    stored = torch.randn(64, 32)
    out = _grown(new_ids=(60,)).grow(KEY, stored)
    assert torch.equal(out[:60], stored[:60]) and torch.equal(out[61:], stored[61:])
    assert not torch.equal(out[60], stored[60])


def test_the_mean_is_the_other_rows_over_blocks_of_rows(monkeypatch):
    from megacompile.io import grown_vocab
    monkeypatch.setattr(grown_vocab, "_ROWS", 7)        # blocks that do not divide the rows
    stored = torch.randn(60, 16, dtype=torch.float64).float()
    grown = _grown(new_ids=(51, 50, 51), std=0.0)       # repeated ids count once; no padding draw
    out = grown.grow(KEY, stored)
    others = torch.ones(64, dtype=torch.bool)
    others[[50, 51]] = False
    generator = torch.Generator().manual_seed(grown_vocab._seed(3, KEY))
    torch.randn(4, 16, generator=generator)             # the padding rows' draw (std 0 here)
    noise = torch.randn(2, 16, generator=generator) / 4.0
    expected = out[others].double().mean(dim=0).float() + noise
    torch.testing.assert_close(out[[50, 51]], expected, rtol=0, atol=1e-6)


def test_the_file_is_read_a_block_of_rows_at_a_time_never_whole(tmp_path, monkeypatch):
    import safetensors
    from safetensors.torch import save_file

    from megacompile.io import grown_vocab
    monkeypatch.setattr(grown_vocab, "_ROWS", 7)
    stored = torch.randn(50, 16).bfloat16()
    path = str(tmp_path / "model.safetensors")
    save_file({KEY: stored}, path)
    reads, safe_open = [], safetensors.safe_open

    class Opened:
        """safe_open's file, its reads recorded: a whole tensor read is a failure."""
        def __init__(self, *args, **kwargs):
            self.file = safe_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def get_tensor(self, key):
            raise AssertionError(f"{key} read whole: twice its size held while it grows")

        def get_slice(self, key):
            inner = self.inner.get_slice(key)

            class Rows:
                def get_shape(self):
                    return inner.get_shape()

                def __getitem__(self, rows):
                    reads.append(rows.stop - rows.start)
                    return inner[rows]
            return Rows()
    from megacompile.io import source
    monkeypatch.setattr(source, "safe_open", Opened)
    grown = _grown()
    _, memory = grown.route([source.Item(path, KEY, "weight", "embed.weight")])
    out = next(iter(memory.values()))[KEY]       # what the load reads for the file's KEY
    assert reads == [7] * 7 + [1]
    assert torch.equal(out, grown.grow(KEY, stored))       # the same rows as from the whole tensor

