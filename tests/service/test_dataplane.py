"""The data plane's admission while the model loads (--loading-wait), on its own event loop."""

from __future__ import annotations

import asyncio
import time

from mhaserve.runtime.errors import InvalidArgument, NotFound, ServiceError, Unavailable
from mhaserve.service.dataplane import HOLD_MARGIN, DataPlane


def test_admission_waits_for_the_load_within_the_deadline_and_the_bound() -> None:
    async def scenario() -> None:
        plane = DataPlane(loading_wait=5.0, max_held=2)
        plane.state = "loading"
        first = asyncio.create_task(plane.admission(None))
        second = asyncio.create_task(plane.admission(None))
        await asyncio.sleep(0.05)
        assert not first.done() and not second.done()
        # Past max_held: refused at once, not piled up.
        started = time.monotonic()
        refused = await plane.admission(None)
        assert refused is not None and "still loading" in refused.message
        assert time.monotonic() - started < 0.1
        plane.state = "serving"
        assert await first is None and await second is None
        assert plane.refusal() is None and plane._held == 0

    asyncio.run(scenario())


def test_a_short_deadline_is_refused_before_it_and_no_wait_refuses_at_once() -> None:
    async def scenario() -> None:
        plane = DataPlane(loading_wait=5.0)
        plane.state = "loading"
        started = time.monotonic()
        refused = await plane.admission(0.6)
        took = time.monotonic() - started
        assert refused is not None and "still loading" in refused.message
        assert 0.6 - HOLD_MARGIN - 0.01 <= took < 0.6, took  # refused before the deadline, not at it
        plane = DataPlane()  # --loading-wait 0: today's behaviour
        plane.state = "loading"
        assert (await asyncio.wait_for(plane.admission(None), 0.1)) is not None

    asyncio.run(scenario())


async def _held() -> tuple[DataPlane, asyncio.Task[ServiceError | None]]:
    """A data plane whose model loads, and a call held for it."""
    plane = DataPlane(loading_wait=5.0)
    plane.state = "loading"
    held = asyncio.create_task(plane.admission(None))
    await asyncio.sleep(0.05)
    return plane, held


def test_a_drain_or_a_failed_load_ends_the_wait_with_its_own_refusal() -> None:
    async def scenario() -> None:
        plane, held = await _held()
        plane.state = "draining"
        refused = await asyncio.wait_for(held, 1.0)
        assert refused is not None and "shutting down" in refused.message

    asyncio.run(scenario())


def test_a_call_cancelled_in_the_turn_the_load_ends_stays_cancelled() -> None:
    """The client went away (its call cancelled) in the same turn as the model came up: the hold ends in the
    cancellation, not in an admission for a call nobody waits for (asyncio.wait_for on Python 3.11 returned
    the wait's result instead)."""

    async def scenario() -> None:
        plane, held = await _held()
        plane.state = "serving"
        held.cancel()
        await asyncio.wait([held], timeout=1.0)
        assert held.cancelled()
        assert plane._held == 0

    asyncio.run(scenario())


def test_a_model_or_version_that_loads_is_unavailable_and_anything_else_is_still_refused_as_it_was() -> None:
    """With nothing served, a model loading made every call that named it UNAVAILABLE "model 'n' is loading",
    a version that will never come (n:5) and a malformed name (n:) too."""
    plane = DataPlane()
    plane.state = "serving"  # every model unloaded, one loading again

    def refusal(name: str, version: int | str | None = None) -> tuple[type[ServiceError], str]:
        try:
            plane.resolve(name, version)
        except ServiceError as e:
            return type(e), e.message
        raise AssertionError("resolved")

    with plane.loading("n", 1):
        assert refusal("n") == (Unavailable, "model 'n' is loading; retry in a moment")
        assert refusal("n:1") == refusal("n", 1) == (Unavailable, "model 'n' version 1 is loading; retry in a moment")
        assert refusal("n:5")[0] is refusal("n", "7")[0] is refusal("n:abc")[0] is refusal("n", "-1")[0] is NotFound
        assert refusal("n:")[0] is InvalidArgument
        assert refusal("x") == (NotFound, "model 'x' is not served here (this server serves no model now: every one "
                                          "was unloaded)")  # fmt: skip
    assert refusal("n")[0] is NotFound
