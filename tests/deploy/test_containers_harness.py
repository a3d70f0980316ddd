"""The container tier's harness (containers.py) where it decides something itself, tested without an engine."""

from __future__ import annotations

import subprocess

import pytest

from tests.deploy.containers import PORT_TAKEN, START, Compose


class ScriptedCompose(Compose):
    """A Compose whose commands answer as scripted: `up` by the outcomes given, in turn; `down` succeeds."""

    def __init__(self, *ups: subprocess.CompletedProcess[str] | subprocess.TimeoutExpired) -> None:
        self.project = "scripted"
        self.ups = list(ups)
        self.commands: list[str] = []

    def __call__(self, *args: str, timeout: float = START) -> subprocess.CompletedProcess[str]:
        self.commands.append(args[0])
        if args[0] != "up":
            return subprocess.CompletedProcess(args, 0, "", "")
        outcome = self.ups.pop(0)
        if isinstance(outcome, subprocess.TimeoutExpired):
            raise outcome
        return outcome


def done(code: int, stderr: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.CompletedProcess(["compose", "up"], code, "", stderr)


def test_up_starts_again_once_when_a_published_host_port_was_taken() -> None:
    """podman-compose hangs (here: times out) when a replica's ephemeral host port is taken; the stack is
    taken down and started once more, and the second start is the result."""
    taken = f"cannot listen on the TCP port: listen tcp4 127.0.0.1:33069: bind: {PORT_TAKEN}\n".encode()
    compose = ScriptedCompose(subprocess.TimeoutExpired(["podman-compose"], START, output=b"", stderr=taken), done(0))
    compose.up("encoder", "lb", scale={"encoder": 2})
    assert compose.commands == ["up", "down", "up"]


def test_up_fails_on_any_other_error_and_on_a_second_taken_port() -> None:
    other = ScriptedCompose(done(1, "Error: no such image"), done(0))
    with pytest.raises(AssertionError, match="no such image"):
        other.up("encoder")
    assert other.commands == ["up"]

    twice = ScriptedCompose(done(125, f"bind: {PORT_TAKEN}"), done(125, f"bind: {PORT_TAKEN} again"))
    with pytest.raises(AssertionError, match="again"):
        twice.up("encoder")
    assert twice.commands == ["up", "down", "up"]
