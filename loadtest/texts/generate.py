"""Make the short-text corpus, loadtest/texts/short.txt: what an embedding API is sent on an ordinary day.

2,000 texts, one a line: search queries, questions, single sentences, short passages of two or three
sentences, and paragraphs of five to twelve, across twelve topics (cooking to software). Nothing is
downloaded: each topic's file in topics/ holds word lists (`[slots]`) and hand-written templates (`[templates]`) of
queries, questions and sentences that name them (`{dish}`; `{dish2}` is a second, different dish).
Passages and paragraphs are sentences of one topic run together; queries are lower case, as typed into
a search box. A seeded draw makes the same file on every machine.

    python -m mhaserve.loadtest.texts.generate            # rewrite short.txt
    python -m mhaserve.loadtest.texts.generate --check    # exit 1 when short.txt is not what this makes

The shares of the kinds set the length distribution: with all-MiniLM-L6-v2's tokenizer (special tokens
counted) a median near 20 tokens and 10-15 % of the texts over 100 (tests/loadtest/test_texts.py).
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from mhaserve.loadtest.texts import SHORT, TOPICS

COUNT = 2000
SEED = 0
# Share of each kind of text; passages and paragraphs are (fewest, most) sentences of one topic.
KINDS = {"query": 0.28, "question": 0.13, "sentence": 0.29, "passage": 0.15, "paragraph": 0.15}
SENTENCES = {"passage": (2, 3), "paragraph": (5, 14)}
TEMPLATES = ("queries", "questions", "sentences")
SLOT = re.compile(r"\{([a-z_]+?)(\d*)\}")


@dataclass(frozen=True)
class Topic:
    """One topic's word lists and templates."""

    name: str
    slots: dict[str, list[str]]
    queries: list[str]
    questions: list[str]
    sentences: list[str]


def load_topics(folder: Path = TOPICS) -> list[Topic]:
    """Every topics/*.toml, in name order; a template naming a slot the file lacks is an error."""
    topics = []
    for path in sorted(folder.glob("*.toml")):
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        slots, templates = data.get("slots", {}), data.get("templates", {})
        for kind in TEMPLATES:
            if not templates.get(kind):
                raise ValueError(f"{path}: no {kind} under [templates]")
            for template in templates[kind]:
                for name, k in SLOT.findall(template):
                    if name not in slots or len(slots[name]) < int(k or 1):
                        raise ValueError(f"{path}: {template!r} wants {k or 1} values of slot {name!r}")
        topics.append(Topic(path.stem, slots, *(templates[kind] for kind in TEMPLATES)))
    if not topics:
        raise ValueError(f"no topics in {folder}")
    return topics


def fill(template: str, slots: dict[str, list[str]], rng: random.Random) -> str:
    """The template with each slot drawn from its list; `{x}` and `{x2}` get different values."""
    chosen: dict[str, list[str]] = {}

    def value(m: re.Match[str]) -> str:
        name, k = m.group(1), int(m.group(2) or 1)
        taken = chosen.setdefault(name, [])
        while len(taken) < k:
            taken.append(rng.choice([v for v in slots[name] if v not in taken]))
        return taken[k - 1]

    return SLOT.sub(value, template)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def draw(kind: str, topic: Topic, rng: random.Random) -> str:
    """One text of a kind, from one topic."""
    if kind == "query":
        return fill(rng.choice(topic.queries), topic.slots, rng).lower()
    if kind == "question":
        return _sentence(fill(rng.choice(topic.questions), topic.slots, rng))
    if kind == "sentence":
        return _sentence(fill(rng.choice(topic.sentences), topic.slots, rng))
    fewest, most = SENTENCES[kind]
    templates = rng.sample(topic.sentences, rng.randint(fewest, most))
    return " ".join(_sentence(fill(t, topic.slots, rng)) for t in templates)


def generate(count: int = COUNT, seed: int = SEED, topics: list[Topic] | None = None) -> list[str]:
    """`count` distinct texts (ignoring case, as the tokenizer does) in a seeded random order."""
    rng = random.Random(seed)
    topics = topics if topics is not None else load_topics()
    quota = {kind: round(share * count) for kind, share in KINDS.items()}
    quota["sentence"] += count - sum(quota.values())
    seen: set[str] = set()
    texts: list[str] = []
    for kind, n in quota.items():
        made = tries = 0
        while made < n:
            tries += 1
            if tries > 100 * n:
                raise ValueError(f"the templates give fewer than {n} distinct texts of kind {kind}")
            text = draw(kind, rng.choice(topics), rng)
            if text.lower() not in seen:
                seen.add(text.lower())
                texts.append(text)
                made += 1
    rng.shuffle(texts)
    return texts


def render(texts: list[str]) -> str:
    return "".join(f"{t}\n" for t in texts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, default=SHORT, help=f"where to write (default {SHORT})")
    p.add_argument("--check", action="store_true", help="only say whether --output is what this script makes")
    args = p.parse_args(argv)
    text = render(generate())
    if args.check:
        same = args.output.is_file() and args.output.read_text(encoding="utf-8") == text
        print(f"{args.output}: {'up to date' if same else 'differs from what the script makes'}")
        return 0 if same else 1
    args.output.write_text(text, encoding="utf-8")
    print(f"wrote {text.count(chr(10))} texts to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
