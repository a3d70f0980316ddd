"""The balancers' configurations from the repo, in front of real replicas on this machine.

deploy/haproxy/haproxy.cfg (the `lb` service) with its `server-template` lines, which find the replicas
through the container engine's DNS, replaced by one `server` line per loopback replica; and
deploy/nginx/mhaserve.conf.template (the documented alternative), rendered as the nginx image renders it
in compose, with the compose override's upstream lines pointed at loopback replicas instead of
`encoder:50051 resolve` (`resolve` needs nginx >= 1.27.3 and Docker's DNS; Debian 12 has 1.22).
The container tier (test_containers.py) runs the same files in the compose stack.
"""

from __future__ import annotations

import os
import pwd
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import yaml

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import free_ports
from tests.deploy.helpers import (
    DEPLOY,
    ROOT,
    WAIT,
    Process,
    Replica,
    encode,
    find_binary,
    health,
    http_get,
    needs,
    render_envsubst,
    wait_until,
)
from tests.deploy.load import Load, Protocol

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

TEMPLATE = DEPLOY / "nginx" / "mhaserve.conf.template"
HAPROXY_CFG = DEPLOY / "haproxy" / "haproxy.cfg"
SERVICE_CONFIG = DEPLOY / "clients" / "grpc-service-config.json"


def upstream_line(line: str, port: int, addresses: list[str]) -> str:
    """The compose override's `server encoder:PORT resolve PARAMS;`, one directive per loopback address."""
    prefix = f"server encoder:{port} resolve"
    assert line.startswith(prefix), line
    params = line.removeprefix(prefix).strip().rstrip(";")
    return " ".join(f"server {a} {params};" for a in addresses)


def lb_env(replicas: list[Replica], listen: str, http_listen: str) -> dict[str, str]:
    """The lb service's environment from docker-compose.nginx.yml, for loopback."""
    override = yaml.safe_load((ROOT / "docker-compose.nginx.yml").read_text())
    env = dict(override["services"]["lb"]["environment"])
    env["NGINX_UPSTREAM_SERVERS"] = upstream_line(env["NGINX_UPSTREAM_SERVERS"], 50051, [r.address for r in replicas])
    env["NGINX_HTTP_UPSTREAM_SERVERS"] = upstream_line(
        env["NGINX_HTTP_UPSTREAM_SERVERS"], 8080, [r.http_address for r in replicas]
    )
    env["NGINX_LISTEN"] = listen
    env["NGINX_HTTP_LISTEN"] = http_listen
    # What the image's entry point sets from the container's resolv.conf (NGINX_ENTRYPOINT_LOCAL_RESOLVERS):
    # loopback replicas need no name resolved, but the directive needs an address.
    assert env.pop("NGINX_ENTRYPOINT_LOCAL_RESOLVERS") == "1"
    env["NGINX_LOCAL_RESOLVERS"] = "127.0.0.1"
    return env


