"""The scratch directories exports write into: an export killed outright leaves its own behind, which the next
export into the repository removes, and never a running export's; a running export's holds its version, which
another export of the model does not take."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from mhaserve.export import staging
from mhaserve.runtime import manifest as mf

# An export that stops inside its scratch directory: prints the directory, then waits to be killed.
HOLD = """
import sys, time
from pathlib import Path
from mhaserve.export import staging
with staging.reserved(Path(sys.argv[1]), "m", None, False) as (version, target, path):
    print(path, flush=True)
    time.sleep(120)
"""


def holding(repository: Path) -> tuple[subprocess.Popen[str], Path]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(repository)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line and Path(line).is_dir(), line  # (an empty line read as ".": the test wrote into the cwd)
    return proc, Path(line)


def test_a_killed_exports_scratch_is_removed_by_the_next_and_a_running_ones_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging, "LOCK_GRACE_S", 0.0)
    dead, dead_dir = holding(tmp_path)
    alive, alive_dir = holding(tmp_path)
    older = tmp_path / ".export-m-1-older"  # an older mhaserve's: no lock file, so not known to be dead
    older.mkdir()
    try:
        (dead_dir / "model.onnx").write_bytes(b"x" * 1000)
        dead.send_signal(signal.SIGKILL)
        dead.wait(30)
        assert dead_dir.exists()  # nothing ran to remove it
        with staging.reserved(tmp_path, "m", None, False) as (number, _, mine):
            assert number == 1  # the killed export's version is free again, the running one's (2) is not
            with pytest.raises(staging.PublishError, match="being made by another export"):
                reserve(tmp_path, "m", 2)
            assert not dead_dir.exists()
            assert alive_dir.exists() and older.exists() and mine.exists()
        assert not mine.exists() and alive_dir.exists()
    finally:
        alive.kill()
        alive.wait(30)


def test_a_lock_file_not_yet_taken_is_left_for_a_grace(tmp_path: Path) -> None:
    """An export creates its lock file and takes the lock in two calls: a sweep between them must not take the
    directory of an export that is just starting."""
    starting = tmp_path / ".export-m-1-starting"
    starting.mkdir()
    os.close(os.open(starting / staging.LOCK, os.O_RDWR | os.O_CREAT, 0o644))
    with staging.reserved(tmp_path, "m", 2, False):
        assert starting.exists()


def test_a_tokenizer_that_cannot_be_written_is_the_os_error_it_is(tmp_path: Path) -> None:
    """The tokenizers library raises a failed write (a full disk, a folder gone) as a bare Exception naming the OS
    error; the export's one-line error handling reads OSErrors, so it is raised as one (it was a traceback)."""
    from mhaserve.export.tokenizer import synthetic

    where = tmp_path / "gone" / "tokenizer.json"
    with pytest.raises(OSError) as e:
        staging.save_tokenizer(synthetic(200), where)
    assert (e.value.errno, e.value.filename) == (2, str(where))
    staging.save_tokenizer(synthetic(200), tmp_path / "tokenizer.json")
    assert (tmp_path / "tokenizer.json").stat().st_size > 0


def reserve(repository: Path, name: str, version: int | None, *, overwrite: bool = False) -> tuple[int, Path]:
    """The version and the target a reservation gets, given back at once."""
    with staging.reserved(repository, name, version, overwrite) as (number, target, _):
        return number, target


