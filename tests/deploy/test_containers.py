"""The container tier: the images built from this checkout, run by docker or podman on this machine.

The images are built once per session by deploy/images/build.sh (what `make images` runs) and removed
when the session ends (MHASERVE_TEST_KEEP_IMAGES=1 keeps them, and the engine's cache, for the next run),
then:
1. the cpu image on its own: non-root, no torch, compilers or tests inside, healthy, the same Encode and
   KServe answers through its published port as a server on the host serving the same repository, the
   metrics port, and SIGTERM: exit 0 within the grace period; and started as Amazon SageMaker starts it
   (`serve`, a model at /opt/ml/model, its port variables);
2. compose (docker-compose.yml + docker-compose.cpu.yml): up, healthy, encode, down leaving nothing;
3. the `lb` profile: two replicas behind HAProxy, calls spread over both; rolling restarts (each replica
   stopped with SIGTERM and started again in turn) under 16 plain gRPC or HTTP clients, and under a
   headless Locust run from the `loadtest` profile: no call fails;
4. the `loadtest` profile: a Locust master and two workers, headless, reports in a mounted folder;
5. the `monitoring` profile: Prometheus scrapes both replicas and loads the alert rules;
6. cleaning up: what a session's builds made goes again when it ends (a machine that runs the suite for
   every fresh clone filled its disk with them), and a stack left by a pytest that died is removed.

Every port is published on 127.0.0.1; every load is bounded in calls and time. The tier is skipped only
where no container engine answers (.ci/run installs podman as root: deploy/images/install-podman.sh);
a failing build fails the tests.
"""

from __future__ import annotations

import csv
import json
import os
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt
import pytest
import yaml
from huggingface_hub import InferenceClient

from mhaserve.proto.encoder.v1 import encoder_pb2 as epb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as epb_grpc
from mhaserve.proto.inference.v2 import grpc_service_pb2 as pb
from mhaserve.proto.inference.v2 import grpc_service_pb2_grpc as pb_grpc
from mhaserve.service import client
from mhaserve.service.kserve.tensors import pack_bytes
from mhaserve.testing.http import request
from mhaserve.testing.loopback import free_ports, wait_until
from mhaserve.testing.metrics import scrape
from tests.conftest import VARIED_TEXTS
from tests.deploy.containers import (
    BUILD,
    ENCODE,
    START,
    Compose,
    Images,
    LbStack,
    checkout_tag,
    container,
    engine,
    image_table,
    needs_engine,
    ok_calls,
    remove_built_images,
    remove_stale_projects,
    serving,
    tagged_ids,
)
from tests.deploy.helpers import DEPLOY, WAIT, Replica, http_get, server_defaults
from tests.deploy.load import Load, Protocol

pytestmark = [pytest.mark.container, needs_engine, pytest.mark.timeout(BUILD + 900)]

INFER = "inference.GRPCInferenceService/ModelInfer"


def vectors(response: epb.EncodeResponse) -> npt.NDArray[np.float32]:
    return np.array([e.values for e in response.embeddings], dtype=np.float32)


def infer(address: str, model: str, texts: list[str]) -> npt.NDArray[np.float32]:
    """KServe ModelInfer with a BYTES `text` tensor; the `embeddings` output as an array."""
    items = [t.encode() for t in texts]
    tensor = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[len(items)])
    request = pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[pack_bytes(items)])
    with grpc.insecure_channel(address) as channel:
        response = pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=WAIT)
    (out,) = response.outputs
    assert (out.name, out.datatype) == ("embeddings", "FP32")
    return np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(tuple(out.shape))


# ---- 1. the cpu image ------------------------------------------------------------------------------------


