"""What every scenario shares: how a call's outcome is read, and the token the scripted engine holds on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

OK = grpc.StatusCode.OK.name

# The token id a ScriptedEngine(hang_on=HOLD) holds its batch on (until released): the scenarios that need
# requests queued behind a batch, or an engine that never returns, send it.
HOLD = 99


def code_of(call: Callable[[], Any]) -> tuple[str, Any]:
    """Make a call; its status code's name, and its result (None unless OK)."""
    try:
        return OK, call()
    except grpc.RpcError as e:
        return e.code().name, None
    except grpc.FutureCancelledError:  # a future the client cancelled itself
        return grpc.StatusCode.CANCELLED.name, None
