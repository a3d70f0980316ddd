"""Publishing into the model repository: a version number, a scratch directory, one atomic rename.

`mhaserve export` and `mhaserve import` write everything into a scratch directory inside the repository
(the same filesystem, so the final rename is atomic) and publish `<repository>/<name>/<version>/` only
once every check has passed; a failure leaves the repository as it was. A polling server never sees a
half-written version. Exports of one model running together get versions of their own: a running export's
scratch directory holds its number (`reserved`). An export killed outright (SIGKILL, out of memory) cannot
remove its scratch directory; the next export or import into the repository does (`_sweep`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from tokenizers import Tokenizer

from mhaserve.runtime import manifest as mf

# Past this the protobuf limit (2 GiB) forces weights into an external-data file beside the graph.
EXTERNAL_DATA_BYTES = 1_500_000_000
SCRATCH_PREFIX = ".export-"
# A scratch directory's lock file, held by its export for as long as it runs; one younger than this may be
# an export's that has created it and not yet taken it.
LOCK = ".lock"
LOCK_GRACE_S = 60.0
# The repository's lock file, held while a version is chosen or published. A file: the server passes over
# files in the repository, and hidden folders (the scratch directories).
REPOSITORY_LOCK = ".export.lock"


class PublishError(RuntimeError):
    """The version cannot be published; the message is the one line the user sees."""


def interrupted(error: BaseException) -> bool:
    """Whether `error` is a Ctrl-C, or was raised because of one. Libraries report a KeyboardInterrupt that
    lands inside them as an error of their own (torch.export a RuntimeError; a pybind11 module's init, as
    onnxruntime's on first use, ImportError("initialization failed")), and our own errors raised from those
    keep them as their context, even under `from None`."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        todo += [e.__cause__, e.__context__]
    return False


@contextlib.contextmanager
def reserved(repository: Path, name: str, version_: int | None, overwrite: bool) -> Iterator[tuple[int, Path, Path]]:
    """The version to publish, its directory, and a private scratch directory inside the repository, removed
    afterwards unless `publish` renamed it away.

    The version is the next free one by default: past the last version, any file or link named like the next,
    and any version a running export or import of the model is making. One the user names that another is making
    is refused, --overwrite or not (that replaces a published version), as is one that exists without
    --overwrite; a file or a link to nothing where the repository's folder or the model's goes; and a model's
    folder on another file system than the repository's. All before the export runs.

    The scratch directory holds a lock (an flock on its LOCK file) while the export runs, by which `_sweep` tells
    a dead export's from a running one's, and another export the versions being made. The number is chosen and
    the directory made and locked under the repository's lock (`_locked`): two exports started together chose
    the same number, neither having made its directory yet.

    An error that a Ctrl-C caused leaves the block as the KeyboardInterrupt it is, whichever step wrapped it:
    the command then says "interrupted" (exit 130), not that the step failed or that a package is missing."""
    for folder in (repository, repository / name):
        if folder.is_symlink() and not folder.exists():
            raise PublishError(f"{folder} is a link to {os.readlink(folder)}, which does not exist")
        if folder.exists() and not folder.is_dir():
            raise PublishError(f"{folder} is a file, not a folder")
    if version_ is not None:
        _in_range(version_)  # before the repository's folder is made
    _make_folders(repository)
    _can_rename_into(repository, repository / name)
    _sweep(repository)
    with _locked(repository):
        number, target = _choose(repository, name, version_, overwrite)
        # Made with Ctrl-C and SIGTERM held: between the folder and its lock, one left a folder no sweep removes.
        with _held() as held:
            path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{name}-{number}-", dir=repository))
            path.chmod(0o755)  # mkdtemp makes it private; the published entry must be readable by the server's user
            lock = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            # Nobody else can hold it yet: others look at it under the repository's lock, _sweep not until the grace.
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        if held:  # the signal that came meanwhile, to its own handler now that the folder is removed with it
            signal.raise_signal(held[-1])
        yield number, target, path
    except Exception as e:
        if interrupted(e):
            raise KeyboardInterrupt from e
        raise
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def _make_folders(folder: Path) -> None:
    """Make `folder` and those above it that are missing, readable by all whatever the umask: under umask 077 (a
    hardened shell, a CI runner) they were 0700, and a server running as another user (the image's, uid 10001)
    could not enter them. Folders already there are the user's, left as they are."""
    missing = [f for f in (folder, *folder.parents) if not f.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    for made in missing:
        made.chmod(0o755)


def _readable(version: Path) -> None:
    """The version's files readable by all and its folders enterable, whatever the umask the export ran under
    (files 0600 under umask 077): the server may run as another user. Links are left alone."""
    for path in (version, *version.rglob("*")):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _can_rename_into(repository: Path, model: Path) -> None:
    """The version is renamed into the model's folder from the repository's scratch folder, which no rename does
    across file systems or mount points (a bind mount of the same file system too): a model's folder linked or
    mounted there failed at the very end ("Invalid cross-device link"), after every step and gate. So an empty
    folder is renamed there and back first."""
    if not model.is_dir():
        return  # made by the publish, in the repository
    try:
        probe = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}probe-", dir=repository))
    except OSError:
        return  # a repository not writable: the repository's lock says so, naming it (not this folder)
    moved = model / probe.name
    try:
        probe.rename(moved)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise PublishError(
                f"{model} is on another file system or mount than the repository {repository} (a link or a mount "
                "there): a version is published by a rename from the repository's folder; export into a repository "
                "on that file system, or make the model's folder a plain one"
            ) from None
        return  # another refusal (a folder not writable) is the publish's to say, as before
    finally:
        for left in (probe, moved):
            with contextlib.suppress(OSError):
                left.rmdir()


def _in_range(number: int) -> None:
    if not 0 < number <= mf.MAX_VERSION:  # past it the server reads the folder as no version
        raise PublishError(f"version must be a whole number from 1 to {mf.MAX_VERSION}, got {number}")


def _choose(repository: Path, name: str, version_: int | None, overwrite: bool) -> tuple[int, Path]:
    """`reserved`'s version and its directory, under the repository's lock."""
    making = _making(repository, name)
    existing = mf.versions(repository, name)
    number = version_ if version_ is not None else (existing[-1] + 1 if existing else 1)
    while version_ is None and (number in making or os.path.lexists(mf.entry_dir(repository, name, number))):
        number += 1
    if version_ is None and number > mf.MAX_VERSION:  # the last version taken: not the user's number to blame
        raise PublishError(
            f"{repository / name} has no version left after {mf.MAX_VERSION}: pass --version (with --overwrite to "
            "replace one)"
        )
    _in_range(number)
    target = mf.entry_dir(repository, name, number)
    if os.path.lexists(target) and not overwrite:
        raise PublishError(f"{target} already exists (pass --overwrite to replace it, or another --version)")
    if number in making:
        raise PublishError(f"{target} is being made by another export or import (pass another --version)")
    return number, target


def _making(repository: Path, name: str) -> set[int]:
    """The versions of `name` that running exports and imports hold: their scratch directories' locks are
    held. One without a lock file (an older mhaserve's) or with its lock free (a dead export's) holds none."""
    prefix = f"{SCRATCH_PREFIX}{name}-"
    making: set[int] = set()
    for scratch_dir in repository.glob(f"{prefix}*"):
        # `<version>-<mkdtemp's suffix>`, which has no '-': model a-1's version 2 is not model a's version 1
        number, dash, suffix = scratch_dir.name.removeprefix(prefix).partition("-")
        if not dash or not suffix or "-" in suffix or not mf.is_version(number):
            continue
        try:
            fd = os.open(scratch_dir / LOCK, os.O_RDONLY)
        except OSError:
            continue
        try:
            # Shared, so that it needs no write access (an NFS lock does for an exclusive one): refused while the
            # export holds its exclusive one.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            making.add(int(number))
        finally:
            os.close(fd)
    return making


@contextlib.contextmanager
def _locked(repository: Path) -> Iterator[None]:
    """The repository's lock (an flock on its REPOSITORY_LOCK file), held while a version is chosen and its
    scratch directory made, or a scratch directory published: briefly. The file is removed when the lock is
    given back, so that a failed export leaves the repository as it was; whoever then takes the lock of a file
    no longer there opens the file anew."""
    path = repository / REPOSITORY_LOCK
    missed = 0
    while True:
        # Mode as the umask says: in a repository a group shares, its other users must open it too; where the
        # umask left them read access alone (022), read-only, which flock needs no more than on a local disk.
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError as e:
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                # Removed by its holder meanwhile (made anew at the next turn), or never there in a folder this
                # user may not write into: tried again at once, that spun for ever.
                missed += 1
                if missed < 100:
                    continue
                raise PublishError(f"cannot write into the repository {repository}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass  # removed by the holder before us
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):  # left, it is taken by the next as it is
            path.unlink()
        os.close(fd)


def _sweep(repository: Path) -> None:
    """Remove the scratch directories of exports that died without removing them (SIGKILL, out of memory: a
    graph's worth of disk each time): a running export holds its directory's lock, a dead one's lock is free.
    A directory without a lock file (made by an older mhaserve, or one being made this instant) is left."""
    for stale in repository.glob(f"{SCRATCH_PREFIX}*"):
        try:
            fd = os.open(stale / LOCK, os.O_RDWR)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < LOCK_GRACE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its export runs
        else:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _held() -> Iterator[list[int]]:
    """Ctrl-C and SIGTERM (which export and import take as one) noted in the list this yields, not raised, until
    the block ends; their handlers are then given back. In the main thread only (elsewhere no handler runs)."""
    held: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield held
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(s, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python


def publish(scratch_dir: Path, target: Path, *, overwrite: bool = False) -> None:
    """Move the finished scratch directory to `target` in one rename (replacing it under --overwrite).

    `reserved` checked the target at the start; a version published meanwhile (a copy, an older mhaserve) is
    refused here unless --overwrite, not silently replaced. A Ctrl-C or SIGTERM meanwhile lets the publish
    finish, and is then dropped: what it would have stopped is done (between the old version's move aside and
    the new one's rename in, it lost the version; after, it said "interrupted" of a published one)."""
    with _held():
        # Under the repository's lock: between the scratch's lock file's removal and the rename, a version being
        # chosen saw neither the version nor an export making it, and took its number.
        with _locked(target.parent.parent):
            old = _publish(scratch_dir, target, overwrite)
        if old is not None:
            _remove(old)


def _publish(scratch_dir: Path, target: Path, overwrite: bool) -> Path | None:
    """The renames; the replaced version's folder, moved aside, if any."""
    _make_folders(target.parent)
    # Not part of the entry; the export holds its lock still, and a sweep passes over a directory without one.
    (scratch_dir / LOCK).unlink(missing_ok=True)
    _readable(scratch_dir)
    if os.path.lexists(target):
        if not overwrite:
            raise PublishError(
                f"{target} was published by someone else while this export ran (pass --overwrite to replace it, "
                "or another --version)"
            )
        # The old version is moved aside and the new one renamed in at once, and only then is the old one
        # deleted: a server polling the repository sees the version missing for two renames, not for the
        # length of the deletion (a big graph, a network file system).
        old = target.with_name(f".old-{target.name}-{os.getpid()}")
        target.rename(old)
        try:
            scratch_dir.rename(target)
        except OSError as e:
            old.rename(target)
            raise PublishError(f"{target} could not be published: {e.strerror or e}") from None
        return old
    try:
        scratch_dir.rename(target)
    except OSError as e:  # a directory that appeared after the check above: rename refuses a non-empty one
        raise PublishError(f"{target} could not be published: {e.strerror or e}") from None
    return None


def _remove(path: Path) -> None:
    """A replaced version's folder, or the file or link that stood where it goes (rmtree passes over those)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# How the tokenizers library names the OS's error in the bare Exception it raises for a failed write.
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def save_tokenizer(tokenizer: Tokenizer, path: Path) -> None:
    """`tokenizer.save`, a failed write (a full disk, a folder gone) raised as the OSError it is: the tokenizers
    library raises a bare Exception, which would reach the user as a traceback, not as the one line an OSError
    of any other write is."""
    try:
        tokenizer.save(str(path))
    except Exception as e:
        found = _OS_ERROR.search(str(e))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from None


def _pkg_version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def tool_versions() -> dict[str, str]:
    """The versions of what made a graph, for the manifest (torch only where the export used it)."""
    return {
        "onnx": _pkg_version("onnx"),
        "onnxscript": _pkg_version("onnxscript"),
        "onnxruntime": _pkg_version("onnxruntime-gpu"),
        "mhaserve": _pkg_version("mhaserve"),
    }
