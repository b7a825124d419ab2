"""Stopping criteria against hand-computed expectations, and their effect inside generate()."""

import time

import pytest
import torch

from decodekit.core import stopping as S

from helpers import TableModel


class PieceTokenizer:
    """Decodes each id to a fixed string piece, so stop strings can span token boundaries."""

    def __init__(self, pieces):
        self.pieces = pieces

    def decode(self, ids, **kwargs):
        return "".join(self.pieces[i] for i in ids)


PIECES = ["<pad>", "Hel", "lo", " wor", "ld", "!", "\n", "\n\nThe", " end"]


def ids(*rows):
    return torch.tensor(rows, dtype=torch.long)


def test_max_length():
    c = S.MaxLengthCriteria(3)
    assert c(ids([1, 2]), None).tolist() == [False]
    assert c(ids([1, 2, 3], [1, 2, 3]), None).tolist() == [True, True]


def test_eos_any_of_several():
    c = S.EosTokenCriteria([2, 5])
    assert c(ids([1, 2], [1, 5], [2, 1]), None).tolist() == [True, True, False]


def test_max_time():
    c = S.MaxTimeCriteria(0.05, initial_timestamp=time.time())
    assert c(ids([1]), None).tolist() == [False]
    c = S.MaxTimeCriteria(0.05, initial_timestamp=time.time() - 1)
    assert c(ids([1]), None).tolist() == [True]


def test_stop_string_spanning_two_tokens():
    c = S.StopStringCriteria(PieceTokenizer(PIECES), ["lo wor"])
    assert c(ids([1, 2]), None).tolist() == [False]  # "Hello": not yet
    assert c(ids([1, 2, 3]), None).tolist() == [True]  # "Hello wor": completed across "lo" + " wor"
    assert c(ids([1, 2, 3, 4]), None).tolist() == [False]  # already completed earlier, not by "ld"


def test_stop_string_inside_a_longer_token_and_not_in_prompt():
    c = S.StopStringCriteria(PieceTokenizer(PIECES), "\n\n")
    assert c(ids([5, 7]), None).tolist() == [True]  # "\n\nThe" contains the stop string and runs past it
    assert c(ids([6, 6]), None).tolist() == [True]  # "\n" + "\n" spans two tokens
    assert c(ids([6, 6, 8]), None).tolist() == [False]


def test_stop_strings_in_generate_stop_each_row():
    # Token i is always followed by token i + 1: rows starting at 1 and 3 reach " wor"/"ld" at different steps.
    V = len(PIECES)
    table = torch.full((V, V), -10.0)
    for i in range(V - 1):
        table[i, i + 1] = 10.0
    model = TableModel(table, pad_token_id=0)
    out = model.generate(ids([1], [3]), max_new_tokens=6, stop_strings=["ld!"], tokenizer=PieceTokenizer(PIECES))
    # Row 0: Hel lo wor ld ! -> stops after "!" (4 new tokens), then pads while row 1 continues.
    assert out[0].tolist()[:5] == [1, 2, 3, 4, 5]
    assert out[1].tolist()[:3] == [3, 4, 5]
    assert out.shape[1] == 5


def test_eos_pads_finished_rows():
    V = 6
    table = torch.full((V, V), -10.0)
    table[1, 2] = table[3, 4] = table[4, 5] = table[5, 4] = 10.0  # 1 -> 2 (EOS); 3 -> 4 -> 5 -> 4 ...
    table[2, 3] = 10.0
    model = TableModel(table, eos_token_id=2, pad_token_id=0)
    out = model.generate(ids([1], [3]), max_new_tokens=4)
    assert out.tolist() == [[1, 2, 0, 0, 0], [3, 4, 5, 4, 5]]


def test_stop_strings_need_tokenizer():
    model = TableModel(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="tokenizer"):
        model.generate(ids([1]), max_new_tokens=2, stop_strings="x")
