"""Fixtures for the deployment tests: real `mhaserve serve` replicas on free loopback ports, and the
container tier's images and compose projects."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.deploy.containers import ENGINE, NO_ENGINE, Compose, Images, build_images
from tests.deploy.helpers import Replica


@pytest.fixture
def replicas(tiny_repo: Path, tmp_path: Path) -> Iterator[Callable[..., list[Replica]]]:
    """Start n replicas (`start(n, http=True, drain_delay="1")`: with Replica's options); all of them are
    stopped after the test, whatever happened."""
    started: list[Replica] = []

    def start(n: int, http: bool = False, **settings: str) -> list[Replica]:
        for _ in range(n):
            started.append(Replica(tiny_repo, tmp_path, f"replica{len(started)}", http=http, **settings))
        return started[-n:]

    try:
        yield start
    finally:
        for r in started:
            r.stop()


@pytest.fixture(scope="session")
def images(tmp_path_factory: pytest.TempPathFactory) -> Images:
    """The cpu, loadtest, nginx and Prometheus images, built once per session from this checkout
    (deploy/images/build.sh; the engine's cache makes that seconds when nothing changed)."""
    if ENGINE is None:
        pytest.skip(NO_ENGINE)
    return build_images(tmp_path_factory.mktemp("images") / "build.log")


@pytest.fixture
def compose(images: Images, tmp_path: Path) -> Iterator[Callable[..., Compose]]:
    """Compose projects on the CPU stack; each is taken down after the test, and force-removed if `down`
    left anything behind."""
    started: list[Compose] = []

    def start(profiles: Sequence[str] = (), **env: str) -> Compose:
        (tmp_path / "results").mkdir(exist_ok=True)
        started.append(Compose(images, tmp_path, profiles, **env))
        return started[-1]

    try:
        yield start
    finally:
        for project in started:
            if project.containers():
                project.down()
            project.remove_everything()