def test_cpu_image_serves_as_the_host_does(images: Images, tmp_path: Path) -> None:
    e = engine()
    grpc_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    name = f"mhaserve-test-cpu-{grpc_port}"
    started = time.monotonic()
    publish = ["-p", f"127.0.0.1:{grpc_port}:50051", "-p", f"127.0.0.1:{metrics_port}:8000"]
    with container(images.cpu, *publish, "-e", "MHASERVE_INTRA_OP_THREADS=1", name=name):
        wait_until(lambda: serving(address) or not e.state(name)["Running"], "the container to serve", START, 0.2)
        assert e.state(name)["Running"], f"the container exited:\n{e.logs(name)}"
        print(f"\ncpu image: start to SERVING in {time.monotonic() - started:.1f} s ({e.name} {e.version})")

        # Non-root, and nothing inside that a serving image should not carry.
        assert e.inspect(name)["Config"]["User"] == "10001:10001"
        assert e.exec(name, "id", "-u").stdout.strip() == "10001"
        absent = e.exec(
            name,
            "python3",
            "-c",
            "import importlib.util as u; print([m for m in ('torch', 'onnx', 'locust', 'mhaserve.loadtest', 'tests')"
            " if u.find_spec(m)])",
        )
        assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr
        compilers = e.exec(name, "sh", "-c", "for c in cc gcc g++ c++ clang make ld; do command -v $c; done; true")
        assert compilers.stdout.strip() == "", f"compilers in the serving image: {compilers.stdout}"
        found = e.exec(name, "sh", "-c", "find / -xdev \\( -name tests -o -name 'test_*.py' \\) -path '*mhaserve*'")
        assert found.stdout.strip() == "", f"tests in the serving image: {found.stdout}"

        e.wait_healthy(name)

        # The reference: a server on this host, on the very repository the image serves (copied out of it).
        e("cp", f"{name}:/models", str(tmp_path / "models"))
        host = Replica(tmp_path / "models", tmp_path, "host")
        try:
            ours, theirs = (client.encode(a, VARIED_TEXTS, truncate=True) for a in (address, host.address))
            assert (ours.model, ours.model_version) == (theirs.model, theirs.model_version)
            assert ours.usage.input_tokens == theirs.usage.input_tokens > 0
            np.testing.assert_allclose(vectors(ours), vectors(theirs), rtol=0, atol=1e-6)
            texts = VARIED_TEXTS[:4]
            np.testing.assert_allclose(
                infer(address, ours.model, texts), infer(host.address, ours.model, texts), atol=1e-6
            )
            np.testing.assert_allclose(infer(address, ours.model, texts), vectors(ours)[:4], atol=1e-6)
        finally:
            host.stop()

        samples = scrape(metrics_port)
        assert ok_calls(samples, ENCODE) == 1 and ok_calls(samples, INFER) == 2, "the metrics port counts our calls"

        # SIGTERM (what `stop` sends first) drains and exits 0, well before the SIGKILL 40 s later.
        grace = server_defaults().grace_period
        stopping = time.monotonic()
        e("stop", "-t", "40", name, timeout=60)
        took = time.monotonic() - stopping
        assert e.exit_code(name) == 0, f"exit code {e.exit_code(name)} after SIGTERM:\n{e.logs(name)}"
        assert took < grace, f"stopping took {took:.1f} s, more than the grace period ({grace} s)"
        assert "draining" in e.logs(name)


def test_cpu_image_runs_several_server_processes_as_pid_1(images: Images) -> None:
    """MHASERVE_PROCESSES=2 in the image: the supervisor is the container's pid 1, both processes serve
    on the published port, their metrics come together on the one metrics port, and `stop` drains both.
    The gRPC port is moved by a container argument, `--port`, which the image's HEALTHCHECK finds on pid 1's
    command line."""
    e = engine()
    grpc_port, metrics_port = free_ports(2)
    address = f"127.0.0.1:{grpc_port}"
    name = f"mhaserve-test-processes-{grpc_port}"
    publish = ["-p", f"127.0.0.1:{grpc_port}:50061", "-p", f"127.0.0.1:{metrics_port}:8000"]
    command = ["--port", "50061"]
    with container(images.cpu, *publish, "-e", "MHASERVE_PROCESSES=2", name=name, command=command):
        wait_until(
            lambda: "all 2 processes are serving" in e.logs(name) or not e.state(name)["Running"],
            "both processes to serve",
            START,
            0.2,
        )
        assert e.state(name)["Running"], f"the container exited:\n{e.logs(name)}"
        # The image's entry point execs `mhaserve serve`: the supervisor is pid 1, its processes' parent.
        pid1 = e.exec(name, "cat", "/proc/1/cmdline").stdout.split("\0")
        assert any(a.endswith("/mhaserve") for a in pid1) and "serve" in pid1, pid1
        # The check asks 50061, not the image's MHASERVE_PORT (50051, where nothing listens): healthy.
        e.wait_healthy(name)
        calls = 16
        for i in range(calls):  # a new connection each: the kernel spreads connections over the two
            with grpc.insecure_channel(address) as channel:
                reply = epb_grpc.EncoderServiceStub(channel).Encode(epb.EncodeRequest(texts=[f"t {i}"]), timeout=WAIT)
            assert len(reply.embeddings[0].values) == 384
        samples = scrape(metrics_port)
        assert ok_calls(samples, ENCODE) == calls
        per_process = [
            sum(s.value for s in samples if s.name == "mhaserve_requests_total" and s.labels.get("process") == p)
            for p in ("p0", "p1")
        ]
        assert min(per_process) > 0, per_process  # all 16 on one process: p = 2^-15
        assert samples.get("mhaserve_processes_serving") == 2

        e("stop", "-t", "40", name, timeout=60)
        assert e.exit_code(name) == 0, f"exit code {e.exit_code(name)} after SIGTERM:\n{e.logs(name)}"
        assert e.logs(name).count("mhaserve.service.server [-] stopped") == 2


