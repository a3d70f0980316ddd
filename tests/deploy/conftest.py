"""Fixtures for the deployment tests: real `mhaserve serve` replicas on free loopback ports, and the
container tier's images and compose projects."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.deploy.containers import (
    ENGINE,
    KEEP_IMAGES,
    NO_ENGINE,
    Compose,
    Images,
    build_images,
    checkout_images,
    image_table,
    remove_built_images,
    remove_stale_projects,
    tagged_ids,
)
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
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    """The cpu, loadtest, nginx and Prometheus images, built once per session from this checkout
    (deploy/images/build.sh; the engine's cache makes that seconds when nothing changed). Removed again
    when the session ends, with what their builds left untagged, unless MHASERVE_TEST_KEEP_IMAGES=1."""
    if ENGINE is None:
        pytest.skip(NO_ENGINE)
    for project in remove_stale_projects():
        warnings.warn(f"removed {project}: a compose project left running by a test session that died", stacklevel=1)
    wanted = checkout_images()
    before, ours_before = image_table(), tagged_ids(wanted.tags())
    try:
        yield build_images(tmp_path_factory.mktemp("images") / "build.log")
    finally:
        if not KEEP_IMAGES:
            left = remove_built_images(wanted.tags(), before, ours_before)
            if left:
                warnings.warn(f"could not remove {len(left)} image(s) the build left: {', '.join(left)}", stacklevel=1)


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
