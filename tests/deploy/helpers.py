"""Helpers for the deployment tests: the repo's files, external binaries, and real `mhaserve serve` processes.

Live tests start servers (and nginx, Prometheus) as subprocesses on free loopback ports and always stop
what they started; every wait has a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing import loopback
from mhaserve.testing.loopback import WAIT, free_ports
from mhaserve.testing.metrics import scrape

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENCODE = "encoder.v1.EncoderService/Encode"
EMBEDDINGS = "POST /v1/embeddings"
# The `method` label of the calls each protocol's plain client makes (tests/deploy/load.py).
METHODS = {"grpc": ENCODE, "http": EMBEDDINGS}


def find_binary(name: str) -> str | None:
    """A binary on PATH, or in /usr/sbin (Debian puts nginx there, off a normal user's PATH)."""
    found = shutil.which(name)
    if found is None and os.access(f"/usr/sbin/{name}", os.X_OK):
        found = f"/usr/sbin/{name}"
    return found


def needs(name: str, package: str | None = None) -> pytest.MarkDecorator:
    """Skip unless `name` is installed; the reason says how to get it."""
    return pytest.mark.skipif(
        find_binary(name) is None,
        reason=f"{name} is not installed (apt-get install --no-install-recommends {package or name}; "
        ".ci/run installs it when it runs as root)",
    )


def wait_until(condition: Callable[[], bool], what: str, timeout: float = WAIT, interval: float = 0.1) -> None:
    """Polls at 0.1 s by default: the conditions here are HTTP probes of nginx, Prometheus and servers."""
    loopback.wait_until(condition, what, timeout, interval)


def load_yaml_all(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def http_get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
        return body


def render_envsubst(template: str, env: Mapping[str, str]) -> str:
    """What the nginx image's entrypoint does with a template: envsubst restricted to the variables
    that are set, so nginx's own $variables survive."""

    def sub(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return env[name] if name in env else m.group(0)

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, template)


def health(address: str, timeout: float = 2.0) -> str:
    with grpc.insecure_channel(address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))


def encode(stub: pb_grpc.EncoderServiceStub, text: str, timeout: float = 10.0) -> pb.EncodeResponse:
    resp: pb.EncodeResponse = stub.Encode(pb.EncodeRequest(texts=[text]), timeout=timeout)
    return resp


class Process:
    """A subprocess whose output goes to a file; stop() always leaves nothing running."""

    def __init__(self, args: list[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = ROOT) -> None:
        self.args, self.log_path = args, log
        self._log = log.open("wb")
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=cwd
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: int) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        try:
            if self.alive():
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            return self.proc.returncode
        finally:
            self._log.close()


class Replica(Process):
    """`mhaserve serve` on free loopback ports, SERVING when constructed; the HTTP port only with `http`."""

    def __init__(self, repository: Path, workdir: Path, name: str, http: bool = False, **settings: str) -> None:
        self.port, self.metrics_port, http_port = free_ports(3)  # distinct, all held while chosen
        self.http_port = http_port if http else 0
        env = {k: v for k, v in os.environ.items() if not k.startswith("MHASERVE_")}
        args = [sys.executable, "-m", "mhaserve.cli", "serve", "--repository", str(repository), "--host", "127.0.0.1"]
        args += [
            "--port",
            str(self.port),
            "--metrics-port",
            str(self.metrics_port),
            "--http-port",
            str(self.http_port),
            "--device",
            "cpu",
        ]
        args += ["--intra-op-threads", "1", "--grace-period", "10"]
        for k, v in settings.items():
            args += ["--" + k.replace("_", "-"), v]
        super().__init__(args, workdir / f"{name}.log", env=env)
        try:
            wait_until(
                lambda: not self.alive() or health(self.address) == "SERVING", f"{name} to be SERVING", interval=0.2
            )
            assert self.alive(), f"{name} exited with {self.proc.returncode}:\n{self.log()}"
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_address(self) -> str:
        assert self.http_port, "started without its HTTP port (http=True)"
        return f"127.0.0.1:{self.http_port}"

    def encode_ok(self, protocol: str = "grpc") -> float:
        """Encode calls (gRPC) or OpenAI embeddings requests (http) this replica answered OK, from its /metrics."""
        return scrape(self.metrics_port).get("mhaserve_requests_total", method=METHODS[protocol], code="OK")


def compose_file() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return doc


def server_defaults() -> Any:
    from mhaserve.service.settings import Settings

    return Settings()


def metric_samples() -> set[str]:
    """Every sample name the server can export, from its metric definitions (no server needed), and those the
    --processes supervisor adds of its own."""
    from mhaserve.service.metrics import Metrics
    from mhaserve.service.processes import Gathered

    names: set[str] = set()
    for family in [*Metrics().registry.collect(), *Gathered([], "127.0.0.1").collect()]:
        suffixes = {
            "counter": ["_total", "_created"],
            "histogram": ["_bucket", "_sum", "_count", "_created"],
            "gauge": [""],
            "info": ["_info"],
        }.get(family.type, [""])
        names.update(family.name + s for s in suffixes)
    return names


def signal_name(sig: int) -> str:
    return signal.Signals(sig).name