def test_cpu_image_started_as_sagemaker_starts_it_serves_the_model_unpacked_for_it(
    images: Images, tmp_path: Path
) -> None:
    """`run IMAGE serve`, Amazon SageMaker's hosting contract: `serve` is not refused as an option; the model
    repository in /opt/ml/model (read-only, where SageMaker unpacks ModelDataUrl) is served in place of the
    image's own; /ping and /invocations answer on SAGEMAKER_BIND_TO_PORT, gRPC and the metrics on the first
    two ports of SAGEMAKER_SAFE_PORT_RANGE, where the image's HEALTHCHECK finds gRPC; SIGTERM drains and exits 0."""
    e = engine()
    # A model under a name of its own (its folder's), as a user's model.tar.gz of a repository unpacks:
    # the image's model copied out of it, world-readable as the exporter writes it.
    unpacked = tmp_path / "opt-ml-model"
    (unpacked / "my-embedder").mkdir(parents=True)
    holder = f"mhaserve-test-sagemaker-model-{uuid.uuid4().hex[:8]}"
    e("create", "--name", holder, images.cpu)
    try:
        e("cp", f"{holder}:/models/all-minilm-l6-v2/1", str(unpacked / "my-embedder" / "3"))
    finally:
        e.remove(holder)
    for path in [unpacked, *unpacked.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)

    http_port, grpc_port, metrics_port = free_ports(3)
    name = f"mhaserve-test-sagemaker-{http_port}"
    options = [
        *("-p", f"127.0.0.1:{http_port}:8081", "-p", f"127.0.0.1:{grpc_port}:29000"),
        *("-p", f"127.0.0.1:{metrics_port}:29001", "-v", f"{unpacked}:/opt/ml/model:ro"),
        *("-e", "SAGEMAKER_BIND_TO_PORT=8081", "-e", "SAGEMAKER_SAFE_PORT_RANGE=29000-29999"),
        *("-e", "MHASERVE_INTRA_OP_THREADS=1"),
    ]
    url = f"http://127.0.0.1:{http_port}"

    def pinged() -> bool:
        try:
            return http_get(url + "/ping") is not None
        except OSError:  # not listening yet, or 503 while the model loads
            return not e.state(name)["Running"]

    with container(images.cpu, *options, name=name, command=["serve"]):
        wait_until(pinged, "the container to answer /ping", START, 0.2)
        assert e.state(name)["Running"], f"the container exited:\n{e.logs(name)}"
        # The image's HEALTHCHECK, run as a process of its own, finds gRPC on the range's port too.
        e.wait_healthy(name)

        models = json.loads(http_get(url + "/v1/models"))
        assert {m["id"] for m in models["data"]} == {"my-embedder", "my-embedder:3"}, models
        # /invocations as SageMaker forwards a TEI body, from huggingface_hub's client (TEI's users' client,
        # given the route's URL); the same vectors as Encode over gRPC on the safe range's first port.
        texts = VARIED_TEXTS[:4]
        theirs = InferenceClient(model=url + "/invocations", timeout=WAIT).feature_extraction(texts)
        ours = client.encode(f"127.0.0.1:{grpc_port}", texts, truncate=True)
        assert ours.model == "my-embedder"
        np.testing.assert_allclose(np.asarray(theirs), vectors(ours), rtol=0, atol=1e-6)
        # a batch transform's MultiRecord mini-batch: JSON Lines in, an answer a line out, in order
        lines = b"\n".join(json.dumps({"inputs": text}).encode() for text in texts)
        reply = request("POST", url + "/invocations", lines, headers={"content-type": "application/jsonlines"})
        assert reply.status == 200, reply.body[:300]
        answers = np.asarray([json.loads(line)[0] for line in reply.body.split(b"\n")])
        np.testing.assert_allclose(answers, vectors(ours), rtol=0, atol=1e-6)
        # Up to 6 MB a request, as SageMaker passes on (InvokeEndpoint's limit, MaxPayloadInMB's default), where
        # the server alone takes 4 MiB: the same lines, with JSON's blanks, 5 MiB in all, then over 6 MiB.
        for size, status in ((5 * 2**20, 200), (6 * 2**20 + 1, 413)):
            blank = b" " * ((size - len(lines)) // len(texts) + 1)
            padded = b"\n".join(json.dumps({"inputs": text}).encode()[:-1] + blank + b"}" for text in texts)
            assert size <= len(padded) < size + 2 * len(texts)
            reply = request("POST", url + "/invocations", padded, headers={"content-type": "application/jsonlines"})
            assert reply.status == status, (len(padded), reply.status, reply.body[:300])
            if status == 200:
                answers = np.asarray([json.loads(line)[0] for line in reply.body.split(b"\n")])
                np.testing.assert_allclose(answers, vectors(ours), rtol=0, atol=1e-6)
        invocations = sum(
            s.value
            for s in scrape(metrics_port)
            if s.name == "mhaserve_requests_total"
            and s.labels.get("method") == "POST /invocations"
            and s.labels.get("code") == "OK"
        )
        assert invocations == 3, "the metrics, on the safe range's second port, count the calls"

        e("stop", "-t", "40", name, timeout=60)
        assert e.exit_code(name) == 0, f"exit code {e.exit_code(name)} after SIGTERM:\n{e.logs(name)}"


# ---- 2. compose: the default file with the CPU override --------------------------------------------------


def test_compose_up_encode_down_leaves_nothing(compose: Callable[..., Compose]) -> None:
    stack = compose()
    stack.up()
    (encoder,) = stack.containers("encoder")
    engine().wait_healthy(encoder)
    stack.check_loopback_only()
    response = client.encode(stack.grpc_address(), ["hello from compose"])
    assert len(response.embeddings) == 1 and len(response.embeddings[0].values) == 384
    assert ok_calls(scrape(stack.metrics_port), ENCODE) == 1

    result = stack.down()
    assert result.returncode == 0, result.stderr[-3000:]
    assert stack.leftovers() == [], "compose down left these behind"


# ---- 3. the lb profile: replicas behind HAProxy, rolling restarts ----------------------------------------


def test_lb_spreads_calls_from_one_connection_over_the_replicas(compose: Callable[..., Compose]) -> None:
    stack = LbStack(compose)
    a, b = stack.replicas
    start = {r: stack.served(r) for r in (a, b)}
    n_seq, n_par = 30, 60
    # One channel is one HTTP/2 connection: an L4 balancer would send all of it to one replica.
    with grpc.insecure_channel(stack.address) as channel:
        stub = epb_grpc.EncoderServiceStub(channel)
        for i in range(n_seq):
            stub.Encode(epb.EncodeRequest(texts=[f"sequential call {i}"]), timeout=WAIT)
        seq = {r: stack.served(r) - start[r] for r in (a, b)}
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: stub.Encode(epb.EncodeRequest(texts=[f"call {i}"]), timeout=WAIT), range(n_par)))
    par = {r: stack.served(r) - start[r] - seq[r] for r in (a, b)}
    assert sum(seq.values()) + sum(par.values()) == n_seq + n_par, "every call is answered by exactly one replica"
    # One call at a time: both replicas idle, leastconn takes them in turn (close to half each). Concurrent
    # calls: the replica with fewer in flight gets the next, so a slower one (two cores shared) gets fewer;
    # both must get some.
    for r in (a, b):
        assert seq[r] >= n_seq / 3, f"{r} served {seq[r]:.0f} of {n_seq} calls made one at a time: {seq}"
        assert par[r] > 0, f"{r} served none of {n_par} concurrent calls: {par}"


