"""Aggregate a py-spy raw profile: one thread's samples by own frame and by inclusive frame, in per cent.

Run: python agg.py RAW [THREAD] (THREAD: a substring of the thread's label, MainThread by default).
"""

import collections
import sys
from pathlib import Path


def short(frame: str) -> str:
    """`func (path/file.py:line)` as `func (file.py)`: one entry per function, whatever the line."""
    if " (" not in frame:
        return frame
    name, where = frame.split(" (", 1)
    return f"{name} ({where.split(':')[0].split('/')[-1]})"


def main(raw: Path, thread: str) -> None:
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if thread not in frames[0]:
            continue
        n = int(count)
        total += n
        names = [short(f) for f in frames[1:]]
        own[names[-1] if names else "(no Python frame)"] += n
        for name in set(names):
            inclusive[name] += n
    print("samples", total)
    print("-- own")
    for name, n in own.most_common(25):
        print(f"{n / total * 100:5.1f}% {name}")
    print("-- inclusive")
    for name, n in inclusive.most_common(45):
        print(f"{n / total * 100:5.1f}% {name}")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "MainThread")
