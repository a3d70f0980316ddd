"""The data plane: what every protocol adapter calls, and nothing else.

MLServer and KServe serve REST and gRPC from one `DataPlane` object; so does mhaserve. Adapters
(encoder.v1, the Open Inference Protocol over gRPC and REST, OpenAI's HTTP API) only decode the wire
into an `EncodeInput`, ask the data plane, and encode its answer back. The data plane knows which
models are served (one Pipeline per model version), whether the server is ready, and why not.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Iterator
from typing import Literal

from mhaserve.runtime.errors import InvalidArgument, NotFound, ServiceError, Unavailable
from mhaserve.runtime.manifest import number
from mhaserve.runtime.repository import preferred_default
from mhaserve.service.pipeline import EncodeInput, EncodeOutput, Pipeline

# unready: NOT_SERVING for balancers, but requests still served (the drain delay); closing: the listeners
# are stopping (GOAWAY), and the requests already sent are still served.
State = Literal["new", "loading", "serving", "stalled", "unready", "closing", "draining", "stopped"]

# A held call returns this long before its deadline, so that its refusal reaches the client in time even
# from a busy machine (a call whose deadline is nearer is refused at once).
HOLD_MARGIN = 0.25


# What a call is told while the server drains (and a connection a stop sends away: http/server.py).
SHUTTING_DOWN = "the server is shutting down; retry on another replica"


class DataPlane:
    """The served models and the server's state. The server (server.py) changes them; adapters read them."""

    def __init__(self, *, loading_wait: float = 0.0, max_held: int = 2048) -> None:
        self.loading_wait = loading_wait
        self.max_held = max_held  # calls waiting for the load at once; past it, refused at once
        self._held = 0
        self._settled = asyncio.Event()  # set once the state is past loading (served, failed, or draining)
        self._state: State = "new"
        self._pipelines: dict[str, dict[int, Pipeline]] = {}  # name -> version -> pipeline
        self._default = ""
        self._follow = False  # the default was not named (`*`, or no --model): re-chosen among the served
        # The versions loads run for: one at a time for a model (models.py's lock), so a set, not a count
        self._loading: set[tuple[str, int]] = set()

    # ---- what the server does ----------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, value: State) -> None:
        self._state = value
        if value in ("new", "loading"):
            self._settled.clear()
        else:
            self._settled.set()

    def add(self, pipeline: Pipeline) -> None:
        """Serve a model version (at once: the next request that asks for its model's latest gets it)."""
        name = pipeline.model.name
        self._pipelines.setdefault(name, {})[pipeline.model.version] = pipeline
        self._default = self._default or name

    def remove(self, name: str, version: int) -> Pipeline | None:
        """Stop routing requests to a model version; requests it holds already finish on it."""
        versions = self._pipelines.get(name, {})
        pipeline = versions.pop(version, None)
        if not versions:
            self._pipelines.pop(name, None)
        return pipeline

    @contextlib.contextmanager
    def loading(self, name: str, version: int) -> Iterator[None]:
        """While a version loads (models.py), a call for it that nothing served answers is told so: UNAVAILABLE,
        which clients retry, where NOT_FOUND reads as a wrong name. A served version being loaded again (its files
        changed) goes on answering."""
        self._loading.add((name, version))
        try:
            yield
        finally:
            self._loading.discard((name, version))

    def set_default(self, name: str, *, follow: bool = False) -> None:
        """The model of requests that name none: the first model the server was told to serve. With `follow`
        (no model was named: `*`, or none), the repository's default among the models served at the time
        (all-minilm-l6-v2 if served, else the first by name), `name` while none is: fixed at start, once it
        was unloaded or removed from the repository, every request that named no model failed, /info too."""
        self._default = name
        self._follow = follow

    def pipelines(self) -> list[Pipeline]:
        """Every model version served, by name then version."""
        return [p for name in sorted(self._pipelines) for _, p in sorted(self._pipelines[name].items())]

    # ---- what adapters ask --------------------------------------------------------------------------

    def refusal(self, *, control: bool = False) -> ServiceError | None:
        """Why a model call would be refused now (loading, stalled, draining), or None when serving. `control`:
        a call of the repository API (index, load, unload), which is answered while a model is stalled, since
        loading a version again or unloading it is what an operator does about one."""
        if self.state in ("draining", "stopped"):
            return Unavailable(SHUTTING_DOWN)
        if self.state == "stalled":
            if control:
                return None
            return Unavailable("the model is not responding (--inference-timeout passed); retry on another replica")
        if self.state not in ("serving", "unready", "closing"):
            return Unavailable("the model is still loading; retry when health reports SERVING")
        return None

    def serving(self) -> bool:
        """Whether model calls are taken now: an UNAVAILABLE while they are concerns its own call (a model or
        version loading, a version retired), not the server, and does not end a stream (`streaming.ordered`)."""
        return self.refusal() is None

    async def admission(self, time_left: float | None = None, *, control: bool = False) -> ServiceError | None:
        """`refusal(control=control)`, after waiting up to `loading_wait` seconds (and no later than the call's
        deadline, `time_left` seconds away) for a model that is still loading.

        Why wait: a balancer may send a call to a replica that has just started before its health checks
        have found it loading (HAProxy 2.6 takes a restarted replica's new address as UP until its first
        check; docs/deploy.md). Refused, a gRPC call fails at its client, since the error travels in a
        response no proxy can replay; held, it is answered a few seconds late instead.
        """
        wait = self.hold(time_left)
        if wait <= 0:
            return self.refusal(control=control)
        self._held += 1
        try:
            with contextlib.suppress(TimeoutError):  # still loading: refused below
                async with asyncio.timeout(wait):  # not wait_for, which can swallow the client's cancellation
                    await self._settled.wait()
        finally:
            self._held -= 1
        return self.refusal(control=control)

    def hold(self, time_left: float | None = None) -> float:
        """The seconds `admission` would hold a call that comes now, `time_left` seconds before its deadline, for
        the model that is loading: 0 where it answers at once (served, stalled, draining, no --loading-wait, or
        --max-queue-size calls held already). The HTTP port reads the request's body first when it is not 0."""
        if self.loading_wait <= 0 or self._state not in ("new", "loading"):
            return 0.0
        if self._held >= self.max_held:  # a flood while loading is refused, not piled up
            return 0.0
        wait = self.loading_wait if time_left is None else min(self.loading_wait, time_left - HOLD_MARGIN)
        return max(wait, 0.0)

    def not_ready(self) -> str | None:
        """Why a health check says NOT_SERVING now (loading, stalled, draining, or about to), or None."""
        if self.state in ("unready", "closing"):
            return "the server is shutting down; requests are still served until balancers have moved away"
        refusal = self.refusal()
        return None if refusal is None else refusal.message

    @property
    def ready(self) -> bool:
        return self.state == "serving"

    @property
    def default_model(self) -> str:
        # Not named: the repository's default among those served now, as a server started now would choose (it
        # stayed the served one chosen before, and replicas started before and after a publish differed).
        if self._follow and self._pipelines:
            return preferred_default(self._pipelines)
        return self._default

    def model_names(self) -> list[str]:
        return sorted(self._pipelines)

    def versions(self, name: str) -> list[int]:
        """The versions of a model that are served, ascending."""
        return sorted(self._pipelines.get(name, {}))

    def resolve(self, name: str = "", version: int | str | None = None) -> Pipeline:
        """The pipeline of a model (empty: the default) at a version (None or "": its latest served one).

        NOT_FOUND for a model or version not served (every model too, once all were unloaded); UNAVAILABLE
        while nothing is loaded yet, and for one that is loading (`loading`).
        """
        if not self._pipelines and (refusal := self.refusal()) is not None:
            raise refusal
        asked = name or self.default_model
        name, colon, named_version = asked.partition(":")
        if colon and not (name and named_version):
            raise InvalidArgument(
                f"model {asked!r}: name a model, or name:version (e.g. {name or 'model'}:1)", param="model"
            )
        if named_version and version not in (None, "", 0) and _differ(version, named_version):
            raise InvalidArgument(
                f"the model is named {name}:{named_version} and the version asked for is {version}: ask for one"
            )
        if named_version and version in (None, "", 0):
            version = named_version
        latest = version is None or version in ("", 0)
        number = _version_number(version) if version is not None and not latest else None
        versions = self._pipelines.get(name)
        if not versions:
            if latest or number is not None:  # not a version that is no number (n:abc), which never loads
                self._check_loading(name, number)
            served = _listing(self._pipelines)
            raise NotFound(f"model {name!r} is not served here (this server serves {served})", param="model")
        if latest:
            return versions[max(versions)]
        if number not in versions:
            if number is not None:
                self._check_loading(name, number)
            raise NotFound(
                f"model {name!r} version {version!r} is not served here "
                f"(serving version{'s' if len(versions) > 1 else ''} {', '.join(map(str, sorted(versions)))})",
                param="model",
            )
        return versions[number]

    def _check_loading(self, name: str, version: int | None = None) -> None:
        """UNAVAILABLE for a model (any version of it) or a version that is loading, which nothing served answers."""
        if any(n == name and version in (None, v) for n, v in self._loading):
            what = f"model {name!r}" if version is None else f"model {name!r} version {version}"
            raise Unavailable(f"{what} is loading; retry in a moment")

    def queue_share(self, inputs: int, name: str = "", version: int | str | None = None) -> float:
        """`Pipeline.queue_share` of the model version a stream's request names. 0 for a model not served: the
        request is refused at once, as it is computed."""
        try:
            return self.resolve(name, version).queue_share(inputs)
        except ServiceError:
            return 0.0

    async def encode(self, request: EncodeInput, *, time_left: float | None = None) -> EncodeOutput:
        """Embed a request with the model version it names; `time_left` is the seconds until its deadline."""
        return await self.resolve(request.model, request.version).encode(request, time_left=time_left)


def _version_number(version: int | str) -> int | None:
    if isinstance(version, int):
        return version
    return number(version)


def _differ(version: int | str, named: str) -> bool:
    """Whether a version asked for and one in the model's name (`name:01`) are two: compared as numbers, `01`
    and `1` are one (by their digits past leading zeros: number() reads any two past 19 digits alike)."""
    asked = str(version)
    if _version_number(asked) is None or _version_number(named) is None:
        return asked != named
    return (asked.lstrip("0") or "0") != (named.lstrip("0") or "0")


def _listing(pipelines: dict[str, dict[int, Pipeline]]) -> str:
    names: Iterable[str] = sorted(pipelines)
    return ", ".join(repr(n) for n in names) or "no model now: every one was unloaded"
