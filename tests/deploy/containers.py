"""The container tier's helpers: the engine (docker or podman, whichever answers), the images built from
this checkout, containers and compose projects that are always removed again.

Everything published goes to 127.0.0.1 on free ports; every wait has a deadline. The compose projects
carry unique names (`mhaserve-test-<pid>-<n>`) and the images tags of their own (`mhaserve:cpu-test-<hash
of this checkout>`), so that two checkouts testing on one machine never touch each other's containers
or images (layers are shared: the extra tags cost nothing).

What a session builds it removes again when it ends (this checkout's tags and the untagged images its builds
left), since every fresh clone tags anew and a machine that runs the suite often would otherwise fill its
disk; MHASERVE_TEST_KEEP_IMAGES=1 keeps them for a faster next run from the same checkout. Compose projects
of earlier sessions whose pytest died before its teardown are removed when the next session starts.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mhaserve.service import client
from mhaserve.testing.loopback import free_ports, wait_until
from mhaserve.testing.metrics import Samples, scrape
from tests.deploy.helpers import METHODS, ROOT, http_get

# Cold start of a replica (load, warm-up) and of the engine's containers on a busy 2-core machine.
START = 120.0
# How the engine says a host port it was to publish is taken (see Compose.up).
PORT_TAKEN = "address already in use"
# What a build may take cold: base image, pip downloads, the export with its parity gate (about 10 min here).
BUILD = 2400.0
ENGINE_HINT = "as root on Debian, deploy/images/install-podman.sh installs and configures podman (.ci/run runs it)"
ENCODE = "encoder.v1.EncoderService/Encode"
# Variables of the compose files that the tests set themselves; the caller's values must not leak in.
COMPOSE_PREFIXES = ("MHASERVE_", "LOCUST_", "LOADTEST_", "GRAFANA_", "PROMETHEUS_", "NGINX_", "HAPROXY_", "COMPOSE_")


def run(
    args: Sequence[str], timeout: float = 60.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, stdin=subprocess.DEVNULL
    )


@dataclass(frozen=True)
class Engine:
    """docker or podman, as found answering on this machine."""

    name: str
    version: str

    def __call__(self, *args: str, timeout: float = 60.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = run([self.name, *args], timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{self.name} {' '.join(args)} exited {result.returncode}:\n{result.stderr[-3000:]}")
        return result

    def inspect(self, container: str) -> dict[str, Any]:
        (info,) = json.loads(self("inspect", "--type", "container", container).stdout)
        return dict(info)

    def state(self, container: str) -> dict[str, Any]:
        return dict(self.inspect(container)["State"])

    def healthy(self, container: str) -> bool:
        """Whether the image's HEALTHCHECK passes now. podman runs health checks from systemd timers, which
        machines without systemd (containers, CI) lack: there the check is run on demand, as its timer would."""
        if self.name == "podman":
            self("healthcheck", "run", container, check=False, timeout=30)
        health = self.state(container).get("Health") or self.state(container).get("Healthcheck") or {}
        return bool(health.get("Status") == "healthy")

    def wait_healthy(self, container: str, timeout: float = START) -> float:
        """Seconds until healthy; fails early, with the log, if the container stops."""
        start = time.monotonic()

        def done() -> bool:
            if not self.state(container)["Running"]:
                raise AssertionError(f"{container} stopped before it was healthy:\n{self.logs(container)}")
            return self.healthy(container)

        wait_until(done, f"{container} to be healthy", timeout, interval=1.0)
        return time.monotonic() - start

    def host_port(self, container: str, port: int) -> int:
        """The 127.0.0.1 port a container port is published on (and that it is published there only)."""
        lines = self("port", container, f"{port}/tcp").stdout.split()
        assert lines, f"{container} does not publish {port}"
        for line in lines:
            host, _, published = line.rpartition(":")
            assert host == "127.0.0.1", f"{container} publishes {port} on {line}: tests publish on loopback only"
        return int(lines[0].rpartition(":")[2])

    def logs(self, container: str, last: int | None = 6000) -> str:
        """The container's output (stdout, then stderr), the `last` characters of it (None: all)."""
        result = self("logs", container, check=False)
        text = result.stdout + result.stderr
        return text if last is None else text[-last:]

    def exit_code(self, container: str) -> int:
        return int(self.state(container)["ExitCode"])

    def exec(self, container: str, *command: str) -> subprocess.CompletedProcess[str]:
        return self("exec", container, *command, check=False)

    def remove(self, *kind_and_name: str) -> None:
        """Force-remove a container (no stop timeout) or, with a kind first (network, pod, volume), that."""
        if len(kind_and_name) == 1:
            wait = ["-t", "0"] if self.name == "podman" else []
            self("rm", "-f", *wait, kind_and_name[0], check=False, timeout=120)
        else:
            self(*kind_and_name[:1], "rm", "-f", *kind_and_name[1:], check=False, timeout=120)


