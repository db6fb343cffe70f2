"""Packed rows: `isolated` packing keeps documents from attending to each other, so the loss of a
packed row is the sum of its documents' own losses; rows are a pure function of their index."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import megacompile
from megacompile.errors import ArgumentError
from megacompile.train.data import packing, tokens
from megacompile.train.model import check_isolation
from tests.train import files

SEQ = 40


def _rows(tmp_path, mode):
    tok = files.tokenizer()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": s}) + "\n" for s in files.SENTENCES))
    token_file = tokens.token_file(str(tmp_path / "tokens"), "train", [str(data)], tok, None, False)
    return packing.Rows(token_file, SEQ, mode, seed=3, pad_id=tok.pad_token_id)


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        use_cache=False))


def _documents_one_by_one(model, inputs) -> float:
    """Sum over the row's documents of (mean loss x tokens counted), each run alone, eagerly."""
    ids, labels, positions = inputs["input_ids"][0], inputs["labels"][0], inputs["position_ids"][0]
    starts = torch.nonzero(positions == 0).flatten().tolist() + [SEQ]
    total = 0.0
    for a, b in zip(starts, starts[1:]):
        doc_labels = labels[a:b].clone()
        n = int((doc_labels[1:] != -100).sum())
        if n:
            with torch.no_grad():
                total += float(model(input_ids=ids[None, a:b], labels=doc_labels[None]).loss) * n
    return total


def test_an_isolated_row_costs_the_sum_of_its_documents(tmp_path):
    model = _model()
    rows = _rows(tmp_path, "isolated")
    inputs = packing.batch(rows, 0, 1, shifted=False)
    assert int((inputs["position_ids"][0] == 0).sum()) >= 3                 # several documents share the row
    n = packing.target_count(inputs, shifted=False)
    engine = megacompile.compile(_model(), hbm_budget=1, device="cpu")
    packed = float(engine(**inputs).loss) * n                              # the forward-only plan
    engine.close()
    assert packed == pytest.approx(_documents_one_by_one(model, inputs), rel=1e-5, abs=1e-5)
    # Without the restarted positions the documents see each other, and the sum differs.
    plain = {k: v for k, v in inputs.items() if k != "position_ids"}
    with torch.no_grad():
        leaky = float(model(**plain).loss) * n
    assert abs(leaky - _documents_one_by_one(model, inputs)) > 1e-3


def test_rows_cover_every_token_once_an_epoch_and_are_reproducible(tmp_path):
    rows = _rows(tmp_path, True)
    seen = np.concatenate([rows.row(i)[0] for i in range(rows.rows_per_epoch)])
    stream = np.asarray(rows.tokens.ids)
    assert sorted(seen[:len(stream)].tolist() + seen[len(stream):].tolist()) == sorted(
        stream.tolist() + [rows.pad_id] * (len(seen) - len(stream)))
    again = _rows(tmp_path, True)        # the token file is reused, the rows are the same
    assert all(np.array_equal(rows.row(i)[0], again.row(i)[0]) for i in range(2 * rows.rows_per_epoch))
    assert not all(np.array_equal(rows.row(i)[0], rows.row(i + rows.rows_per_epoch)[0])
                   for i in range(rows.rows_per_epoch))                  # another order the next epoch


def test_unpacked_rows_hold_one_document_each(tmp_path):
    rows = _rows(tmp_path, False)
    assert rows.rows_per_epoch == len(files.SENTENCES)
    for i in range(rows.rows_per_epoch):
        ids, targets, _, kept = rows.row(i)
        eos = files.tokenizer().eos_token_id
        end = int(np.argmax(ids == eos)) + 1
        assert int((ids == eos).sum()) == 1 and not targets[end:].any()
        assert kept[:end].all() and not kept[end:].any()       # the document's tokens, then padding
    masked = packing.batch(rows, 0, 3, shifted=False, padding_mask=True)["attention_mask"]
    assert masked.dtype == torch.long and torch.equal(masked, torch.from_numpy(
        np.stack([rows.row(i)[3] for i in range(3)])).long())
    assert "attention_mask" not in packing.batch(rows, 0, 3, shifted=False)


def test_isolated_packing_is_refused_for_a_model_that_does_not_mask_by_position():
    from megacompile.models import LlamaConfig, TinyLlama
    with pytest.raises(ArgumentError, match="packing: isolated needs a decoder that masks attention by its position"):
        check_isolation(TinyLlama(LlamaConfig(dim=32, layers=1, heads=2, kv_heads=1, ffn=64)))
    check_isolation(_model())


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_isolated_packing_is_refused_for_a_hybrid_whose_recurrence_crosses_documents(family):
    """Qwen3-Next and Qwen3.5 mask their attention by position ids, but their gated delta-nets run
    over the whole row."""
    from tests.families import FAMILIES
    with pytest.raises(ArgumentError, match=r"packing: isolated keeps packed documents apart in attention only, "
                                            r"and 'model.layers.0.linear_attn' \(Qwen3(Next|_5)GatedDeltaNet\) "
                                            r"is a linear-attention layer"):
        check_isolation(FAMILIES[family]())
