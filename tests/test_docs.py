"""The docs' relative links reach a file that exists and, where they name one, a heading in it: a heading
renamed left a link from docs/grpc-fronts.md to a section of docs/benchmarks.md that no longer was."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation but hyphens dropped, spaces as hyphens,
    and a second heading of the same text suffixed -1 (and so on)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading() -> None:
    broken = []
    for doc in DOCS:
        for link in LINK.findall(FENCE.sub("", doc.read_text(encoding="utf-8"))):
            if re.match(r"[a-z]+:", link):  # https:, mailto:: not ours to check offline
                continue
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            if not target.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{doc.relative_to(ROOT)}: {link} (no such heading)")
    assert not broken, "\n".join(broken)