def find_engine() -> tuple[Engine | None, str]:
    """The engine to test with (CONTAINER_ENGINE picks one), or None and why there is none."""
    names = [os.environ["CONTAINER_ENGINE"]] if os.environ.get("CONTAINER_ENGINE") else ["docker", "podman"]
    tried = []
    for name in names:
        if shutil.which(name) is None:
            tried.append(f"no {name}")
            continue
        try:
            info = run([name, "info", "--format", "json"], timeout=30)
        except subprocess.TimeoutExpired:
            tried.append(f"`{name} info` did not answer in 30 s")
            continue
        if info.returncode != 0:
            tried.append(f"`{name} info` failed: {(info.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        version = run([name, "version", "--format", "{{.Client.Version}}"], timeout=30).stdout.strip()
        return Engine(name, version), ""
    return None, f"no container engine answers ({'; '.join(tried)}); {ENGINE_HINT}"


ENGINE, NO_ENGINE = find_engine()
needs_engine = pytest.mark.skipif(ENGINE is None, reason=NO_ENGINE)


def engine() -> Engine:
    assert ENGINE is not None, NO_ENGINE
    return ENGINE


# ---- images ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Images:
    """Tags of the images built from this checkout."""

    cpu: str
    loadtest: str
    haproxy: str
    nginx: str
    prometheus: str

    def tags(self) -> list[str]:
        return list(vars(self).values())


KEEP_IMAGES = os.environ.get("MHASERVE_TEST_KEEP_IMAGES", "") not in ("", "0")


def checkout_tag() -> str:
    return "test-" + hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]


def checkout_images() -> Images:
    """The tags this checkout's images get."""
    suffix = checkout_tag()
    return Images(
        cpu=f"mhaserve:cpu-{suffix}",
        loadtest=f"mhaserve:loadtest-{suffix}",
        haproxy=f"mhaserve-haproxy:bookworm-{suffix}",
        nginx=f"mhaserve-nginx:bookworm-{suffix}",
        prometheus=f"mhaserve-prometheus:bookworm-{suffix}",
    )


def build_images(log: Path) -> Images:
    """deploy/images/build.sh, as `make images` runs it, for every image the tier uses. The engine's build
    cache makes this a few seconds when nothing changed."""
    images = checkout_images()
    env = dict(os.environ) | {
        "CONTAINER_ENGINE": engine().name,
        "CPU_TAG": images.cpu,
        "LOADTEST_TAG": images.loadtest,
        "HAPROXY_TAG": images.haproxy,
        "NGINX_TAG": images.nginx,
        "PROMETHEUS_TAG": images.prometheus,
    }
    # The pip the build script asks about this host's pip configuration: the one running the tests.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    with log.open("w") as out:
        result = subprocess.run(
            [str(ROOT / "deploy/images/build.sh"), "cpu", "loadtest", "haproxy", "nginx", "prometheus"],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            timeout=BUILD,
            env=env,
            cwd=ROOT,
        )
    if result.returncode != 0:
        tail = log.read_text(errors="replace")[-4000:]
        raise AssertionError(f"building the images failed (exit {result.returncode}; log {log}):\n{tail}")
    return images


def _bare(image_id: str) -> str:
    # docker writes ids as sha256:<hex>, podman's listings as the bare hex.
    return image_id.strip().removeprefix("sha256:")


def image_table() -> dict[str, set[str]]:
    """Every image on the machine, intermediate build stages included: id -> its tags (empty: untagged)."""
    out = engine()("images", "-a", "--no-trunc", "--format", "{{.ID}} {{.Repository}}:{{.Tag}}", check=False)
    table: dict[str, set[str]] = {}
    for line in out.stdout.splitlines():
        image_id, _, tag = line.partition(" ")
        tags = table.setdefault(_bare(image_id), set())
        if tag and "<none>" not in tag:
            tags.add(tag)
    return table


def tagged_ids(tags: Sequence[str]) -> set[str]:
    """The ids these tags point at now (a tag not built yet has none)."""
    ids = set()
    for tag in tags:
        result = engine()("image", "inspect", "--format", "{{.Id}}", tag, check=False)
        if result.returncode == 0:
            ids |= {_bare(i) for i in result.stdout.split()}
    return ids


