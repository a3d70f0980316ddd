"""Texts made in the repository for the load tools: the short-text corpus (short.txt) and its recipe."""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
SHORT = HERE / "short.txt"
TOPICS = HERE / "topics"