def rolling_restart(stack: LbStack, protocol: str, progress: Callable[[str], None]) -> dict[str, list[float]]:
    """Restart the replicas one at a time as an operator would (`stop`: SIGTERM, drain; `start`; the next
    once the balancer sends the restarted one calls again), calling `progress(step)` after each step so
    that the caller can wait for answers there. Each replica's count of answered calls at every step."""
    counts: dict[str, list[float]] = {r: [stack.served(r, protocol)] for r in stack.replicas}
    for r in stack.replicas:
        stopping = time.monotonic()
        code = stack.stop(r)
        assert code == 0, f"SIGTERM should drain and exit 0, got {code}:\n{engine().logs(r)}"
        progress(f"after {r} stopped ({time.monotonic() - stopping:.1f} s)")
        took = stack.start(r)
        before = stack.served(r, protocol)

        def serving_again(r: str = r, before: float = before) -> bool:
            return stack.served(r, protocol) > before

        wait_until(
            serving_again,
            f"the balancer to send {r} calls again",
            WAIT,
            0.2,
        )
        progress(f"after {r} started again ({took:.1f} s to healthy)")
        for q in stack.replicas:
            counts[q].append(stack.served(q, protocol))
    return counts


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_rolling_restart_behind_the_lb_fails_no_call_of_plain_clients(
    compose: Callable[..., Compose], protocol: Protocol
) -> None:
    """16 plain clients (no retry policy, no wait-for-ready; HTTP: one keep-alive connection each, never
    resending) call through the balancer while each replica in turn is stopped (SIGTERM), started again,
    and serves again before the next: not one call fails, and each replica answers calls before its
    stop and after its start."""
    stack = LbStack(compose)
    load = Load(protocol, stack.address if protocol == "grpc" else stack.http_address, clients=16)
    steps: list[str] = []

    def progress(step: str) -> None:
        since = time.monotonic()
        load.wait_for_answers(50, since, step, WAIT)
        steps.append(f"{step}: {load.answered_since(0.0)} answered")

    try:
        load.wait_for_answers(100, 0.0, "calls before the restarts", WAIT)
        counts = rolling_restart(stack, protocol, progress)
    finally:
        load.stop()
    print(f"\nrolling restart, {protocol}, 16 plain clients: {load.summary()}\n  " + "\n  ".join(steps))
    print(f"  answered per replica at start / after each restart: {counts}")
    assert not load.errors, f"{load.summary()}\nthe balancer's errors:\n" + "\n".join(stack.balancer_failures()[-10:])
    assert not stack.balancer_failures(), stack.balancer_failures()[:10]
    a, b = stack.replicas
    # a: calls before its stop, and after its start (it restarts first, then serves while b restarts).
    assert counts[a][0] > 0 and counts[a][1] > 0 and counts[a][2] > counts[a][1], counts
    # b: calls before its stop; after its start (its counter began again at 0 with its process).
    assert counts[b][1] > counts[b][0] > 0 and counts[b][2] > 0, counts


