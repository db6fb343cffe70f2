"""A sequence longer than the model's context plans with a note (rope scaling may extend the
context, so it is not refused), in the text and the JSON."""
from __future__ import annotations

import json

from megacompile.cli import main

CONFIG = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": 64}


def _plan(tmp_path, capsys, seq: int) -> tuple[dict, str]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    assert main(["plan", "--config", str(path), "--hbm-budget", "1", "--batch", "1", "--seq", str(seq),
                 "--host-budget", "4", "--json"]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_a_seq_past_the_context_is_noted_not_refused(tmp_path, capsys):
    summary, text = _plan(tmp_path, capsys, 128)
    assert summary["fits"]
    assert summary["notes"] == ["seq 128 is longer than the model's context (max_position_embeddings 64): positions "
                                "past 64 were not trained; extend the context (rope_scaling in the config) or give "
                                "seq <= 64"]
    assert "  note           seq 128 is longer than the model's context" in text


def test_a_seq_within_the_context_has_no_note(tmp_path, capsys):
    summary, text = _plan(tmp_path, capsys, 64)
    assert "notes" not in summary and "note " not in text