def remove_built_images(tags: Sequence[str], before: dict[str, set[str]], ours_before: set[str]) -> list[str]:
    """Remove these tags and every image that is untagged then and that the builds in between made or left
    behind (new since `before`, or what the tags pointed at then: `ours_before`). Images that other tags
    hold (the Debian-built base images, other checkouts') stay. Returns the ids that could not go."""
    candidates = (set(image_table()) - set(before)) | ours_before | tagged_ids(tags)
    e = engine()
    for tag in tags:
        e("rmi", tag, check=False, timeout=300)
    # A build stage's image can go only after the images built on it: remove in passes until none goes.
    while True:
        table = image_table()
        left = sorted(i for i in candidates if i in table and not table[i])
        gone = [i for i in left if e("rmi", i, check=False, timeout=300).returncode == 0]
        if not gone:
            return left


# ---- containers ------------------------------------------------------------------------------------------


@contextmanager
def container(image: str, *args: str, name: str, command: Sequence[str] = ()) -> Iterator[str]:
    """`run -d` a container (`args` are the engine's options, `command` the container's arguments); it is
    removed afterwards, whatever happened."""
    try:
        engine()("run", "-d", "--name", name, *args, image, *command, timeout=START)
        yield name
    finally:
        engine().remove(name)


# ---- compose ---------------------------------------------------------------------------------------------


def compose_command() -> list[str]:
    """podman-compose beside this Python (the dev extra installs it) or on PATH; `docker compose` for docker."""
    if engine().name == "docker":
        assert run(["docker", "compose", "version"]).returncode == 0, "docker's compose plugin (v2.24+) is missing"
        return ["docker", "compose"]
    beside = Path(sys.executable).parent / "podman-compose"
    found = str(beside) if beside.exists() else shutil.which("podman-compose")
    assert found, "podman-compose is missing: `make install-dev` installs it (the dev extra)"
    return [found]


_projects = itertools.count()
# The project names this tier gives: mhaserve-test-<pid of the pytest that made it>-<n>.
PROJECT_NAME = re.compile(r"mhaserve-test-(\d+)-\d+")


def project_containers(project: str, service: str | None = None) -> list[str]:
    """Names of a compose project's containers (all states), sorted; of one service if given."""
    filters = ["--filter", f"label=com.docker.compose.project={project}"]
    if service:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    return sorted(engine()("ps", "-a", *filters, "--format", "{{.Names}}").stdout.split())


def project_leftovers(project: str) -> list[str]:
    """Whatever of a compose project is on the machine: containers, networks, pods, volumes."""
    e = engine()
    left = [f"container {c}" for c in project_containers(project)]
    left += [f"network {n}" for n in e("network", "ls", "--format", "{{.Name}}").stdout.split() if project in n]
    if e.name == "podman":
        left += [f"pod {p}" for p in e("pod", "ls", "--format", "{{.Name}}").stdout.split() if project in p]
    left += [f"volume {v}" for v in e("volume", "ls", "--format", "{{.Name}}").stdout.split() if project in v]
    return left


def remove_project(project: str) -> None:
    """Force-remove all of a compose project, whatever state it is in."""
    e = engine()
    for name in project_containers(project):
        e.remove(name)
    for item in project_leftovers(project):
        kind, name = item.split(" ", 1)
        e.remove(kind, name)


