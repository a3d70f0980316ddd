"""A try at the transient UNAVAILABLE "was unloaded; retry" once seen while versions were published under poll:
a real `mhaserve serve --model-control poll` (50 ms polls) on a tiny random model, two encoder.v1 clients (the
server's default model), two OpenAI clients and a KServe REST client in closed loops, while a new version (a
copy of the last) is published every EVERY seconds and versions three behind are deleted; every outcome is
tallied. Run from the repository root:
    python docs/bench/2026-12-02-fortyfifth/poll_publish.py SCRATCH SECONDS EVERY FRONT
"""

import collections
import io
import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai

from mhaserve.export.publish import ExportOptions, export_entry
from mhaserve.model.config import TINY
from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import free_ports


def publish(repo: Path, version: int) -> None:
    """Version `version` as a copy of the one before, renamed in whole, as an operator's copy would be."""
    scratch = repo / "a" / f".copy-{version}"
    shutil.copytree(repo / "a" / str(version - 1), scratch)
    manifest = json.loads((scratch / "manifest.json").read_text())
    manifest["version"] = version
    (scratch / "manifest.json").write_text(json.dumps(manifest))
    scratch.rename(repo / "a" / str(version))


def main(scratch: Path, seconds: float, every: float, front: str) -> None:
    repo = scratch / "repo"
    shutil.rmtree(repo, ignore_errors=True)
    options = ExportOptions(source="random", repository=repo, name="a", version=1, random_config=dict(TINY), seed=1)
    export_entry(options, out=io.StringIO())
    port, http, metrics = free_ports(3)
    argv = [sys.executable, "-m", "mhaserve.cli", "serve", "--repository", str(repo), "--model", "a",
            "--model-control", "poll", "--repository-poll-s", "0.05", "--port", str(port), "--http-port",
            str(http), "--metrics-port", str(metrics), "--grpc-front", front, "--grace-period", "2"]  # fmt: skip
    with (scratch / "server.log").open("wb") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    stub = pb_grpc.EncoderServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    for _ in range(300):
        try:
            stub.Encode(pb.EncodeRequest(texts=["x"]), timeout=2)
            break
        except grpc.RpcError:
            time.sleep(0.2)
    outcomes: collections.Counter[str] = collections.Counter()
    stop = threading.Event()

    def encoder_v1() -> None:
        while not stop.is_set():
            try:
                stub.Encode(pb.EncodeRequest(texts=["hello world"]), timeout=10)
                outcomes["encoder.v1 OK"] += 1
            except grpc.RpcError as e:
                outcomes[f"encoder.v1 {e.code().name}: {e.details()[:80]}"] += 1

    def openai_client() -> None:
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="-", max_retries=0)
        while not stop.is_set():
            try:
                c.embeddings.create(model="a", input="hello world")
                outcomes["openai OK"] += 1
            except openai.APIError as e:
                outcomes[f"openai {getattr(e, 'status_code', None)}: {str(e)[:80]}"] += 1

    def kserve_rest() -> None:
        text = {"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hello world"]}
        body = json.dumps({"inputs": [text]}).encode()
        while not stop.is_set():
            url = f"http://127.0.0.1:{http}/v2/models/a/infer"
            request = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    reply.read()
                outcomes["kserve OK"] += 1
            except urllib.error.HTTPError as e:
                outcomes[f"kserve {e.code}: {e.read()[:80]!r}"] += 1

    clients = [threading.Thread(target=f) for f in (encoder_v1, encoder_v1, openai_client, openai_client, kserve_rest)]
    for t in clients:
        t.start()
    started, version = time.time(), 1
    while time.time() - started < seconds:
        time.sleep(every)
        version += 1
        publish(repo, version)
        if version > 3:
            shutil.rmtree(repo / "a" / str(version - 3), ignore_errors=True)
    stop.set()
    for t in clients:
        t.join()
    server.terminate()
    server.wait(20)
    print(f"front {front}: {version - 1} versions published in {seconds:g} s")
    for outcome, n in sorted(outcomes.items()):
        print(n, outcome)


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