class Nginx(Process):
    """nginx in the foreground with a private prefix: config, pid, logs and temp files in `workdir`."""

    def __init__(self, replicas: list[Replica], workdir: Path) -> None:
        self.port, self.http_port = free_ports(2)
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{self.http_port}"
        site = render_envsubst(TEMPLATE.read_text(), lb_env(replicas, self.address, self.http_address))
        assert "${NGINX_" not in site, "a template variable was left unrendered"
        (workdir / "site.conf").write_text(site)
        # What the official image's nginx.conf does around conf.d/, with everything inside workdir.
        user = f"user {pwd.getpwuid(os.getuid()).pw_name};" if os.getuid() == 0 else ""
        (workdir / "nginx.conf").write_text(
            f"""{user}
worker_processes 1;
error_log {workdir}/error.log info;
pid {workdir}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    log_format upstream '$remote_addr "$request" $status upstream=$upstream_addr '
                        'upstream_status=$upstream_status grpc_status=$sent_http_grpc_status,$sent_trailer_grpc_status';
    access_log {workdir}/access.log upstream;
    client_body_temp_path {workdir}/client_body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    include {workdir}/site.conf;
}}
"""
        )
        nginx = find_binary("nginx")
        assert nginx is not None
        test = [nginx, "-t", "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"]
        check = Process(test, workdir / "nginx-t.log")
        assert check.wait(WAIT) == 0, f"nginx -t rejected the rendered config:\n{check.log()}"
        check.stop()
        super().__init__(
            [nginx, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"], workdir / "nginx.log"
        )
        try:
            wait_until(lambda: not self.alive() or health(self.address) == "SERVING", "nginx to pass calls through")
            assert self.alive(), f"nginx exited:\n{self.log()}\n{self.error_log()}"
        except BaseException:
            self.stop()
            raise

    def _error_log_text(self) -> str:
        path = self.log_path.parent / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def error_log(self) -> str:
        return self._error_log_text()[-4000:]

    def errors(self) -> list[str]:
        """The lines of its error log at level error or worse: a call it failed, a replica it gave up on."""
        lines = self._error_log_text().splitlines()
        return [line for line in lines if re.search(r"\[(error|crit|alert|emerg)\]", line)]

    def failures(self) -> list[str]:
        """Calls nginx answered with an error (its access log): an HTTP status other than 200 (its own gRPC
        errors are 204s) or a gRPC status other than OK (e.g. a draining replica's UNAVAILABLE)."""
        failed = []
        for line in (self.log_path.parent / "access.log").read_text().splitlines():
            m = re.search(r'" (\d{3}) .*grpc_status=(\S*),(\S*)$', line)
            assert m, f"unexpected access log line: {line}"
            status, *grpc_status = m.groups()
            if status != "200" or any(g not in ("", "-", "0") for g in grpc_status):
                failed.append(line)
        return failed


@pytest.fixture
def lb(tmp_path: Path) -> Iterator[Callable[[list[Replica]], Nginx]]:
    started: list[Nginx] = []

    def start(replicas: list[Replica]) -> Nginx:
        workdir = tmp_path / "nginx"
        workdir.mkdir()
        started.append(Nginx(replicas, workdir))
        return started[-1]

    try:
        yield start
    finally:
        for n in started:
            n.stop()


# The gRPC port's front of each replica (docs/grpc-fronts.md, which names a proxy in front as the place for the lean
# one): each proxy's own HTTP/2 client (nginx's grpc_pass, HAProxy's) is tested against both.
FRONTS = ["grpc", "lean"]


@needs("nginx")
@pytest.mark.parametrize("front", FRONTS)
def test_calls_on_one_connection_are_spread_over_replicas(
    replicas: Callable[..., list[Replica]], lb: Callable[[list[Replica]], Nginx], front: str
) -> None:
    a, b = replicas(2, http=True, grpc_front=front)
    nginx = lb([a, b])
    before = a.encode_ok() + b.encode_ok()
    n_seq, n_par = 30, 60
    # One channel is one HTTP/2 connection: an L4 balancer would send all of it to one replica.
    with grpc.insecure_channel(nginx.address) as ch:
        stub = pb_grpc.EncoderServiceStub(ch)
        for i in range(n_seq):
            assert len(encode(stub, f"sequential call {i}").embeddings) == 1
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda i: encode(stub, f"concurrent call {i}"), range(n_par)))
        assert all(len(r.embeddings) == 1 for r in results)

    got_a, got_b = a.encode_ok(), b.encode_ok()
    assert got_a + got_b - before == n_seq + n_par, "every call is answered by exactly one replica"
    # Round-robin among equally idle replicas: close to half each; a third each way is a wide margin.
    for got, name in ((got_a, "a"), (got_b, "b")):
        assert got >= (n_seq + n_par) / 3, f"replica {name} got {got:.0f} of {n_seq + n_par} calls: not balanced"


