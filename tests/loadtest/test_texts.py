"""The short-text corpus: what the committed script makes, and the length distribution it promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from mhaserve.loadtest.texts import SHORT, generate


def test_the_committed_corpus_is_what_the_script_makes() -> None:
    assert SHORT.read_text(encoding="utf-8") == generate.render(generate.generate()), (
        "loadtest/texts/short.txt is stale: run python -m mhaserve.loadtest.texts.generate"
    )


def test_texts_are_distinct_one_line_each_and_of_every_kind() -> None:
    lines = SHORT.read_text(encoding="utf-8").split("\n")
    assert lines[-1] == ""
    texts = lines[:-1]
    assert len(texts) == generate.COUNT
    assert all(t and t == t.strip() and "\t" not in t for t in texts)
    assert len({t.lower() for t in texts}) == len(texts)
    # Queries are the lower-case texts; sentences end with a full stop or a question mark.
    queries = sum(t == t.lower() for t in texts) / len(texts)
    assert abs(queries - generate.KINDS["query"]) < 0.02, queries
    assert all(t[-1] in ".?" for t in texts if t != t.lower())


def test_length_distribution_with_the_served_models_tokenizer() -> None:
    """Median near 20 tokens, 10-15 % over 100: the traffic issue 18 describes, with MiniLM's tokenizer."""
    from tokenizers import Tokenizer

    from mhaserve.model.checkpoint import CheckpointError, default_source

    try:
        tokenizer = Tokenizer.from_file(str(default_source() / "tokenizer.json"))
    except CheckpointError as e:
        pytest.skip(str(e))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    texts = SHORT.read_text(encoding="utf-8").splitlines()
    lengths = sorted(len(e.ids) for e in tokenizer.encode_batch(texts))
    median = lengths[len(lengths) // 2]
    over_100 = sum(n > 100 for n in lengths) / len(lengths)
    assert 16 <= median <= 24, median
    assert 0.10 <= over_100 <= 0.15, over_100
    assert lengths[0] >= 3 and lengths[-1] > 200  # one-word queries up to paragraphs


def test_a_template_that_names_a_missing_slot_is_refused(tmp_path: Path) -> None:
    (tmp_path / "t.toml").write_text(
        '[slots]\ndish = ["soup"]\n[templates]\nqueries = ["{dish}"]\nquestions = ["{dish2}?"]\nsentences = ["x."]\n'
    )
    with pytest.raises(ValueError, match="2 values of slot 'dish'"):
        generate.load_topics(tmp_path)
    (tmp_path / "t.toml").write_text('[slots]\ndish = ["soup", "stew"]\n[templates]\nqueries = ["{dish}"]\n')
    with pytest.raises(ValueError, match="no questions"):
        generate.load_topics(tmp_path)


def test_two_values_of_one_slot_differ() -> None:
    import random

    rng = random.Random(0)
    for _ in range(50):
        a, b = generate.fill("{x} {x2}", {"x": ["p", "q"]}, rng).split()
        assert a != b