def remove_stale_projects() -> list[str]:
    """Remove the compose projects of earlier test sessions whose pytest is gone: one killed before its
    teardown (a CI timeout, ^C twice) leaves its stack running, replicas and load generators included,
    which then takes CPU from every later run. Returns the projects removed."""
    listed = engine()("ps", "-a", "--format", '{{index .Labels "com.docker.compose.project"}}', check=False)
    stale = []
    for project in sorted(set(listed.stdout.split())):
        match = PROJECT_NAME.fullmatch(project)
        if match and not pid_alive(int(match.group(1))):
            remove_project(project)
            stale.append(project)
    return stale


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class Compose:
    """One compose project on the CPU stack (docker-compose.yml + docker-compose.cpu.yml), with the images
    built from this checkout and every port on loopback. `down()` removes all it made."""

    FILES = ("docker-compose.yml", "docker-compose.cpu.yml")

    def __init__(self, images: Images, workdir: Path, profiles: Sequence[str] = (), **env: str) -> None:
        self.project = f"mhaserve-test-{os.getpid()}-{next(_projects)}"
        self.profiles = list(profiles)
        self.workdir = workdir
        # all at once: ports taken one by one can be handed out twice
        self.grpc_port, self.http_port, self.metrics_port, *more = free_ports(9)
        lb, lb_http, lb_stats, locust_web, prometheus, grafana = more
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(COMPOSE_PREFIXES)} | {
            "MHASERVE_IMAGE": images.cpu,
            "LOADTEST_IMAGE": images.loadtest,
            "HAPROXY_IMAGE": images.haproxy,
            "NGINX_IMAGE": images.nginx,
            "PROMETHEUS_IMAGE": images.prometheus,
            # One replica publishes fixed loopback ports; scaled ones set ephemeral ports (127.0.0.1::PORT).
            "MHASERVE_GRPC_PUBLISH": f"127.0.0.1:{self.grpc_port}:50051",
            "MHASERVE_HTTP_PUBLISH": f"127.0.0.1:{self.http_port}:8080",
            "MHASERVE_METRICS_PUBLISH": f"127.0.0.1:{self.metrics_port}:8000",
            "MHASERVE_LB_PUBLISH": f"127.0.0.1:{lb}",
            "MHASERVE_LB_HTTP_PUBLISH": f"127.0.0.1:{lb_http}",
            "MHASERVE_LB_STATS_PUBLISH": f"127.0.0.1:{lb_stats}",
            "LOCUST_WEB_PUBLISH": f"127.0.0.1:{locust_web}",
            "PROMETHEUS_PUBLISH": f"127.0.0.1:{prometheus}",
            "GRAFANA_PUBLISH": f"127.0.0.1:{grafana}",
            # Two cores shared by replicas, balancer and load generators: one inference thread each.
            "MHASERVE_INTRA_OP_THREADS": "1",
            "LOADTEST_RESULTS": str(workdir / "results"),
        }
        self.env |= env
        self.log = workdir / f"{self.project}.log"

    def __call__(self, *args: str, timeout: float = START) -> subprocess.CompletedProcess[str]:
        command = [*compose_command(), "-p", self.project]
        for f in self.FILES:
            command += ["-f", str(ROOT / f)]
        for p in self.profiles:
            command += ["--profile", p]
        result = run([*command, *args], timeout=timeout, env=self.env)
        with self.log.open("a") as log:
            log.write(f"$ {' '.join([*command[1:], *args])}\n{result.stdout}{result.stderr}")
            log.write(f"exit {result.returncode}\n")
        return result

    def up(self, *services: str, scale: Mapping[str, int] | None = None) -> None:
        args = ["up", "-d"]
        for service, n in (scale or {}).items():
            args += ["--scale", f"{service}={n}"]
        result = self._up(*args, *services)
        if result.returncode != 0 and PORT_TAKEN in result.stderr:
            # Scaled replicas publish ephemeral host ports that the engine picks itself, from the range
            # free_port()'s come from; once in many runs it picks one reserved here for another service (or
            # taken meanwhile), and podman-compose then hangs instead of failing. A race on the host, not a
            # fault of the stack: take it down and start it once more.
            self.down()
            result = self._up(*args, *services)
        assert result.returncode == 0, f"compose up failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"

    def _up(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`compose up`, a timeout answered as a failed run (with what it printed) rather than raised."""
        try:
            return self(*args)
        except subprocess.TimeoutExpired as e:
            out, err = (x.decode(errors="replace") if isinstance(x, bytes) else x or "" for x in (e.output, e.stderr))
            return subprocess.CompletedProcess(e.cmd, -9, out, f"{err}\n(timed out after {e.timeout:g} s)")

    def down(self) -> subprocess.CompletedProcess[str]:
        # --remove-orphans: podman-compose's down otherwise removes only the first replica of a scaled service.
        return self("down", "--remove-orphans", "-v", "-t", "40", timeout=300)

    def containers(self, service: str | None = None) -> list[str]:
        """Names of the project's containers (all states), sorted; of one service if given."""
        return project_containers(self.project, service)

    def leftovers(self) -> list[str]:
        """Whatever of this project is still on the machine: containers, networks, pods, volumes."""
        return project_leftovers(self.project)

    def remove_everything(self) -> None:
        """The teardown's last resort: force-remove what `down` left (a failed test must not leave it)."""
        remove_project(self.project)

    def grpc_address(self, service_container: str | None = None) -> str:
        if service_container is None:
            return f"127.0.0.1:{self.grpc_port}"
        return f"127.0.0.1:{engine().host_port(service_container, 50051)}"

    def check_loopback_only(self) -> None:
        """Every port any of the project's containers publishes is on 127.0.0.1."""
        for name in self.containers():
            for line in engine()("port", name).stdout.splitlines():
                assert "-> 127.0.0.1:" in line, f"{name} publishes {line}: not on loopback"


def ok_calls(samples: Samples, method: str) -> float:
    """Calls of one method answered OK, whatever the method label's leading slash."""
    return sum(
        s.value
        for s in samples
        if s.name == "mhaserve_requests_total"
        and s.labels.get("code") == "OK"
        and s.labels["method"].lstrip("/") == method
    )


def serving(address: str) -> bool:
    try:
        return client.health(address, timeout=2.0) == "SERVING"
    except Exception:  # noqa: BLE001 - not answering yet, through a balancer or a starting container
        return False


class LbStack:
    """Replicas behind the `lb` balancer (HAProxy; `files` adds e.g. docker-compose.nginx.yml), each
    replica's metrics on a loopback port of its own. Rolling restarts: `stop` and `start` one replica."""

    def __init__(
        self, compose: Callable[..., Compose], replicas: int = 2, profiles: Sequence[str] = (), **env: str
    ) -> None:
        self.compose = compose(
            ["lb", *profiles],
            MHASERVE_GRPC_PUBLISH="127.0.0.1::50051",
            MHASERVE_HTTP_PUBLISH="127.0.0.1::8080",
            MHASERVE_METRICS_PUBLISH="127.0.0.1::8000",
            **env,
        )
        self.compose.up("encoder", "lb", scale={"encoder": replicas})
        self.replicas = self.compose.containers("encoder")
        assert len(self.replicas) == replicas, self.replicas
        for r in self.replicas:
            engine().wait_healthy(r)
        self.metrics_ports = {r: engine().host_port(r, 8000) for r in self.replicas}
        (self.lb,) = self.compose.containers("lb")
        self.address = self.compose.grpc_address(self.lb)
        self.http_address = f"127.0.0.1:{engine().host_port(self.lb, 8080)}"
        self.stats_port = engine().host_port(self.lb, 8404)
        wait_until(lambda: serving(self.address), "the balancer to pass calls through", START, 0.5)
        # Every replica in both backends: found through the engine's DNS and checked healthy (`rise 2`).
        wait_until(lambda: self.servers_up() == 2 * replicas, "HAProxy to check every replica up", START, 0.5)
        self.compose.check_loopback_only()

    def servers_up(self) -> int:
        """Servers HAProxy has checked UP, over both backends, from its Prometheus exporter (0 until it answers)."""
        try:
            metrics = http_get(f"http://127.0.0.1:{self.stats_port}/metrics", timeout=2).decode()
        except OSError:
            return 0
        return len(re.findall(r'^haproxy_server_status\{[^}]*state="UP"[^}]*\} 1', metrics, re.M))

    def served(self, replica: str, protocol: str = "grpc") -> float:
        """Calls of the protocol's plain client (tests/deploy/load.py) the replica answered OK."""
        return ok_calls(scrape(self.metrics_ports[replica]), METHODS[protocol])

    def stop(self, replica: str) -> int:
        """`stop`: SIGTERM, and SIGKILL only after 45 s (the compose file's stop_grace_period); the exit code."""
        engine()("stop", "-t", "45", replica, timeout=90)
        return engine().exit_code(replica)

    def start(self, replica: str) -> float:
        """Start a stopped replica again (it may get a new address: the balancer follows the engine's DNS);
        seconds until it is healthy. Its metrics port is published anew."""
        engine()("start", replica, timeout=START)
        took = engine().wait_healthy(replica)
        self.metrics_ports[replica] = engine().host_port(replica, 8000)
        return took

    def balancer_failures(self) -> list[str]:
        """Calls the balancer answered with an error, from its log: for nginx, an HTTP status other than 200
        (its own gRPC errors are 204s) or a gRPC status other than OK (deploy/nginx/nginx.conf's format); for
        HAProxy (`option httplog`), an HTTP status of 5xx or a termination state other than `--`, unless the
        client aborted (C)."""
        failed = []
        for line in engine().logs(self.lb, last=None).splitlines():
            m = re.search(r'"POST \S+ HTTP/2.0" (\d{3}) .*grpc_status=(\S*),(\S*)$', line)
            if m and (m.group(1) != "200" or any(g not in ("", "-", "0") for g in m.groups()[1:])):
                failed.append(line)
            h = re.search(r" (-?\d{1,3}) \d+ - - (\S{4}) .*\"(?:POST|GET) ", line)
            # A termination state starting with C is the client's own abort (Locust cancels the calls in
            # flight when its run ends), not a failure of the balancer or a replica.
            if h and h.group(2)[0] != "C" and (h.group(1).startswith(("5", "-")) or h.group(2)[:2] != "--"):
                failed.append(line)
        return failed