@needs("nginx")
@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["drain", "crash"])
def test_clients_keep_getting_answers_when_a_replica_stops(
    replicas: Callable[..., list[Replica]], lb: Callable[[list[Replica]], Nginx], sig: int, front: str
) -> None:
    """Clients with the retry policy from deploy/clients/ see no error while a replica drains or dies.

    nginx moves every call that had not reached the stopped replica to the other one. A call that was
    already sent to it cannot be replayed by nginx (it streams request bodies) and comes back
    UNAVAILABLE; only those, at most one per client in flight, may need the client's retry.
    """
    a, b = replicas(2, http=True, grpc_front=front)
    nginx = lb([a, b])
    done = threading.Event()
    ok: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    options = [("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG.read_text())]
    n_clients = 4

    def client(k: int) -> None:
        with grpc.insecure_channel(nginx.address, options=options) as ch:
            stub = pb_grpc.EncoderServiceStub(ch)
            for i in range(400):  # bounded: at most 400 calls per client
                if done.is_set():
                    return
                try:
                    encode(stub, f"client {k} call {i}")
                    with lock:
                        ok.append(time.monotonic())
                except grpc.RpcError as e:
                    with lock:
                        errors.append(f"{e.code().name}: {e.details()}")
                time.sleep(0.005)

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(n_clients)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(ok) >= 40 or not any(t.is_alive() for t in threads), "calls before the stop")
        assert b.encode_ok() > 0, "replica b took no calls before it was stopped: nothing was tested"
        b.signal(sig)
        code = b.wait(WAIT)
        a_before = a.encode_ok()
        stopped_at = time.monotonic()
        if sig == signal.SIGTERM:
            assert code == 0, f"SIGTERM should drain and exit 0, got {code}:\n{b.log()}"
        wait_until(
            lambda: sum(t > stopped_at for t in ok) >= 60 or not any(t.is_alive() for t in threads),
            "calls after the stop",
        )
    finally:
        done.set()
        for t in threads:
            t.join(WAIT)

    after = sum(t > stopped_at for t in ok)
    failed_at_lb = nginx.failures()
    assert not errors, f"{len(errors)} calls failed while a replica stopped: {errors[:5]}\n{nginx.error_log()}"
    assert after >= 60, f"only {after} calls after the stop"
    # Less those in flight when the counter was read: they count on `a` before the clock was read.
    assert a.encode_ok() - a_before >= after - n_clients, "calls after the stop must all go to the other replica"
    assert len(failed_at_lb) <= 2 * n_clients, (
        f"nginx answered {len(failed_at_lb)} calls with an error: more than those in flight at the stop\n"
        + "\n".join(failed_at_lb[:10])
    )


@needs("nginx")
def test_a_stream_carries_more_than_any_one_body_limit(
    replicas: Callable[..., list[Replica]], lb: Callable[[list[Replica]], Nginx]
) -> None:
    """nginx counts a gRPC stream's request body as one body: a byte limit there would end a long EncodeStream
    (a bulk job) once its messages add up to it, whatever each message's size. 70 messages of 1 MiB (a model not
    served: each answered NOT_FOUND in the stream, no inference) all come back, the stream ending OK; a message past
    the replica's --max-message-bytes is refused by the replica, RESOURCE_EXHAUSTED."""
    (a,) = replicas(1, http=True)
    nginx = lb([a])
    n, text = 70, "x" * ((1 << 20) - 100)
    requests = (pb.EncodeRequest(texts=[text], model="not-served") for _ in range(n))
    with grpc.insecure_channel(nginx.address) as ch:
        answers = list(pb_grpc.EncoderServiceStub(ch).EncodeStream(requests, timeout=WAIT))
    assert len(answers) == n, f"{len(answers)} answers of {n}\n{nginx.error_log()}"
    assert {r.error.code for r in answers} == {grpc.StatusCode.NOT_FOUND.value[0]}
    # One message past the replica's limit (4 MiB by default) is the replica's to refuse, as a status.
    with grpc.insecure_channel(nginx.address) as ch, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.EncoderServiceStub(ch).Encode(pb.EncodeRequest(texts=["x" * (5 << 20)]), timeout=WAIT)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value


# ---- HAProxy: the `lb` service's balancer -----------------------------------------------------------------


def render_haproxy(replicas: list[Replica], binds: dict[int, int]) -> str:
    """deploy/haproxy/haproxy.cfg for loopback: its listeners on the given loopback ports (by the port the
    file binds), each `server-template ... encoder:PORT` line as one `server` line per replica (the gRPC
    ones checked on the replica's own HTTP port, as the file's `port 8080` does in compose)."""
    text = HAPROXY_CFG.read_text()
    for port, local in binds.items():
        text, n = re.subn(rf"^(\s*bind) :{port}\b", rf"\1 127.0.0.1:{local}", text, flags=re.M)
        assert n == 1, f"haproxy.cfg binds :{port} {n} times"

    def servers(m: re.Match[str]) -> str:
        indent, port, rest = m.group(1), int(m.group(2)), m.group(3)
        lines = []
        for i, r in enumerate(replicas):
            address = r.address if port == 50051 else r.http_address
            check_port = f" port {r.http_port}" if port == 50051 else ""
            lines.append(f"{indent}server r{i} {address}{rest}{check_port}")
        return "\n".join(lines)

    text, n = re.subn(r"^(\s*)server-template \S+ \S+ encoder:(\d+)(.*)$", servers, text, flags=re.M)
    assert n == 2, f"expected the gRPC and HTTP server-template lines, found {n}"
    return text


class HAProxy(Process):
    """haproxy in the foreground (master-worker) with the repo's configuration rendered for loopback."""

    def __init__(self, replicas: list[Replica], workdir: Path) -> None:
        self.port, self.http_port, self.stats_port = free_ports(3)
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{self.http_port}"
        cfg = workdir / "haproxy.cfg"
        cfg.write_text(render_haproxy(replicas, {50051: self.port, 8080: self.http_port, 8404: self.stats_port}))
        haproxy = find_binary("haproxy")
        assert haproxy is not None
        check = Process([haproxy, "-c", "-f", str(cfg)], workdir / "haproxy-c.log")
        assert check.wait(WAIT) == 0, f"haproxy -c rejected the rendered config:\n{check.log()}"
        check.stop()
        super().__init__([haproxy, "-W", "-db", "-f", str(cfg)], workdir / "haproxy.log")
        try:
            # Both replicas pass their health checks (`rise 2`) before the test begins.
            wait_until(lambda: not self.alive() or self.servers_up() == 2 * len(replicas), "HAProxy to check both up")
            assert self.alive(), f"haproxy exited:\n{self.log()}"
        except BaseException:
            self.stop()
            raise

    def metrics(self) -> str:
        return http_get(f"http://127.0.0.1:{self.stats_port}/metrics").decode()

    def servers_up(self) -> int:
        """Servers HAProxy has checked UP, over both backends (0 while its stats port is not up yet)."""
        try:
            metrics = self.metrics()
        except OSError:
            return 0
        return len(re.findall(r"^haproxy_server_status\{[^}]*state=\"UP\"[^}]*\} 1", metrics, re.M))

    def failures(self) -> list[str]:
        """The calls HAProxy's log (`option httplog`, on its stdout) says ended badly: an HTTP status other than
        200, or a termination state other than `--` (its first letter says who ended the stream, `S` the server,
        `C` the client; its second in which phase, `D` while the answer's data passed)."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            m = re.search(r"\] \S+ \S+ \S+ (\d{3}) \S+ \S+ \S+ (\S{4}) ", line)
            if m and (m.group(1) != "200" or m.group(2)[:2] != "--"):
                found.append(line)
        return found

    def retries(self) -> float:
        """Requests HAProxy sent again (to another replica) after a connection failure or a refusal."""
        found = re.findall(r"^haproxy_backend_(?:retry|redispatch)_warnings_total\{[^}]*\} (\S+)", self.metrics(), re.M)
        return sum(float(v) for v in found)


Balancer = HAProxy | Nginx


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[Callable[[str, list[Replica]], Balancer]]:
    started: list[Balancer] = []

    def start(kind: str, replicas: list[Replica]) -> Balancer:
        workdir = tmp_path / kind
        workdir.mkdir()
        started.append(HAProxy(replicas, workdir) if kind == "haproxy" else Nginx(replicas, workdir))
        return started[-1]

    try:
        yield start
    finally:
        for b in started:
            b.stop()


@pytest.mark.parametrize(
    ("protocol", "front"), [("grpc", "grpc"), ("grpc", "lean"), ("http", "grpc")], ids=["grpc", "grpc-lean", "http"]
)
@pytest.mark.parametrize(
    "kind", [pytest.param("haproxy", marks=needs("haproxy")), pytest.param("nginx", marks=needs("nginx"))]
)
def test_plain_clients_while_a_replica_drains_with_a_delay(
    replicas: Callable[..., list[Replica]],
    balancer: Callable[[str, list[Replica]], Balancer],
    kind: str,
    protocol: Protocol,
    front: str,
) -> None:
    """16 plain clients (no retry policy) through the balancer while one replica drains with a delay.

    HAProxy sees /health go 503 and takes the replica out before it stops listening: no call fails. nginx
    has no active health checks and sends the replica calls until it stops listening; what grpc.aio had
    received but not started then comes back CANCELLED, which nginx passes on, and on either front a call sent
    on a connection the instant the listener closed fails: counted and printed (the figures in docs/deploy.md),
    bounded by the calls that can be in flight, not asserted zero."""
    a, b = replicas(2, http=True, drain_delay="2", grpc_front=front)
    lb = balancer(kind, [a, b])
    n_clients = 16
    load = Load(protocol, lb.address if protocol == "grpc" else lb.http_address, clients=n_clients)
    try:
        load.wait_for_answers(100, 0.0, "calls before the stop", WAIT)
        assert b.encode_ok(protocol) > 0, "replica b took no calls before it was stopped: nothing was tested"
        b.signal(signal.SIGTERM)
        code = b.wait(WAIT)
        stopped_at = time.monotonic()
        assert code == 0, f"SIGTERM should drain and exit 0, got {code}:\n{b.log()}"
        load.wait_for_answers(100, stopped_at, "calls after the stop", WAIT)
    finally:
        load.stop()
    retried = lb.retries() if isinstance(lb, HAProxy) else float("nan")
    print(f"\n{kind} {protocol} ({front} front): {load.summary()}; retried by the balancer: {retried:g}")
    if isinstance(lb, HAProxy):
        assert not load.errors, f"{load.summary()}\n" + "\n".join(lb.failures()[:10])
    else:
        assert sum(load.errors.values()) <= 2 * n_clients, load.summary()


@pytest.mark.parametrize(
    ("kind", "front"),
    [
        pytest.param("haproxy", "grpc", marks=needs("haproxy")),
        pytest.param("haproxy", "lean", marks=needs("haproxy")),
        pytest.param("nginx", "grpc", marks=needs("nginx")),
        pytest.param("nginx", "lean", marks=needs("nginx")),
    ],
)
def test_no_call_is_lost_when_replicas_send_the_balancers_connections_away(
    replicas: Callable[..., list[Replica]], balancer: Callable[[str, list[Replica]], Balancer], kind: str, front: str
) -> None:
    """`--max-connection-age` sends each of the balancer's connections to a replica a GOAWAY every second or so
    while 8 plain clients (no retry policy) call through it. A proxy cannot resend a call it has forwarded
    (nginx streams the body), and nginx then holds the replica failed for 5 s (`max_fails=1`). The lean front's
    single GOAWAY refused calls already sent: 2 of 1,500 in one run, and with both replicas held failed 18,483
    in another (2 runs of 3). Its close reset the connection when the balancer's last frames came after it,
    and HAProxy 2.6 then cut the answer it was passing on (UNKNOWN "Stream removed"; 3 runs of 5).

    grpc core closes its connections at once too (no option of it we found lingers), and grpc.aio's front loses
    a call to it now and then: behind HAProxy 1-2 of 1,500 in 3 runs of 5 here; behind nginx 1 of about 1,550 in 2 of
    41 runs, nginx logging that the replica closed the connection in the middle of the answer it was passing on
    (docs/deploy.md). That front is held to those cut answers only, and to under 1 % of calls."""
    a, b = replicas(2, http=True, grpc_front=front, max_connection_age="0.5")
    lb = balancer(kind, [a, b])
    load = Load("grpc", lb.address, clients=8)
    try:
        load.wait_for_answers(1500, 0.0, "calls through connections sent away", WAIT)
    finally:
        load.stop()
    print(f"\n{kind}, {front} front, connections sent away every second: {load.summary()}")
    failed = sum(load.errors.values())
    # What the balancer logged of the failed calls, for the failure messages below.
    lb_lines = lb.errors() if isinstance(lb, Nginx) else lb.failures()[:10]
    if front == "grpc":
        cut = {
            "haproxy": "UNKNOWN: Stream removed (Data frame with END_STREAM flag received)",
            "nginx": "INTERNAL: Stream removed (RST_STREAM (Received RST_STREAM with error code 2))",
        }[kind]
        assert set(load.errors) <= {cut} and failed < len(load.ok) / 100, f"{load.summary()}\n" + "\n".join(lb_lines)
        if kind == "nginx":
            # Each of nginx's cut answers is the replica's connection ending under it, nothing else.
            cut_by_replica = [e for e in lb_lines if "upstream prematurely closed connection while sending" in e]
            assert len(cut_by_replica) == failed, f"{load.summary()}\n" + "\n".join(lb_lines)
    else:
        failed_at_lb = lb.failures() if isinstance(lb, Nginx) else []
        assert not failed, f"{load.summary()}\n" + "\n".join(failed_at_lb[:10] + lb_lines)


class LoadingReplica:
    """A replica as HAProxy can meet one that has just started: its checks have not failed yet, so HAProxy
    sends it calls (a server leaving DNS maintenance starts UP), and it answers them 503 "still loading",
    as `mhaserve serve` does before its model is ready. /health says 200 here so that the window stays open
    for the whole test; calls get the server's own refusal."""

    def __init__(self) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, and the status line HAProxy's gRPC check expects

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(200, b'{"status":"SERVING"}')

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self._answer(
                    503, b'{"error":{"message":"the model is still loading; retry when health reports SERVING"}}'
                )

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_port = self.server.server_address[1]
        self.http_address = self.address = f"127.0.0.1:{self.http_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@needs("haproxy")
def test_haproxy_sends_a_post_refused_while_loading_to_another_replica(
    replicas: Callable[..., list[Replica]], balancer: Callable[[str, list[Replica]], Balancer]
) -> None:
    """`retry-on 503` replays a request only if HAProxy holds all of it; without `option http-buffer-request` it
    forwards a POST's headers before its body arrives and passes the 503 on (a rolling restart in the
    container tier once failed a call so). Every call must be answered, some after a retry."""
    (real,) = replicas(1, http=True)
    loading = LoadingReplica()
    try:
        lb = balancer("haproxy", [loading, real])  # type: ignore[list-item]
        assert isinstance(lb, HAProxy)
        load = Load("http", lb.http_address, clients=4)
        try:
            load.wait_for_answers(200, 0.0, "calls through the balancer", WAIT)
        finally:
            load.stop()
        assert not load.errors, f"{load.summary()}\n" + "\n".join(lb.failures()[:10])
        assert lb.retries() > 0, "no call went to the loading replica: nothing was tested"
    finally:
        loading.stop()