def test_exports_running_together_get_versions_of_their_own(tmp_path: Path) -> None:
    """Two exports of one model started together with no --version both took the next free version: the number
    was chosen at the start and its scratch folder made later, and neither looked at the other's. Under
    --overwrite the second publish replaced the first one's version without a word; without it the second
    failed at the end, after all its work. A running export's scratch folder now holds its number."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    with staging.reserved(tmp_path, "m", None, True) as (first, first_target, first_scratch):
        with staging.reserved(tmp_path, "m", None, True) as (second, second_target, second_scratch):
            assert (first, second) == (2, 3)
            assert (first_target, second_target) == (tmp_path / "m" / "2", tmp_path / "m" / "3")
            assert first_scratch != second_scratch
            staging.publish(second_scratch, second_target)
        assert reserve(tmp_path, "m", None) == (4, tmp_path / "m" / "4")  # past the published 3 and the held 2
        staging.publish(first_scratch, first_target)
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "2", "3"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no lock or scratch left in the repository


def test_a_version_another_export_is_making_is_refused_at_the_start(tmp_path: Path) -> None:
    """--version N while another export of the model makes N: refused before the work, not at the publish (and
    not taken under --overwrite either: that replaces a published version, not one another export is making)."""
    with staging.reserved(tmp_path, "m", 1, False):
        for overwrite in (False, True):
            with pytest.raises(staging.PublishError, match=r"m/1 is being made by another export or import"):
                reserve(tmp_path, "m", 1, overwrite=overwrite)
        assert reserve(tmp_path, "m", 2) == (2, tmp_path / "m" / "2")
    assert reserve(tmp_path, "m", 1) == (1, tmp_path / "m" / "1")  # free once the first is done
    assert list(tmp_path.iterdir()) == []


def test_a_version_held_is_the_models_own_not_a_longer_names(tmp_path: Path) -> None:
    """Scratch folders are `.export-<name>-<version>-<suffix>`: model a-1's version 2 is not model a's version 1,
    nor model a's version 1 model a-1's (names may hold '-'; the suffix never does)."""
    with staging.reserved(tmp_path, "a-1", None, False) as (number, _, held):
        assert number == 1 and held.name.startswith(".export-a-1-1-")
        assert reserve(tmp_path, "a", None)[0] == 1
        assert reserve(tmp_path, "a", 1) == (1, tmp_path / "a" / "1")
        with staging.reserved(tmp_path, "a", None, False) as (number, _, _):
            assert number == 1
            assert reserve(tmp_path, "a-1", None)[0] == 2
            assert reserve(tmp_path, "a", None)[0] == 2
            assert reserve(tmp_path, "a-1-1", None)[0] == 1


def test_a_dead_exports_scratch_does_not_hold_its_version(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed export's scratch folder (its lock free) holds no version: the next export may take it, and its
    folder is swept once past the grace."""
    dead = tmp_path / ".export-m-1-abcd1234"
    dead.mkdir()
    os.close(os.open(dead / staging.LOCK, os.O_RDWR | os.O_CREAT, 0o644))
    assert reserve(tmp_path, "m", None) == (1, tmp_path / "m" / "1")
    assert reserve(tmp_path, "m", 1) == (1, tmp_path / "m" / "1")
    assert dead.exists()  # within the grace: it may be an export's that has not yet taken its lock
    monkeypatch.setattr(staging, "LOCK_GRACE_S", 0.0)
    assert reserve(tmp_path, "m", None)[0] == 1
    assert list(tmp_path.iterdir()) == []


def test_the_next_version_passes_over_a_name_taken_by_a_file(tmp_path: Path) -> None:
    """A file named like the next version (not a version: the server passes over it) is not in the way of the
    default version, and --overwrite of it leaves nothing aside (`.old-2-PID` stayed, a file rmtree skips)."""
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "2").write_text("notes")
    assert reserve(tmp_path, "m", None) == (3, tmp_path / "m" / "3")
    number, target = reserve(tmp_path, "m", 2, overwrite=True)
    new = tmp_path / "scratch"
    new.mkdir()
    staging.publish(new, target, overwrite=True)
    assert target.is_dir() and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1", "2"]


def test_a_link_to_nothing_where_the_models_folder_goes_is_refused_before_the_export(tmp_path: Path) -> None:
    (tmp_path / "m").symlink_to(tmp_path / "nowhere")
    with pytest.raises(staging.PublishError, match="a link to .*nowhere, which does not exist"):
        reserve(tmp_path, "m", None)
    (tmp_path / "n").mkdir()
    (tmp_path / "n" / "1").symlink_to(tmp_path / "nowhere")  # a version's folder: taken, as a file would be
    assert reserve(tmp_path, "n", None)[0] == 2
    with pytest.raises(staging.PublishError, match="already exists"):
        reserve(tmp_path, "n", 1)


def test_a_repository_nobody_may_write_into_is_said_not_spun_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its lock file could be neither made (EACCES, or EPERM on an immutable folder) nor opened (it is not there):
    read as "removed by its holder meanwhile", the export tried again at once, for ever, at 100 % of a core."""
    real = os.open

    def refused(path: Any, flags: int, *args: Any) -> int:
        if Path(path).name == staging.REPOSITORY_LOCK:
            if flags & os.O_CREAT:
                raise PermissionError(1, "Operation not permitted", str(path))
            raise FileNotFoundError(2, "No such file or directory", str(path))
        return real(path, flags, *args)

    monkeypatch.setattr(staging.os, "open", refused)
    (tmp_path / "m").mkdir()
    with pytest.raises(
        staging.PublishError, match=f"cannot write into the repository {tmp_path}: Operation not permitted"
    ):
        reserve(tmp_path, "m", None)


def test_a_model_at_the_last_version_has_none_left_to_take(tmp_path: Path) -> None:
    """Its next version was said as one the user gave: "version must be a whole number from 1 to ..., got
    9223372036854775808", though the user gave none."""
    (tmp_path / "m" / str(mf.MAX_VERSION)).mkdir(parents=True)
    with pytest.raises(staging.PublishError, match=f"has no version left after {mf.MAX_VERSION}: pass --version"):
        reserve(tmp_path, "m", None)


OTHER_FS = Path("/dev/shm")  # tmpfs on Linux: another file system than the tests' temporary folder


@pytest.mark.skipif(
    not OTHER_FS.is_dir() or OTHER_FS.stat().st_dev == Path(tempfile.gettempdir()).stat().st_dev,
    reason="needs a second file system (/dev/shm) beside the temporary folder's",
)
def test_a_models_folder_on_another_file_system_is_refused_before_the_export(tmp_path: Path) -> None:
    """A version is published by renaming its folder into place from the repository's: a model's folder that
    is a link (or a mount) onto another file system ran every step and gate, then failed at the rename with
    "Invalid cross-device link" (on a large model, after half an hour)."""
    elsewhere = Path(tempfile.mkdtemp(dir=OTHER_FS))
    try:
        (tmp_path / "m").symlink_to(elsewhere)
        with pytest.raises(staging.PublishError, match=r"/m is on another file system or mount than the repository"):
            reserve(tmp_path, "m", None)
    finally:
        shutil.rmtree(elsewhere)


