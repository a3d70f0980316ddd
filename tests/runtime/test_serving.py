"""A model's serving.json: every value it can hold is served, or refused naming the file and the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhaserve.runtime.serving import ServingConfigError, read


@pytest.mark.parametrize(
    ("text", "said"),
    [
        # each was a bare TypeError, OverflowError, RecursionError or ValueError (or, past 64 bits, a number no
        # queue or timer takes), which `--model '*'` did not take for one model's fault: the server did not start,
        # and a polling one stopped reading the repository
        ('{"prompts": {"q": "query: "}, "default_prompt_name": ["q"]}', "default_prompt_name"),
        ('{"pooling": ["mean"]}', "pooling"),
        ('{"limits": {"max_queue_size": 1' + "0" * 400 + "}}", "limits.max_queue_size"),
        ('{"limits": {"max_wait_ms": 1' + "0" * 400 + "}}", "limits.max_wait_ms"),
        ('{"max_length": 1' + "0" * 400 + "}", "max_length"),
        ('{"version_policy": {"latest": {"num_versions": 1' + "0" * 400 + "}}}", "num_versions"),
        ('{"limits": {"max_padding": 1' + "0" * 400 + "}}", "limits.max_padding"),
        ('{"prompts": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested"),
        ('{"max_length": 1' + "0" * 5000 + "}", "not valid JSON"),
    ],
    ids=[
        "prompt name a list",
        "pooling a list",
        "a 400-digit size",
        "a 400-digit wait",
        "a 400-digit length",
        "a 400-digit count",
        "a 400-digit fraction",
        "nested past the recursion limit",
        "a 5000-digit number",
    ],  # fmt: skip  # fmt: skip
)
def test_a_value_of_any_type_or_size_is_refused_naming_the_file(tmp_path: Path, text: str, said: str) -> None:
    (tmp_path / "serving.json").write_text(text)
    with pytest.raises(ServingConfigError) as e:
        read(tmp_path)
    assert str(e.value).startswith(str(tmp_path / "serving.json") + ": ") and said in str(e.value), str(e.value)[:300]


def test_a_serving_json_that_links_to_nothing_cannot_be_read(tmp_path: Path) -> None:
    """A serving.json mounted through a link (a ConfigMap, a volume) whose target went away was read as no
    serving.json: a polling server reloaded the model with the defaults (other vectors, other versions served),
    saying nothing. It cannot be read, as a folder in its place cannot: what is served stays, and is said."""
    assert read(tmp_path).limits == {}  # none at all: the defaults
    (tmp_path / "serving.json").symlink_to(tmp_path / "gone" / "serving.json")
    with pytest.raises(ServingConfigError, match=r"serving\.json: cannot be read \(a link to .*gone/serving\.json"):
        read(tmp_path)


def test_a_serving_json_saved_with_a_byte_order_mark_reads_as_without(tmp_path: Path) -> None:
    """As a manifest (Windows' Notepad writes one): it was refused, "Unexpected UTF-8 BOM"."""
    (tmp_path / "serving.json").write_bytes(b"\xef\xbb\xbf" + b'{"normalize": false}')
    assert read(tmp_path).normalize is False