def test_locust_through_the_lb_sees_no_failure_while_replicas_restart_one_at_a_time(
    compose: Callable[..., Compose], tmp_path: Path
) -> None:
    """What docs/deploy.md measures: the compose stack's `lb` and `loadtest` profiles, a headless Locust run
    (one worker, 16 users, short texts, gRPC through lb:50051), and the replicas restarted one at a time
    with the engine's stop and start. Locust counts no failure; the figures are printed for the docs."""
    run_time = 180
    stack = LbStack(
        compose,
        profiles=["loadtest"],
        LOADTEST_TARGET="lb:50051",
        LOCUST_HEADLESS="true",
        LOCUST_USERS="16",
        LOCUST_SPAWN_RATE="16",
        LOCUST_RUN_TIME=f"{run_time}s",
        LOCUST_EXPECT_WORKERS="1",
        LOCUST_WORKLOAD="short",
        LOCUST_CSV="/reports/stats",
    )
    results = Path(stack.compose.env["LOADTEST_RESULTS"])
    results.chmod(0o777)  # the image runs Locust as uid 10001
    stack.compose.up(scale={"encoder": 2, "locust-worker": 1})
    (master,) = stack.compose.containers("locust-master")
    started = time.monotonic()
    wait_until(lambda: sum(stack.served(r) for r in stack.replicas) >= 200, "Locust's calls to arrive", START, 0.5)
    steps: list[str] = []

    def answered() -> float:
        """Calls answered by the replicas that are running now (a stopped one's metrics port is closed)."""
        return sum(stack.served(r) for r in stack.replicas if engine().state(r)["Running"])

    def progress(step: str) -> None:
        total = answered()
        wait_until(lambda: answered() >= total + 100, step, WAIT, 0.2)
        steps.append(f"{time.monotonic() - started:.0f} s: {step}")

    counts = rolling_restart(stack, "grpc", progress)
    assert time.monotonic() - started < run_time - 10, "the restarts outlasted the Locust run: raise run_time"
    wait_until(lambda: not engine().state(master)["Running"], "the headless run to end", run_time + START, 1.0)
    log = engine().logs(master, last=None)
    with (results / "stats_stats.csv").open() as f:
        (total,) = [row for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    requests, failures = int(total["Request Count"]), int(total["Failure Count"])
    print(
        f"\nLocust through lb, {run_time} s, 16 users, replicas restarted one at a time: {requests} requests, "
        f"{failures} failures, {float(total['Requests/s']):.1f} req/s, p50 {total['50%']} ms, p99 {total['99%']} ms"
        "\n  " + "\n  ".join(steps) + f"\n  answered per replica at start / after each restart: {counts}"
    )
    assert engine().exit_code(master) == 0, f"Locust exited {engine().exit_code(master)}:\n{log[-6000:]}"
    assert requests > 0 and failures == 0, f"{failures} of {requests} requests failed:\n{log[-6000:]}"
    assert not stack.balancer_failures(), stack.balancer_failures()[:10]


# ---- 4. the loadtest profile ---------------------------------------------------------------------------


def test_loadtest_profile_runs_locust_master_and_two_workers(compose: Callable[..., Compose], tmp_path: Path) -> None:
    stack = compose(
        ["loadtest"],
        LOCUST_HEADLESS="true",
        LOCUST_USERS="8",
        LOCUST_SPAWN_RATE="8",
        LOCUST_RUN_TIME="20s",
        LOCUST_EXPECT_WORKERS="2",
        LOCUST_WORKLOAD="short",
        LOCUST_HTML="/reports/report.html",
        LOCUST_CSV="/reports/stats",
    )
    results = Path(stack.env["LOADTEST_RESULTS"])
    results.chmod(0o777)  # the image runs Locust as uid 10001
    # The encoder first, healthy, then Locust (podman before 4.6 does not wait for `service_healthy`).
    stack.up("encoder")
    (encoder,) = stack.containers("encoder")
    engine().wait_healthy(encoder)
    before = ok_calls(scrape(stack.metrics_port), ENCODE)
    stack.up(scale={"locust-worker": 2})
    (master,) = stack.containers("locust-master")
    workers = stack.containers("locust-worker")
    assert len(workers) == 2, workers
    stack.check_loopback_only()

    wait_until(lambda: not engine().state(master)["Running"], "the headless run to end", 20 + START, 1.0)
    log = engine().logs(master, last=None)
    assert engine().exit_code(master) == 0, f"Locust exited {engine().exit_code(master)}:\n{log[-6000:]}"
    assert re.search(r"Sending spawn jobs of 8 users .* to 2 ready workers", log), log[:6000]

    with (results / "stats_stats.csv").open() as f:
        (total,) = [row for row in csv.DictReader(f) if row["Name"] == "Aggregated"]
    requests, failures = int(total["Request Count"]), int(total["Failure Count"])
    assert requests > 0 and failures == 0, f"{failures} of {requests} requests failed"
    assert "Locust" in (results / "report.html").read_text()
    # Every call Locust counted as answered was answered by the encoder.
    assert ok_calls(scrape(stack.metrics_port), ENCODE) - before >= requests
    print(f"\nloadtest: {requests} requests in 20 s from 2 workers, 0 failures")


# ---- 5. the monitoring profile ---------------------------------------------------------------------------


def test_monitoring_profile_scrapes_both_replicas_and_loads_the_rules(compose: Callable[..., Compose]) -> None:
    stack = compose(
        ["monitoring"],
        MHASERVE_GRPC_PUBLISH="127.0.0.1::50051",
        MHASERVE_HTTP_PUBLISH="127.0.0.1::8080",
        MHASERVE_METRICS_PUBLISH="127.0.0.1::8000",
    )
    # Grafana's image comes from Docker Hub only: its provisioning is checked for structure instead
    # (test_manifests.py), and Prometheus, built from Debian's packages here, is run for real.
    stack.up("encoder", "prometheus", scale={"encoder": 2})
    replicas = stack.containers("encoder")
    assert len(replicas) == 2
    (prometheus,) = stack.containers("prometheus")
    stack.check_loopback_only()
    port = engine().host_port(prometheus, 9090)

    def api(path: str, **params: str) -> Any:
        body = http_get(f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return answer["data"]

    def ready() -> bool:
        try:
            http_get(f"http://127.0.0.1:{port}/-/ready", timeout=2)
            return True
        except OSError:
            return False

    wait_until(ready, "Prometheus to be ready", START, 1.0)
    addresses = set()
    for r in replicas:
        engine().wait_healthy(r)
        networks = engine().inspect(r)["NetworkSettings"]["Networks"]
        addresses |= {f"{n['IPAddress']}:8000" for n in networks.values()}

    def targets_up() -> bool:
        active = [t for t in api("targets", state="active")["activeTargets"] if t["labels"]["job"] == "mhaserve"]
        return {t["labels"]["instance"] for t in active if t["health"] == "up"} == addresses

    # DNS discovery every 10 s, scrapes every 5 s.
    wait_until(targets_up, "Prometheus to scrape both replicas", 90, 1.0)

    rules = yaml.safe_load((DEPLOY / "prometheus/alerts.yml").read_text())
    expected = {r["alert"] for g in rules["groups"] for r in g["rules"]}

    def rules_evaluated() -> bool:
        loaded = [r for g in api("rules")["groups"] for r in g["rules"]]
        return {r["name"] for r in loaded} == expected and all(r["health"] == "ok" for r in loaded)

    wait_until(rules_evaluated, "the alert rules to load and evaluate", 60, 1.0)
    up = api("query", query='up{job="mhaserve"}')["result"]
    assert sorted(float(s["value"][1]) for s in up) == [1.0, 1.0]


# ---- 6. cleaning up --------------------------------------------------------------------------------------


def test_the_images_a_build_made_are_removed_and_the_base_stays(images: Images, tmp_path: Path) -> None:
    """remove_built_images, which the `images` fixture runs when the session ends, on a two-stage build
    made twice (the second build leaves the first image untagged, as a rebuild from a changed checkout
    does): both builds' images and their stages go, the base image they were built on stays."""
    tag = f"mhaserve-cleanup:{checkout_tag()}"
    before = image_table()
    network = ["--network", "host"] if engine().name == "podman" else []
    # Steps of this run's own: a run stopped before its cleanup leaves its layers cached, and builds of the same
    # steps would reuse them and make no image at all.
    nonce = uuid.uuid4().hex
    for n in (1, 2):
        (tmp_path / "Containerfile").write_text(
            f"FROM {images.nginx} AS stage\nRUN echo {n} {nonce} > /tmp/stage\n"
            f"FROM {images.nginx}\nCOPY --from=stage /tmp/stage /tmp/stage\nRUN echo {n} {nonce} > /tmp/final\n"
        )
        engine()("build", *network, "-t", tag, str(tmp_path), timeout=600)
    made = set(image_table()) - set(before)
    assert len(made) >= 4, f"two builds of two stages made only {made}"
    assert tagged_ids([tag]) <= made

    assert remove_built_images([tag], before, set()) == []

    after = image_table()
    # Another build on the machine meanwhile may add images; none of this one's may stay untagged.
    assert not [i for i in made if i in after and not after[i]], "the build's images stayed untagged"
    assert not any(tag in tags for tags in after.values())
    assert tagged_ids([images.nginx]), "the base image was removed with the build"


def test_a_stack_left_by_a_dead_pytest_is_removed_and_a_live_ones_stays(images: Images) -> None:
    """Containers labelled as a compose project of this tier: one named after a pid that no longer runs
    (a session killed before its teardown), one after this process. Only the first is removed."""
    dead = 2**22 + 7  # above Linux's largest pid
    names = {}
    for pid in (dead, os.getpid()):
        project = f"mhaserve-test-{pid}-0"
        names[project] = f"{project}_sleeper_1"
        engine()(
            "run", "-d", "--name", names[project], "--label", f"com.docker.compose.project={project}",
            "--entrypoint", "sleep", images.nginx, "600", timeout=START,
        )  # fmt: skip
    try:
        removed = remove_stale_projects()
        assert f"mhaserve-test-{dead}-0" in removed
        assert f"mhaserve-test-{os.getpid()}-0" not in removed
        running = engine()("ps", "-a", "--format", "{{.Names}}").stdout.split()
        assert names[f"mhaserve-test-{dead}-0"] not in running
        assert names[f"mhaserve-test-{os.getpid()}-0"] in running
    finally:
        for name in names.values():
            engine().remove(name)
