"""LlamaFactory's keys for what megacompile does not do (train/their_llamafactory.py): a config
that carries them at LlamaFactory's defaults, as its web UI and examples write them, loads as if
they were not there; away from the default each is refused naming its reason, or, where
LlamaFactory's training does not read it either (its inference and export keys), named in the
run's note of ignored keys. None of them is an unknown key."""
from __future__ import annotations

import pytest

from megacompile.errors import ArgumentError
from megacompile.train import load
from megacompile.train.their_llamafactory import KEYS, NO_EFFECT
from tests.train import files

# Values away from each default, of the kind LlamaFactory takes
OTHER = {bool: lambda d: not d, int: lambda d: d + 7, float: lambda d: d * 3 + 1, str: lambda d: d + "_other",
         type(None): lambda d: "some_value"}


def _yaml(tmp_path, **settings) -> str:
    (tmp_path / "d.jsonl").write_text('{"text": "a b"}\n')
    return files.run_yaml(str(tmp_path / "run.yaml"), **{"data": "d.jsonl", "run_dir": "run", "steps": 2, **settings})


def test_every_key_at_its_default_asks_for_nothing(tmp_path, capsys):
    plain = load(_yaml(tmp_path))
    capsys.readouterr()
    c = load(_yaml(tmp_path, **{k: d for k, (d, _) in (KEYS | NO_EFFECT).items()}))
    assert c == plain
    said = capsys.readouterr().out
    assert not any(k in said for k in KEYS | NO_EFFECT)


def test_a_key_away_from_its_default_is_refused_naming_why(tmp_path):
    for key, (default, why) in KEYS.items():
        with pytest.raises(ArgumentError) as e:
            load(_yaml(tmp_path, **{key: OTHER[type(default)](default)}))
        assert f"{key} -> {why}" in str(e.value) and "unknown key" not in str(e.value), key


def test_a_key_its_training_does_not_read_either_is_named_as_ignored(tmp_path, capsys):
    for key, (default, why) in NO_EFFECT.items():
        load(_yaml(tmp_path, **{key: OTHER[type(default)](default)}))
        assert f"ignored (no effect in a megacompile run): {key} ({why})" in capsys.readouterr().out, key