def _signal_during(monkeypatch: pytest.MonkeyPatch, step: str, signum: int) -> None:
    """The signal `signum` sent to this process during `step` of publish: the first rename (the old version
    moved aside), or the removal of the old version after the new one is in."""
    real_rename, real_remove = Path.rename, staging._remove

    def rename(self: Path, target: Path) -> Path:
        moved = real_rename(self, target)
        if step == "between" and Path(target).name.startswith(".old-"):
            os.kill(os.getpid(), signum)
        return moved

    def remove(path: Path) -> None:
        if step == "after":
            os.kill(os.getpid(), signum)
        real_remove(path)

    monkeypatch.setattr(Path, "rename", rename)
    monkeypatch.setattr(staging, "_remove", remove)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("step", ["between", "after"])
def test_a_signal_during_an_overwrites_publish_lets_it_finish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str, signum: int
) -> None:
    """A Ctrl-C (or SIGTERM, which export and import take as one) between the old version's move aside and the
    new one's rename in left neither: the version was gone from the repository, and a polling server retired
    it. One during the old version's removal, after the new one was in, said "interrupted" of a published
    version and left the old one's folder. The publish's few renames finish first, the signal then dropped:
    what it would stop is done."""
    raised: list[int] = []

    def interrupt(signum: int, frame: object) -> None:
        raised.append(signum)
        raise KeyboardInterrupt

    target = tmp_path / "m" / "1"
    target.mkdir(parents=True)
    (target / "old").write_text("old")
    new = tmp_path / ".export-m-1-x"
    new.mkdir()
    (new / "new").write_text("new")
    _signal_during(monkeypatch, step, signum)
    previous = signal.signal(signum, interrupt)
    try:
        with contextlib.suppress(KeyboardInterrupt):  # (asserted below: the handler must not have run)
            staging.publish(new, target, overwrite=True)
        assert signal.getsignal(signum) is interrupt  # the handler given back
    finally:
        signal.signal(signum, previous)
    assert raised == [] and sorted(p.name for p in (tmp_path / "m").iterdir()) == ["1"]
    assert [p.name for p in target.iterdir()] == ["new"]


def signal_as_the_lock_is_made(monkeypatch: pytest.MonkeyPatch, signum: int) -> None:
    """`signum` sent to this process as a scratch folder's lock file is opened: its folder made, its lock not."""
    real_open = os.open

    def open_(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kwargs: Any) -> int:
        if Path(path).name == staging.LOCK and Path(path).parent.name.startswith(staging.SCRATCH_PREFIX):
            os.kill(os.getpid(), signum)
        return real_open(path, flags, mode, **kwargs)

    monkeypatch.setattr(os, "open", open_)


def test_a_signal_as_the_scratch_folder_is_made_leaves_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between the scratch folder's making and its lock's left a folder without a lock file, which no
    sweep removes. The signal is taken once both are made, as the block's, and the folder removed with it."""
    signal_as_the_lock_is_made(monkeypatch, signal.SIGINT)
    # Python's own Ctrl-C handler, whatever this process inherited (a shell's background job ignores SIGINT)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), staging.reserved(tmp_path, "m", 1, False):
            pytest.fail("the block ran: the Ctrl-C was lost")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert list(tmp_path.glob(f"{staging.SCRATCH_PREFIX}*")) == []


def test_a_version_exported_under_a_private_umask_is_readable_by_the_servers_user(tmp_path: Path) -> None:
    """Exported under umask 077 (a hardened shell, a CI runner), the repository's and the model's folders were
    made 0700 and the version's files 0600: a server running as another user (the image's, uid 10001) could not
    read them, though the docs say the exporter's files are world-readable. What the export makes is readable by
    all (folders 0755, files 0644); folders it finds are left as they are."""
    repository = tmp_path / "new" / "repo"
    old = os.umask(0o077)
    try:
        with staging.reserved(repository, "m", None, False) as (version, target, path):
            (path / "model.onnx").write_bytes(b"graph")
            (path / "sub").mkdir()
            (path / "sub" / "f").write_text("x")
            staging.publish(path, target)
        (tmp_path / "mine").mkdir()  # a folder the user made: its mode is the user's
        with staging.reserved(tmp_path / "mine", "m", None, False) as (version, target, path):
            staging.publish(path, target)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert modes == {
        "new": 0o755,
        "new/repo": 0o755,
        "new/repo/m": 0o755,
        "new/repo/m/1": 0o755,
        "new/repo/m/1/model.onnx": 0o644,
        "new/repo/m/1/sub": 0o755,
        "new/repo/m/1/sub/f": 0o644,
        "mine": 0o700,
        "mine/m": 0o755,
        "mine/m/1": 0o755,
    }
