"""The model manager: which model versions are served, and changing that while the server serves.

Each model's versions come from the repository and its version policy (runtime/serving.py). A version
is verified (sha256), loaded and warmed up off the request path, then switched in at once: the data
plane routes the next request for that model to it. A version that leaves the policy (an older one,
after a newer was published) stops getting new requests at that same moment; the requests it already
holds finish on it, and then its batcher, its tokeniser threads and its ONNX Runtime session are closed
and their memory returned. A version that fails to load changes nothing that is served: the log, the
metrics (`mhaserve_model_load_failures_total`) and the repository index say why, and it is not tried
again until its files change (or a load asks for it). A served version whose files or serving config change
(an `mhaserve export --overwrite`, a serving.json edit) is loaded again beside it and switched in the same
way; if the new files fail, the copy loaded before goes on serving.

How changes arrive (`--model-control`): `none`, the models named at start-up and nothing after; `poll`,
the repository is read again every `--repository-poll-s` seconds; `explicit`, the repository API
(KServe's RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload, over gRPC and HTTP) loads and
unloads models.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import gc
import logging
import os
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

from mhaserve.runtime import manifest as mf
from mhaserve.runtime import serving
from mhaserve.runtime.devices import Device
from mhaserve.runtime.engine import Engine, release_memory, warm_up
from mhaserve.runtime.errors import FailedPrecondition, InvalidArgument, NotFound, ServiceError, Unavailable, reason
from mhaserve.runtime.memory import release_free_memory
from mhaserve.runtime.repository import (
    EngineFactory,
    GraphChoice,
    LoadedModel,
    ModelEntry,
    ModelRepository,
    RepositoryError,
)
from mhaserve.service.dataplane import DataPlane
from mhaserve.service.metrics import Metrics, ModelMetrics
from mhaserve.service.pipeline import Pipeline
from mhaserve.service.threads import CountingPool

log = logging.getLogger(__name__)
T = TypeVar("T")

Control = Literal["none", "poll", "explicit"]
CONTROLS = ("none", "poll", "explicit")
ALL_MODELS = "*"
State = Literal["READY", "LOADING", "UNLOADING", "UNAVAILABLE"]
# Builds a version's pipeline (limits, batcher, hooks) from the loaded model: the server composes it.
PipelineFactory = Callable[[LoadedModel, ModelMetrics], Pipeline]
# What each served version of each model is: {name: {version: identity}}, the identity its graph's sha256 (and
# its external data's) and its serving config. A process of --processes N started again serves what the others
# do (ModelManager's `pinned`), not what the repository holds by then.
Served = dict[str, dict[int, str]]
MISSING_VERSION = "named by the version policy of serving.json (specific), but not in the repository"
FOLDER_GONE = (
    "serving the copy loaded before; its folder is no longer in the repository (retired once every version the "
    "version policy selects serves)"
)
# See ModelManager._fingerprint; None where the files cannot be read.
Fingerprint = tuple[object, ...] | None
# The repository's own threads (ModelManager._read): its listings (the poll's, the index's) and the poll's look
# for removed models, each shared by the calls that ask for it meanwhile; more wait their turn, which on a file
# system that stalls they would spend stalled anyway.
READ_THREADS = 4
# The threads that read one model's files (its plan, a load call's look-up), apart from the listings': each model's
# folder may be a volume of its own, and the reads of models whose volume stalled, one each, held the threads the
# index and the poll's listing read on (the index hung, the poll stopped). A model's reads wait for one of these
# only once this many models' reads have not returned.
MODEL_READ_THREADS = 16
# How long a poll waits on one model's read of the repository before it turns to the other models (the read goes
# on; that model is polled again once it has returned). Reads take milliseconds; a file on a network file system
# that stops answering, for ever.
SLOW_READ_S = 10.0
# The loads' threads (ModelManager._loading): a version's check (every byte of its graph read), its ONNX Runtime
# session and its warm-up, one at a time per model (its lock); models load side by side at start-up.
LOAD_THREADS = 4


@dataclass
class _Queued:
    """The read that calls made while one of the same key is under way wait for: begun once that one ends."""

    future: asyncio.Future[Any]
    pool: CountingPool
    read: Callable[..., Any]
    args: tuple[Any, ...]
    context: contextvars.Context  # the first such call's (its request id, for what the read logs)


@dataclass
class VersionState:
    state: State
    reason: str = ""


@dataclass(frozen=True)
class IndexEntry:
    """One line of the repository index (Triton's RepositoryIndexResponse.ModelIndex)."""

    name: str
    version: str
    state: str
    reason: str


@dataclass(frozen=True)
class _Plan:
    """ModelManager._plan: what the repository holds of a model, read in one go off the event loop."""

    wanted: list[int]
    published: set[int]
    fingerprints: dict[int, Fingerprint]
    missing: tuple[int, ...] = ()  # named by a `specific` policy, not published
    refusal: ServiceError | RepositoryError | None = None
    policy: serving.VersionPolicy | None = None
    config: serving.ServingConfig | None = None  # what the fingerprints were made with (_fall_back's own)


class ModelManager:
    """See the module docstring. Every method runs on the server's event loop, but `_plan` and what it calls,
    which read the repository's files on the repository's threads (as `index` and `load_model` read theirs:
    `_read`)."""

    def __init__(
        self,
        repository: ModelRepository,
        dataplane: DataPlane,
        metrics: Metrics,
        *,
        models: Sequence[str],
        graph: GraphChoice,
        engine_factory: EngineFactory,
        make_pipeline: PipelineFactory,
        control: Control = "none",
        device: Device = "auto",
        pinned: Served | None = None,
    ) -> None:
        """`pinned`: serve these versions of these models, as they were (the graph and serving config), or fail
        to start: a process of --processes N started again, beside others that loaded them (`served()`)."""
        self.repository = repository
        self.pinned = pinned
        self.dataplane = dataplane
        self.metrics = metrics
        self.graph = graph
        self.device = device  # where the engines run: which graph `auto` picks (runtime/repository.py)
        self.engine_factory = engine_factory
        self.make_pipeline = make_pipeline
        self.control = control
        self.all_models = ALL_MODELS in models
        self.wanted: list[str] = [m for m in models if m != ALL_MODELS]
        self.states: dict[tuple[str, int], VersionState] = {}
        # What a version's files and serving config were when it was loaded, or when it failed to: a served
        # version is loaded again when they change (an --overwrite, a serving.json edit), a failed one is
        # tried again (not at every poll).
        self._loaded: dict[tuple[str, int], Fingerprint] = {}
        self._failed: dict[tuple[str, int], Fingerprint] = {}
        # A served version's own failed reload, said again once a failure of the model's folder is mended.
        self._why: dict[tuple[str, int], str] = {}
        self._missing: set[tuple[str, int]] = set()  # versions a `specific` policy names that are not published
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: dict[asyncio.Task[None], Pipeline] = {}
        # The explicit loads under way (load_model), each a task of its own; by model, the last one asked for
        # (the next runs after it), the one not yet begun (a load asked for meanwhile joins it: it will read
        # the repository as it then is), and the unloads asked for so far (a load begins as a no-op if one came
        # after it was asked for: loaded, then unloaded, in the order asked).
        self._loads: set[asyncio.Task[Any]] = set()  # and the look-ups that begin them (_ask_load)
        self._last_load: dict[str, asyncio.Task[None]] = {}
        self._next_load: dict[str, asyncio.Task[None]] = {}
        self._unloads: collections.Counter[str] = collections.Counter()
        self._poller: asyncio.Task[None] | None = None
        self._polling: dict[str, asyncio.Task[None]] = {}  # a poll's sync of each model still running (_poll_one)
        self._planning: set[str] = set()  # models whose plan waits for a thread or is being read (_sync)
        self._reading_plan: set[str] = set()  # of those, the ones being read (added in the read's thread: _planned)
        self._root_gone = False  # the repository's folder could not be read at the last poll
        self._closing = False  # close() has begun: a load call's look-up that ends then begins no load
        # Reads of the repository (listings, look-ups, plans) on threads of their own, not the default executor's:
        # on a network file system that stalls each holds its thread until the file system answers, maybe never,
        # and there they held the threads that loads (session creation, warm-up) and unloads (the release of
        # their memory) run on. The pool's threads start with its first reads. `_reading`: the shared reads under
        # way, by what they read; `_queued`, the one that begins after each, for the calls made meanwhile (`_read`).
        self._reads = CountingPool("repository", READ_THREADS)
        self._model_reads = CountingPool("repository-model", MODEL_READ_THREADS)
        self._reading: dict[Hashable, asyncio.Future[Any]] = {}
        self._queued: dict[Hashable, _Queued] = {}
        # A load's steps (the version's check, its session, its warm-up) on threads of their own too, counted: one
        # held by a stalled file system (the check reads every byte) or an engine that never returns would hold
        # the process's exit, which joins them (`busy`, for `serve`).
        self._loading = CountingPool("model-load", LOAD_THREADS)

    # ---- which models ------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The models to serve now: those named, or every model in the repository for `*`."""
        if self.pinned is not None:
            return sorted(self.pinned)
        if self.all_models:
            return sorted(set(self.wanted) | set(self.repository.names()))
        return list(self.wanted)

    def must_serve(self, name: str) -> bool:
        """Whether a model that fails to load stops start-up: one named does (serving it is what was asked);
        one that `*` found in the repository is reported and skipped, as a poll would (a broken entry takes
        the rest of the repository down neither at start-up nor later)."""
        return not self.all_models or name in self.wanted or self.pinned is not None

    def to_serve(
        self, name: str, policy: serving.VersionPolicy | None = None, published: list[int] | None = None
    ) -> list[int]:
        """The versions of `name` to serve now: those its version policy selects, or those pinned. `policy` and
        `published`, where given, are what the caller read of the repository (read here where not)."""
        published = self.repository.published(name) if published is None else published
        if self.pinned is None:
            return self.repository.to_serve(name, policy, published)
        versions = sorted(self.pinned.get(name, {}))
        if gone := sorted(set(versions) - set(published)):
            raise NotFound(
                f"model {name!r} version {', '.join(map(str, gone))}: served by the other processes, and no longer in "
                "the repository: restart the server to serve what the repository holds now"
            )
        return versions

    def served(self) -> Served:
        """What this server serves now, version by version (for `pinned`)."""
        served: Served = {}
        for pipeline in self.dataplane.pipelines():
            model = pipeline.model
            served.setdefault(model.name, {})[model.version] = _identity(model.entry)
        return served

    def default_name(self) -> str:
        """The model of requests that name none: the first model named, else the repository's default."""
        return self.wanted[0] if self.wanted else self.repository.default_name()

    # ---- loading ---------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load every model to serve (at start-up: any failure is the caller's to report)."""
        named = bool(self.wanted)  # the first model named stays the default; otherwise it follows what is served
        if not self.wanted and not self.all_models:
            self.wanted = [self.repository.default_name()]
        self.dataplane.set_default(self.default_name(), follow=not named)
        for name in self.names():
            try:
                await self.sync(name, strict=self.must_serve(name))
            except Exception as e:  # said once, by the caller, naming the model (ONNX Runtime's errors do not)
                raise RepositoryError(f"{name}: {reason(e)}") from e
        if not self.dataplane.model_names():
            raise RepositoryError(
                f"no model of the repository {self.repository.root} could be served (each one's reason is above)"
            )

    async def sync(self, name: str, *, strict: bool = False) -> None:
        """Serve the versions of `name` that its version policy selects now: load the new ones, retire the rest.

        With `strict`, a version that fails to load raises; else it is reported and skipped.
        """
        async with self._lock(name):
            with self._saying_the_default():
                await self._sync(name, strict)

    @contextlib.contextmanager
    def _saying_the_default(self) -> Iterator[None]:
        """Log a change of the model that requests naming none get, made by what runs within: a load, a
        retirement (a poll's, an unload's)."""
        default = self.dataplane.default_model
        served = default in self.dataplane.model_names()
        try:
            yield
        finally:
            now = self.dataplane.default_model
            # With none served the default names one that is not (the first added, or the one named): a line
            # then would name a model that is gone, or as served before one that was not; the retirements' and
            # loads' own lines say what happened.
            if served and now != default and now in self.dataplane.model_names():
                log.info("requests that name no model now get %s (%s before): it is the default served", now,
                         default)  # fmt: skip

    async def _sync(self, name: str, strict: bool) -> None:
        # Every read of the repository in one go, off the event loop: on a network file system that stalls, the
        # event loop (every request, health check and drain) would wait for each stat. Not shared: the model's
        # lock lets one plan of it run at a time.
        self._planning.add(name)
        try:
            plan = await self._read(self._planned, name, of_model=True)
        finally:
            self._planning.discard(name)
        if plan.refusal is not None:
            # The model as a whole (version 0: its serving.json, or no versions): said once, until it changes.
            fingerprint = plan.fingerprints[0]
            if not strict and self._failed_as(name, 0, fingerprint):
                return
            self._report(name, 0, plan.refusal, fingerprint)
            if strict:
                raise plan.refusal
            return
        wanted, published = plan.wanted, plan.published
        # The failures behind the model: of its serving config (version 0), of versions deleted, or left by the
        # policy (the index lists the versions it selects, and those still served).
        self._forget(name, lambda version: version == 0 or version not in published or version not in wanted)
        self._note_missing(name, plan.missing)
        served = set(self.dataplane.versions(name))
        # The policy the served versions report (None: none served), in force until every version the plan's selects
        # serves: a version loaded meanwhile reports it too.
        in_force = self.dataplane.resolve(name, max(served)).version_policy if served else None
        # Under poll a model of which nothing serves falls back to the newest older version that loads (_fall_back):
        # a failure of the versions its `latest` policy selects is then no start-up's failure.
        fall_back = self._falls_back(plan.policy)
        failed: Exception | None = None
        # Newest first: each version is switched in once ready, and calls that name none get the newest served;
        # oldest first, a model's first load answered them with its oldest version while the newer ones loaded.
        try:
            for version in sorted(wanted, reverse=True):
                key = (name, version)
                fingerprint = plan.fingerprints[version]
                # The model reads cleanly (a reason the folder gave a served version is behind it): each served
                # version's state is its own again.
                if version in served and fingerprint == self._loaded.get(key):
                    self.states[key] = VersionState("READY")  # serving what is there
                    self._failed.pop(key, None)
                    self._why.pop(key, None)
                    continue
                # A failed version waits for its files to change; a load asked for (strict) tries again now.
                if not strict and self._failed_as(name, version, fingerprint):
                    if version in served:
                        self.states[key] = VersionState("READY", self._why.get(key, ""))
                    continue
                try:
                    with self.dataplane.loading(name, version):  # its calls are told it loads, not that it is missing
                        await self._load(name, version, fingerprint)
                except Exception as e:  # a graph ONNX Runtime cannot read fails in its own ways
                    self._report(name, version, e, fingerprint)
                    if strict and not fall_back:
                        raise
                    failed = failed or e
            if fall_back and failed is not None and not self.dataplane.versions(name):
                await self._fall_back(name, plan, strict, failed)
        finally:
            # A version loaded while another the new policy selects failed (an explicit load ends at it) reports
            # the policy in force, as the others served do.
            now = set(self.dataplane.versions(name))
            if not set(wanted) <= now and in_force is not None:
                for version in sorted(now):
                    self.dataplane.resolve(name, version).version_policy = in_force
        # Retire the versions the policy left only once all it selects serve: a failed load (of a newer
        # version, or of one of `latest N`) changes nothing that is served.
        if set(wanted) <= now:
            for version in sorted(now - set(wanted)):
                self._retire(name, version)
            # The policy is in force: every served version says so (ModelConfig, /info), those loaded under
            # an earlier one too. Not before: a failed load changes nothing that is served, nor its policy.
            if (policy := plan.policy) is not None:
                for version in sorted(now & set(wanted)):
                    self.dataplane.resolve(name, version).version_policy = policy
        self._note_gone(name, published)

    def _note_gone(self, name: str, published: set[int]) -> None:
        """A served version whose folder is no longer in the repository serves on while the versions the policy
        selects do not all load (a failed load changes nothing that is served): READY in the index with no reason
        and no word in the log, an operator who took a bad version out could not see that it still answered. Its
        reason says so, and a warning once; until it is retired or its folder is back."""
        for version in self.dataplane.versions(name):
            key = (name, version)
            if version not in published:
                if self.states.get(key, VersionState("READY")).reason != FOLDER_GONE:
                    log.warning(
                        "%s version %d's folder is no longer in the repository: it serves on until every version "
                        "the version policy selects serves", name, version,
                    )  # fmt: skip
                self.states[key] = VersionState("READY", FOLDER_GONE)
            elif (state := self.states.get(key)) is not None and state.reason == FOLDER_GONE:
                self.states[key] = VersionState("READY")

    def may_fall_back(self, name: str) -> bool:
        """Whether an older version of `name` may serve in place of those its policy selects (`_fall_back`): under
        poll, a `latest` policy, and an older version published. Reads the repository: start-up's check alone."""
        if not self._falls_back(policy := self.repository.config(name).version_policy):
            return False
        published = self.repository.published(name)
        wanted = self.repository.to_serve(name, policy, published)
        return bool(wanted) and min(published) < min(wanted)

    def _falls_back(self, policy: serving.VersionPolicy | None) -> bool:
        """Whether a model under `policy` falls back to an older version where those it selects fail: under poll
        (not a restarted process's pinned versions), with a `latest` policy."""
        return self.control == "poll" and self.pinned is None and policy is not None and policy.kind == "latest"

    async def _fall_back(self, name: str, plan: _Plan, strict: bool, failed: Exception) -> None:
        """Serve the newest version of `name` older than those its policy selects (`plan.wanted`, none of which
        loaded: `failed`, the newest one's error) that loads; with `strict`, raise `failed` where none does.

        Under poll a version published broken (a copy cut short, a graph that fails its checksum) leaves the
        servers that poll serving the version before it (a failed load changes nothing that is served), while a
        server started then (a replica scaled out, a process of --processes started again, a pod restarted)
        refused to start, or served nothing of the model under `*`: a fleet whose new replicas crash-loop while
        the old ones serve. It serves what they do, most often; the policy's versions are served once their
        files change, as the poll's are."""
        assert plan.config is not None
        for version in sorted((v for v in plan.published if v < min(plan.wanted)), reverse=True):
            fingerprint = await self._read(self._fingerprint, name, version, plan.config, of_model=True)
            if not strict and self._failed_as(name, version, fingerprint):
                continue
            try:
                with self.dataplane.loading(name, version):
                    await self._load(name, version, fingerprint)
            except Exception as e:
                self._report(name, version, e, fingerprint)
                continue
            selected = sorted(plan.wanted)
            which = (
                f"version {selected[0]}, which its version policy selects, does not"
                if len(selected) == 1
                else f"versions {', '.join(map(str, selected[:-1]))} and {selected[-1]}, which its version policy "
                "selects, do not"
            )
            log.warning(
                "serving %s version %d, the newest version of it that loads: %s (said above); served once their "
                "files change", name, version, which,
            )  # fmt: skip
            return
        if strict:
            raise failed

    async def _load(self, name: str, version: int, fingerprint: Fingerprint) -> None:
        """Load a version and switch it in; one already served (its files or config changed) keeps serving
        until its new copy is ready, and then finishes what it holds."""
        key = (name, version)
        served = version in self.dataplane.versions(name)
        if not served:
            self.states[key] = VersionState("LOADING")
        started = time.perf_counter()
        # The entry's check and the load read the version's files too, but on the loads' threads, not the
        # repository's: the check reads every byte of the graph (seconds a gigabyte) and the load builds its
        # ONNX Runtime session (seconds of CPU), one of each per model loading at a time (its lock), however
        # often clients call; on the repository's few threads a load or two would hold up the index and every
        # look-up for as long.
        entry = await self._off_loop(self._loading, self.repository.entry, name, version, self.graph, self.device)
        if self.pinned is not None and self.pinned.get(name, {}).get(version) != _identity(entry):
            raise RepositoryError(
                f"{name} version {version} is not what the other processes serve: its graph, weights or serving config "
                "changed since they loaded it; restart the server to serve what the repository holds now"
            )
        model = await self._off_loop(self._loading, self.repository.load, entry, self.engine_factory)
        metrics = ModelMetrics(self.metrics, name, version)
        pipeline: Pipeline | None = None
        try:
            pipeline = self.make_pipeline(model, metrics)  # which refuses limits it cannot serve
            runs = await self._off_loop(
                self._loading,
                partial(warm_up, max_seq_len=entry.max_tokens, max_batch_tokens=pipeline.limits.max_batch_tokens),
                model.engine,
            )
        except BaseException:
            if pipeline is not None:
                pipeline.close()
            # Made for it above, they would stay exported for the process's life; the version's series stay
            # while another copy holds them.
            metrics.discard()
            raise
        pipeline.batcher.start()
        old = self.dataplane.remove(name, version) if served else None
        self.dataplane.add(pipeline)  # the switch: the next request for this model's latest gets this version
        if old is not None:
            log.info("replacing %s version %d: its files or serving config changed", name, version)
            self._close_later(old)
        metrics.served(model.provider)
        self.states[key] = VersionState("READY")
        self._loaded[key] = fingerprint
        self._failed.pop(key, None)
        self._why.pop(key, None)
        limits = pipeline.limits
        log.info(
            "serving %s version %d (%s graph) on %s after %d warm-up runs in %.1f s; max %d tokens per input, "
            "max batch tokens %d, max wait %g ms, max queue %d inputs, max %d inputs per request",
            name,
            version,
            entry.graph,
            model.provider,
            runs,
            time.perf_counter() - started,
            entry.max_tokens,
            limits.max_batch_tokens,
            limits.max_wait_ms,
            limits.max_queue_size,
            limits.max_client_batch_size,
        )

    def _report(self, name: str, version: int, error: BaseException, fingerprint: Fingerprint) -> None:
        why = reason(error)
        serving = self.dataplane.versions(name)
        if version in serving:  # its files changed and do not load: the copy loaded before goes on serving
            self._why[(name, version)] = f"serving the copy loaded before; its files or config now: {why}"
            self.states[(name, version)] = VersionState("READY", self._why[(name, version)])
        else:
            self.states[(name, version)] = VersionState("UNAVAILABLE", why)
        if version == 0:  # the model as a whole: each served version's reason is this one now (an older one stayed)
            for served in serving:
                self.states[(name, served)] = VersionState(
                    "READY", f"serving the copy loaded before; the model's folder now: {why}"
                )
        self._failed[(name, version)] = fingerprint
        self.metrics.load_failures.labels(name, str(version)).inc()
        log.error(
            "cannot load %s%s: %s (%s)",
            name,
            f" version {version}" if version else "",  # 0: the model as a whole (its serving.json, its folder)
            why,
            f"still serving version {', '.join(map(str, serving))}" if serving else "nothing of it is served",
        )

    def _failed_as(self, name: str, version: int, fingerprint: Fingerprint) -> bool:
        """Whether the version failed to load from what is there now (and is not to be tried again yet)."""
        key = (name, version)
        return key in self._failed and self._failed[key] == fingerprint

    def _planned(self, name: str) -> _Plan:
        """`_plan(name)`, the model named in `_reading_plan` while it runs: from its thread, for a poll that waited
        on it to tell a read that has not returned from one that waits for a thread (a set's add and discard are
        atomic)."""
        self._reading_plan.add(name)
        try:
            return self._plan(name)
        finally:
            self._reading_plan.discard(name)

    def _plan(self, name: str) -> _Plan:
        """What the repository holds of `name` now: the versions to serve, the published ones, and the
        fingerprint of each version to serve (of version 0, the model as a whole, where it cannot be served).
        Reads files only: run off the event loop."""
        # The config and the published versions are read once, so that what is chosen, what is named missing and
        # each version's fingerprint agree with each other when serving.json is edited while the poll reads it.
        try:
            config = self.repository.config(name)
            published = self.repository.published(name)
            wanted = self.to_serve(name, config.version_policy, published)
        except (ServiceError, RepositoryError) as e:
            return _Plan([], set(), {0: self._model_fingerprint(name)}, refusal=e)
        except OSError as e:  # its folder or serving.json this user cannot read: this model's failure alone
            refusal = RepositoryError(f"cannot read {e.filename or name}: {e.strerror or e}")
            return _Plan([], set(), {0: self._model_fingerprint(name)}, refusal=refusal)
        policy = config.version_policy
        missing = tuple(sorted(set(policy.specific) - set(published))) if policy.kind == "specific" else ()
        fingerprints = {v: self._fingerprint(name, v, config) for v in wanted}
        return _Plan(wanted, set(published), fingerprints, missing, policy=policy, config=config)

    def _note_missing(self, name: str, missing: tuple[int, ...]) -> None:
        """Versions a `specific` policy names that the repository does not hold: UNAVAILABLE in the index and
        said once in the log (Triton fails such a load; they were ignored without a word), until they are
        published or no longer named."""
        for key in [k for k in self._missing if k[0] == name and k[1] not in missing]:
            self._missing.discard(key)
            if (state := self.states.get(key)) is not None and state.reason == MISSING_VERSION:
                del self.states[key]
        for version in missing:
            key = (name, version)
            if key not in self._missing:
                log.warning("%s version %d: %s", name, version, MISSING_VERSION)
                self._missing.add(key)
            self.states[key] = VersionState("UNAVAILABLE", MISSING_VERSION)

    def _fingerprint(self, name: str, version: int, config: serving.ServingConfig) -> Fingerprint:
        """What a version's load depends on: each file of its folder (name, size, modification and change
        times, as Triton's poll compares them; the change time catches a copy that keeps the old times) and
        the model's serving config, as the poll read it, but for its version policy."""
        try:
            directory = mf.entry_dir(self.repository.root, name, version)
            files = tuple(sorted((p.name, _stat(p)) for p in directory.iterdir()))
        except (OSError, mf.ManifestError):
            return None
        return (files, repr(dataclasses.replace(config, version_policy=serving.VersionPolicy())))

    def _model_fingerprint(self, name: str) -> Fingerprint:
        """Version 0's: the model as a whole, where it cannot be served (its serving.json's times, the published
        versions)."""
        try:
            path = self.repository.root / mf.check_name(name) / serving.SERVING_FILE
            return (_stat(path), tuple(mf.versions(self.repository.root, name)))
        except (OSError, mf.ManifestError):
            return None

    def _forget(self, name: str, gone: Callable[[int], bool]) -> None:
        """Drop the failures of a model's versions that `gone` says are behind it (a serving config since
        mended, a broken version since deleted), so that the index no longer lists them."""
        for key in [k for k, s in self.states.items() if k[0] == name and s.state == "UNAVAILABLE" and gone(k[1])]:
            del self.states[key]
            self._failed.pop(key, None)

    # ---- retiring --------------------------------------------------------------------------------------

    def _retire(self, name: str, version: int) -> None:
        pipeline = self.dataplane.remove(name, version)
        if pipeline is None:
            return
        self.states[(name, version)] = VersionState("UNLOADING")
        self._loaded.pop((name, version), None)
        self._why.pop((name, version), None)
        log.info("retiring %s version %d: no new requests; closing once the %d it holds finish", name, version,
                 pipeline.active)  # fmt: skip
        self._close_later(pipeline)

    def _close_later(self, pipeline: Pipeline) -> None:
        model = pipeline.model
        task = asyncio.get_running_loop().create_task(
            self._close_when_idle(pipeline), name=f"retire-{model.name}-{model.version}"
        )
        self._retiring[task] = pipeline
        task.add_done_callback(lambda t: self._retiring.pop(t, None))

    async def _close_when_idle(self, pipeline: Pipeline) -> None:
        # Until none holds it: a request resolved before the retirement may enter in the turn between the last
        # one's end (which sets `quiet`) and this task's; the close failed it.
        while pipeline.active:
            await pipeline.quiet.wait()
        # What a request that resolved this copy before its retirement and reaches it only now is told (KServe
        # REST's infer resolves before it reads its body): not "the server is shutting down", which sends a
        # client to another replica; a retry resolves what serves now.
        pipeline.retired = (
            f"{pipeline.model.name} version {pipeline.model.version} was retired (unloaded or replaced) as this "
            "request reached it; retry"
        )
        await pipeline.batcher.close(pipeline.retired)
        pipeline.close()
        model = pipeline.model
        key = (model.name, model.version)
        # A copy replaced by a new one of the same version, or unloaded and loaded again before its queue
        # emptied: the ready gauge and the state are the new copy's now, and the series stay while it (or a copy
        # still loading) holds them.
        if model.version in self.dataplane.versions(model.name):
            pipeline.metrics.discard()
        else:
            pipeline.metrics.unloaded()
            if self.states.get(key, VersionState("READY")).state == "UNLOADING":
                del self.states[key]
        engine = weakref.ref(model.engine)
        try:  # a shared arena's free memory, back to the system
            await asyncio.to_thread(_release_memory, engine)
        except Exception as e:  # memory left in the arena is no reason to keep the version half closed
            log.warning("could not shrink the ONNX Runtime arena of %s version %d: %s", *key, e)
        # The ONNX Runtime sessions go with the engine's last reference: the retiring list's and ours. A full
        # collection costs the event loop 20-25 ms (every request waits), so it runs only if a cycle kept them.
        this = asyncio.current_task()
        if this is not None:
            self._retiring.pop(this, None)
        del pipeline, model
        if engine() is not None:
            gc.collect()
        await asyncio.to_thread(release_free_memory)  # what the sessions freed, back to the system
        # A version that serves on in a new copy (files or config changed): say which copy was closed.
        replaced = key[1] in self.dataplane.versions(key[0])
        log.info("closed %s version %d%s", *key, " (its previous copy; the new one serves)" if replaced else "")

    async def unload_model(self, name: str) -> None:
        """Stop serving every version of `name` (explicit model control). A model not served is not an error:
        Triton answers success there ("has no effect"), and its clients unload to be sure, before a load."""
        if not _valid_name(name):
            raise InvalidArgument(f"{name!r} is not a model name")
        self._unloads[name] += 1
        self._next_load.pop(name, None)  # a load asked for after this unload loads again, after it
        async with self._lock(name):
            if name in self.wanted:
                self.wanted.remove(name)
            self._forget(name, lambda version: True)  # unloaded, as of one never loaded: its failures are behind it
            served = self.dataplane.versions(name)
            if not served:
                log.info("unload of %s: not loaded, nothing to do", name)
                return
            with self._saying_the_default():
                for version in served:
                    self._retire(name, version)

    async def load_model(self, name: str, parameters: Sequence[str] = ()) -> None:
        """Serve `name` by its version policy (explicit model control); loading a served model reloads it, so a
        newly published version is picked up. A failure raises FAILED_PRECONDITION, and what was served stays.

        The load is a task of its own, which the caller waits for: a caller cancelled (a client's deadline, an
        HTTP client that left) does not cancel it, and the repository index says how it ended, as Triton's
        does. Loads asked for while one of the same model runs (a client's retries) share one load after it,
        which reads the repository as it then is; an unload asked for in between makes a load asked for before
        it do nothing (loaded, then unloaded, in the order asked).

        Triton lets a load carry a model config or files (`parameters`) to override the repository's;
        mhaserve serves only what was published there, and verified.
        """
        if parameters:
            raise InvalidArgument(
                f"load parameters are not supported ({', '.join(sorted(parameters))}): publish the version into "
                "the repository (mhaserve export, or a copy) and load the model by name"
            )
        if not _valid_name(name):
            raise InvalidArgument(f"{name!r} is not a model name")
        # grpc.aio cancels a call at its deadline, and the HTTP server a request whose client left
        # (tritonclient.http gives up after 60 s by default): a load cancelled with its call threw the warmed
        # copy away and left the index saying LOADING, and a model slower to load than its clients waited could
        # never be loaded. So the look-up and the load it starts or joins go on without the caller, the look-up
        # too: on a network file system that stalls, it alone may outlast a client's deadline.
        asked = asyncio.get_running_loop().create_task(self._ask_load(name, self._unloads[name]), name=f"ask-{name}")
        self._loads.add(asked)
        asked.add_done_callback(self._asked)
        task = await asyncio.shield(asked)
        if task is not None:
            await asyncio.shield(task)

    async def _ask_load(self, name: str, unloads: int) -> asyncio.Task[None] | None:
        """The load of `name` that a load call waits for: begun, or the one queued joined; None where an unload of
        the model came while the repository was read (after this call: done, in that order)."""
        # A name the repository does not hold: NOT_FOUND, and no load failure logged or counted (a series
        # per name an admin client typed). Read off the event loop: on a network file system that stalls, the
        # event loop (every request, health check and drain) would wait for it. Shared by the load calls of the
        # model asked for meanwhile (a client's retries), each answered by a look-up begun after it came (_read).
        try:
            await self._read(self.repository.published, name, share=("published", name), of_model=True)
        except NotFound as e:
            raise self._still_serving(name, e, report=True) from None
        if self._unloads[name] != unloads or self._closing:
            return None
        task = self._next_load.get(name)
        if task is None:
            after = self._last_load.get(name)
            task = asyncio.get_running_loop().create_task(self._load_model(name, after, unloads), name=f"load-{name}")
            self._loads.add(task)
            self._last_load[name] = self._next_load[name] = task
            task.add_done_callback(partial(self._load_done, name))
        return task

    def _asked(self, task: asyncio.Task[asyncio.Task[None] | None]) -> None:
        self._loads.discard(task)
        _retrieved(task)  # NOT_FOUND: had by the caller, or by nobody where it left

    async def _load_model(self, name: str, after: asyncio.Task[None] | None, unloads: int) -> None:
        if after is not None and not after.done():
            await asyncio.wait([after])  # its outcome is its callers'
        if self._next_load.get(name) is asyncio.current_task():
            del self._next_load[name]  # begun: a load asked for from now on runs after this one
        if self._unloads[name] != unloads:
            return  # unloaded after it was asked for: what was asked is done, in its order
        try:
            await self.sync(name, strict=True)
        except NotFound as e:
            raise self._still_serving(name, e) from None
        except Exception as e:  # the reason is in the repository index and the log too
            serving = self.dataplane.versions(name)
            still = f"; still serving version {', '.join(map(str, serving))}" if serving else ""
            why = reason(e)
            raise FailedPrecondition(f"cannot load {name}: {why}{still}") from None
        if name not in self.wanted:
            self.wanted.append(name)

    def _still_serving(self, name: str, e: NotFound, *, report: bool = False) -> NotFound:
        """A load's NOT_FOUND (its folder, or every version in it, gone), saying what of the model still serves,
        as a failed load says it; with `report` (the look-up's: a sync's own is reported by the sync), said as a
        poll says it too."""
        if serving := self.dataplane.versions(name):
            if report:  # the log, the load-failure count (version 0, the model as a whole), the index: not the
                self._report(name, 0, e, None)  # caller alone
            return NotFound(f"{e.message}; still serving version {', '.join(map(str, serving))}")
        return e

    def _load_done(self, name: str, task: asyncio.Task[None]) -> None:
        self._loads.discard(task)
        for loads in (self._last_load, self._next_load):
            if loads.get(name) is task:
                del loads[name]
        _retrieved(task)  # had by the callers still waiting; else said by the log and the index (_report)

    def check_control(self) -> None:
        """Loading and unloading over the repository API are for explicit model control only (as in Triton)."""
        if self.control != "explicit":
            raise FailedPrecondition(
                f"models are loaded and unloaded by the repository API only with --model-control explicit "
                f"(this server runs with {self.control})"
            )

    # ---- polling ---------------------------------------------------------------------------------------

    def start_polling(self, interval: float) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll(interval), name="repository-poll")

    async def _poll(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                names = await self._read(self._listing)
                if names is None:
                    # A remount, a network file system's hiccup, `mv models.new models`: a read error, not a
                    # repository emptied (under `*`, every model would be retired). Nothing changes until it is back.
                    if not self._root_gone:
                        log.warning(
                            "the model repository %s cannot be read; serving what is loaded", self.repository.root
                        )
                    self._root_gone = True
                    continue
                if self._root_gone:
                    log.info("the model repository %s is back", self.repository.root)
                    self._root_gone = False
                for name in names:
                    await self._poll_one(name)
                # A model whose sync still runs (its read has not returned: _poll_one) holds its lock: retired once
                # that ends, at a later poll, not waited for here with every other model's poll behind it.
                removed = set(self.dataplane.model_names()) - set(names) - set(self._polling)
                if self.all_models and removed:
                    for name in await self._read(self._gone, removed):  # models removed from the repository
                        async with self._lock(name):
                            with self._saying_the_default():
                                for version in self.dataplane.versions(name):
                                    self._retire(name, version)
            except Exception:
                log.exception("reading the model repository failed; trying again in %g s", interval)

    async def _poll_one(self, name: str) -> None:
        """A poll's sync of `name`, waited for SLOW_READ_S at most: the poll synced the models one after another,
        and one model's file that never answered (a network file system) held every other model's poll, saying
        nothing. Past that, the sync goes on alone, said once (a warning where it still reads the repository, a
        line where it loads), and the poll turns to the next model, passing over this one until its sync ends.
        Its failure is the poll's, as before."""
        if name in self._polling:
            return  # still running since an earlier poll
        task = asyncio.get_running_loop().create_task(self.sync(name), name=f"repository-poll {name}")
        self._polling[name] = task
        done, _ = await asyncio.wait({task}, timeout=SLOW_READ_S)
        if done:
            del self._polling[name]
            task.result()
            return
        if name in self._reading_plan:
            log.warning(
                "reading model %s from the repository has not returned in %g s (a file system that does not "
                "answer?): polling the other models meanwhile, and this one again once it returns", name, SLOW_READ_S
            )  # fmt: skip
        elif name in self._planning:  # not its own read: every model thread held by reads that have not returned
            log.warning(
                "model %s waits for a thread to read the repository: the reads of %s have not returned (a file "
                "system that does not answer?); polling the other models meanwhile", name,
                ", ".join(sorted(self._reading_plan)) or "other models",
            )  # fmt: skip
        else:  # a load's steps (a checksum, a session, its warm-up) may take minutes: the load says its own
            log.info("model %s's load has gone on for %g s: polling the other models meanwhile", name, SLOW_READ_S)
        task.add_done_callback(partial(self._slow_poll_done, name))

    def _slow_poll_done(self, name: str, task: asyncio.Task[None]) -> None:
        self._polling.pop(name, None)
        if task.cancelled():
            return
        if (error := task.exception()) is not None:
            log.error("the poll of model %s failed", name, exc_info=error)
        else:
            log.info("the poll of model %s, which went on alone, has ended: polling it again", name)

    def _listing(self) -> list[str] | None:
        """The models to serve now (names()), or None while the repository folder is missing. Looked at before the
        listing and after it: a folder gone between a look and the listing was listed as empty, and under `*`
        every model retired."""
        if not self._root_is_there():
            return None
        names = self.names()  # a model's folder that cannot be read is listed: its plan says why, its failure alone
        return names if self._root_is_there() else None

    def _root_is_there(self) -> bool:
        """Whether the repository's folder is there; not where it cannot even be looked at (ESTALE, EACCES on a
        folder above, EIO: pathlib's is_dir() takes only "no such folder" for False, and raises the rest)."""
        try:
            return self.repository.root.is_dir()
        except OSError:
            return False

    def _gone(self, names: set[str]) -> set[str]:
        """Of the models `names`, served and not in the poll's listing, those the repository holds no version of
        now (its folder gone, or every version), while the repository's folder is there: a listing taken while
        that folder was away for a moment (moved out and back) read as empty, which the looks around it do not
        see, and every model was retired."""
        gone = set()
        for name in names:
            try:
                if not mf.versions(self.repository.root, name):
                    gone.add(name)
            except (OSError, mf.ManifestError):
                pass  # a folder that cannot be read is not taken for one removed
        return gone if self._root_is_there() else set()

    # ---- the index, and the end ----------------------------------------------------------------------------

    async def index(self, *, ready_only: bool = False) -> list[IndexEntry]:
        """Every model of the repository (and every served one), each version's state and why. The repository
        is listed off the event loop: on a network file system that stalls, the event loop would wait for it.
        Index calls made while a listing is under way share the next one, begun once it ends (an admin client
        polling the index through a stall holds one thread, not one a call); each call's listing begins after
        the call came, so a model published before it is listed."""
        return self.entries(await self._read(self.repository.names, share=("names",)), ready_only=ready_only)

    def entries(self, listed: Iterable[str], *, ready_only: bool = False) -> list[IndexEntry]:
        """The index, `listed` being the repository's models (`index` lists them): every one of them and every
        served one, each version's state and why."""
        entries: list[IndexEntry] = []
        names = sorted(set(listed) | set(self.dataplane.model_names()))
        for name in names:
            known = sorted((v, s) for (n, v), s in self.states.items() if n == name)
            # A failure of the model as a whole (version 0: its serving.json, its folder) is listed as such only
            # where it serves nothing: each version it serves says it, as its reason, and is READY.
            served = any(version and state.state == "READY" for version, state in known)
            for version, state in known:
                if version == 0 and served:
                    continue
                entries.append(IndexEntry(name, str(version) if version else "", state.state, state.reason))
            if not known:
                entries.append(IndexEntry(name, "", "UNAVAILABLE", "unloaded"))
        return [e for e in entries if e.state == "READY"] if ready_only else entries

    async def _read(
        self, read: Callable[..., T], *args: Any, share: Hashable | None = None, of_model: bool = False
    ) -> T:
        """`read(*args)` on the repository's threads (see `_reads`), or with `of_model` on those that read one
        model's files (MODEL_READ_THREADS). With `share`, calls share a read, but only one
        begun after they came: a call made while a read of the same key is under way waits for the next, begun
        once that one ends and shared by every call made meanwhile. The read under way may have begun before the
        caller's own last step (a model published, and then loaded or listed): its answer would be a NOT_FOUND
        for the model just published, or an index without it. A stall holds one thread however many calls come;
        each waits through a shield, so one that leaves (a client's deadline) leaves the read to the others. A
        read no call shares goes with its caller if it has not begun (one begun runs on: a thread cannot be
        stopped)."""
        if self._closing:
            raise Unavailable("the server is stopping")
        pool = self._model_reads if of_model else self._reads
        if share is None:
            result: T = await self._off_loop(pool, read, *args)
            return result
        if share not in self._reading:
            pending = self._begin_read(share, pool, read, args, contextvars.copy_context())
        else:
            queued = self._queued.get(share)
            if queued is None:
                future = asyncio.get_running_loop().create_future()
                future.add_done_callback(_retrieved)  # had by its callers, or by nobody where they all left
                queued = self._queued[share] = _Queued(future, pool, read, args, contextvars.copy_context())
            pending = queued.future
        try:
            result = await asyncio.shield(pending)
        except asyncio.CancelledError:
            if pending.cancelled():  # the read itself, not its caller: dropped unbegun by close()'s shut pool
                raise Unavailable("the server is stopping") from None
            raise
        return result

    def _begin_read(
        self,
        share: Hashable,
        pool: CountingPool,
        read: Callable[..., Any],
        args: tuple[Any, ...],
        context: contextvars.Context,
    ) -> asyncio.Future[Any]:
        pending = asyncio.get_running_loop().run_in_executor(pool, partial(context.run, read, *args))
        self._reading[share] = pending
        pending.add_done_callback(partial(self._read_done, share))
        return pending

    def _read_done(self, share: Hashable, read: asyncio.Future[Any]) -> None:
        _retrieved(read)
        if self._reading.get(share) is read:
            del self._reading[share]
        queued = self._queued.pop(share, None)
        if queued is None or queued.future.done():  # (failed by close())
            return
        if self._closing:  # ended while close() ran: no read begins on a stopping manager
            queued.future.set_exception(Unavailable("the server is stopping"))
            return
        # The calls made while `read` ran: their own read, begun now, after each of them came.
        pending = self._begin_read(share, queued.pool, queued.read, queued.args, queued.context)
        pending.add_done_callback(partial(_copy_outcome, queued.future))

    @staticmethod
    async def _off_loop(pool: CountingPool, call: Callable[..., T], *args: Any) -> T:
        """`call(*args)` in one of `pool`'s threads, in a copy of this task's context (the request id for what it
        logs), as asyncio.to_thread runs it in the default executor's."""
        bound = partial(contextvars.copy_context().run, call, *args)
        return await asyncio.get_running_loop().run_in_executor(pool, bound)

    async def close(self) -> None:
        # First: a look-up or read that ends during any of the awaits below begins nothing (_ask_load, _read_done).
        self._closing = True
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        polling = list(self._polling.values())  # a sync the poll left to go on alone (_poll_one)
        for task in polling:
            task.cancel()
        await asyncio.gather(*polling, return_exceptions=True)
        # A load under way whose callers have gone (the server stopped listening before this): ended, not
        # left pending on a loop that closes. What it made is closed with it (_load). A look-up that ends
        # meanwhile begins no load (_ask_load), and every task is cancelled before any is waited for.
        while self._loads:
            tasks = list(self._loads)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loads.difference_update(tasks)  # (their done callbacks have dropped them: this bounds the loop alone)
        retiring = dict(self._retiring)
        for task in retiring:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pipeline in [*self.dataplane.pipelines(), *retiring.values()]:
            if not pipeline.closed:
                await pipeline.batcher.close()
                pipeline.close()
        # A read stalled on a network file system may never return, so the pools are not waited for: their idle
        # threads end now, a read not yet begun is dropped, and a stalled read's thread ends once it returns
        # (its result, which no caller waits for any more, dropped: asyncio drops it once the loop has closed).
        # The reads queued behind a stalled one would never begin.
        for queued in self._queued.values():
            if not queued.future.done():
                queued.future.set_exception(Unavailable("the server is stopping"))
        self._queued.clear()
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._model_reads.shutdown(wait=False, cancel_futures=True)
        self._loading.shutdown(wait=False, cancel_futures=True)

    @property
    def busy(self) -> tuple[int, int]:
        """Reads of the repository and loads' steps still running in their threads (stalled, where the server
        has stopped): each would hold the process's exit, which joins the pools' threads."""
        return self._reads.running + self._model_reads.running, self._loading.running

    def pipelines(self) -> list[Pipeline]:
        """Every pipeline with a batcher: the versions served and those retiring (finishing what they hold)."""
        return [*self.dataplane.pipelines(), *self._retiring.values()]

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A future's exception marked as seen, where all its callers may have left: asyncio logs one never seen."""
    if not future.cancelled():
        future.exception()


def _copy_outcome(to: asyncio.Future[Any], source: asyncio.Future[Any]) -> None:
    if to.done():
        return
    if source.cancelled():
        to.cancel()
    elif (error := source.exception()) is not None:
        to.set_exception(error)
    else:
        to.set_result(source.result())


def _release_memory(engine: weakref.ref[Engine]) -> None:
    """`release_memory` on an inference thread, given the engine weakly: an executor's thread drops its call's
    arguments only after the caller is told the result, so a strong one could still hold the engine, and its
    sessions, when the closing coroutine checks for the last reference (then a needless full collection)."""
    alive = engine()
    if alive is not None:
        release_memory(alive)


def _stat(path: os.PathLike[str]) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _valid_name(name: str) -> bool:
    return bool(mf.NAME_RE.match(name))


def _identity(entry: ModelEntry) -> str:
    """What a served version is: its graph (the one served, by sha256), the external data it reads (a model past
    1.5 GB: the graph's sha256 covers the data file's name, not its weights) and its serving config."""
    data = sorted((entry.manifest.graphs[entry.graph].external_data or {}).items())
    return f"{entry.graph} {entry.sha256} {data} {entry.config!r}"
