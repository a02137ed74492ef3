"""Packed rows (document_ids) give every document the logits it has alone in a padded row."""

import dataclasses

import pytest
import torch

from data.packing import pack
from models.config import ModelConfig
from models.transformer import Transformer, packed_position_ids

VOCAB = 96
LENGTHS = [7, 3, 12, 5, 9, 1, 6]  # capacity 16: rows [7 3 5 1], [12], [9 6]: three documents share a row


def _model(preset: str, **changes) -> Transformer:
    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.from_preset(preset, vocab_size=VOCAB), **changes)
    return Transformer(config).eval()


def _documents() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in LENGTHS]


def test_pack_places_documents_first_fit_and_restarts_positions():
    rows = pack(LENGTHS, 16)
    assert rows.places == [(0, 0), (0, 7), (1, 0), (0, 10), (2, 0), (0, 15), (2, 9)]
    assert rows.shape == (3, 16)
    ids = rows.document_ids()
    assert ids[2].tolist() == [4] * 9 + [6] * 6 + [-1]
    assert packed_position_ids(ids)[0].tolist() == [*range(7), *range(3), *range(5), 0]
    assert packed_position_ids(ids)[1].tolist() == [*range(12), 0, 0, 0, 0]  # padding at 0
    with pytest.raises(ValueError, match="does not fit a row of 16"):
        pack([17], 16)


# gpt2: learned positions (they must restart per document); mistral: sliding window 32 (> a row here, and
# shortened to 4 in the softcapped variant); the softcapped one takes the eager attention path (Gemma 2).
@pytest.mark.parametrize("preset,changes", [
    ("llama-tiny", {}), ("gpt2-tiny", {}), ("qwen3-tiny", {}), ("mistral-tiny", {}),
    ("mistral-tiny", {"sliding_window": 4, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0}),
])
def test_packed_logits_equal_padded_logits(preset, changes):
    model, docs = _model(preset, **changes), _documents()
    padded = torch.zeros(len(docs), max(LENGTHS), dtype=torch.long)
    for i, doc in enumerate(docs):
        padded[i, :len(doc)] = doc
    rows = pack(LENGTHS, 16)
    with torch.no_grad():
        reference = model(padded)
        packed = model(rows.scatter(docs, 0), document_ids=rows.document_ids())
    for i, got in enumerate(packed[rows.slots()].split(LENGTHS)):
        torch.testing.assert_close(got, reference[i, :LENGTHS[i]], rtol=0, atol=1e-5)
    assert not torch.allclose(model(rows.scatter(docs, 0))[0, 7:10], reference[1, :3], atol=1e-3)  # mask matters
