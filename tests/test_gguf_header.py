"""loading/gguf_header.py against the `gguf` package's own reader (the oracle) on files the `gguf` package wrote: every
field's value, every tensor's name, shape, type, offset, size and bytes; and a file that is no GGUF refused by name."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from decodekit.loading.default import default_model_path
from decodekit.loading.gguf_header import GGUFHeader
from decodekit.testing import write_tiny_gguf


def same_file(path):
    oracle, header = GGUFReader(str(path)), GGUFHeader(path)
    fields = {k: f.contents() for k, f in oracle.fields.items() if not k.startswith("GGUF.")}
    assert header.fields == fields
    assert [t.name for t in header.tensors] == [t.name for t in oracle.tensors]
    for ours, theirs in zip(header.tensors, oracle.tensors):
        assert tuple(ours.shape) == tuple(int(n) for n in theirs.shape)
        assert ours.tensor_type == theirs.tensor_type
        assert (ours.data_offset, ours.n_bytes, ours.n_elements) == (
            int(theirs.data_offset), int(theirs.n_bytes), int(theirs.n_elements)
        )  # fmt: skip
        assert ours.data.dtype == theirs.data.dtype and ours.data.shape == theirs.data.shape
        assert np.array_equal(ours.data, theirs.data)
    return header


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q4_K", "F16", "F32"])
def test_a_tiny_files_fields_and_tensors_read_as_the_gguf_reader_reads_them(tmp_path, kind):
    width = 256 if kind == "Q4_K" else 64
    tokenizer = GGUFHeader(default_model_path()).fields  # a real vocabulary: strings, merges, token types
    fields = {
        "model": tokenizer["tokenizer.ggml.model"], "pre": tokenizer.get("tokenizer.ggml.pre"),
        "tokens": tokenizer["tokenizer.ggml.tokens"][:300], "token_type": tokenizer["tokenizer.ggml.token_type"][:300],
        "merges": tokenizer["tokenizer.ggml.merges"][:50], "bos_token_id": 1, "eos_token_id": 2,
    }  # fmt: skip
    path = write_tiny_gguf(
        tmp_path / "tiny.gguf", kind, vocab_size=300, tokenizer=fields, hidden_size=width, intermediate_size=2 * width
    )
    header = same_file(path)
    assert header.fields["tokenizer.ggml.tokens"] == fields["tokens"]


def test_the_default_models_file_reads_as_the_gguf_reader_reads_it():
    header = same_file(default_model_path())
    assert len(header.fields["tokenizer.ggml.tokens"]) == 49152


def test_a_file_that_is_no_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf file at all")
    with pytest.raises(ValueError, match="model.gguf is not a GGUF file"):
        GGUFHeader(path)


def test_a_cut_short_file_is_refused_with_where(tmp_path):
    whole = default_model_path().read_bytes()[:200_000]  # inside the vocabulary
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole)
    with pytest.raises(ValueError, match=r"cut.gguf: the GGUF header is cut short or damaged at byte \d+"):
        GGUFHeader(path)
