"""The encoder's configuration: the sizes it refuses, and why."""

from __future__ import annotations

import pytest

from mhaserve.model.config import EncoderConfig


@pytest.mark.parametrize("length", [1, 0, -1])
def test_a_max_seq_len_below_2_is_refused(length: int) -> None:
    """[CLS] and [SEP] take two tokens of every input: a model of max_seq_len 1 was exported, passed its gate,
    was published, and refused every text (serving.json's max_length below 2 is refused the same way)."""
    with pytest.raises(ValueError, match=rf"^max_seq_len must be >= 2 \(special tokens included\), got {length}$"):
        EncoderConfig(max_seq_len=length)
    assert EncoderConfig(max_seq_len=2).max_seq_len == 2


def test_a_max_seq_len_past_the_position_table_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^max_seq_len 513 must be in 2..max_positions \(512\)$"):
        EncoderConfig(max_seq_len=513)
