"""The figures docs/deploy.md gives for the images, measured on this machine: `make image-figures`.

    python -m tests.deploy.figures [--cold] [--gpu]

- build time: the images as `make images` builds them (deploy/images/build.sh), cached (nothing changed)
  and, with --cold, as on a fresh machine: podman with an empty image store of its own (so the base image
  is built from Debian's packages too) and an empty download cache (pip's files, which the builds keep in a
  cache mount); with docker, --no-cache;
- image sizes, as the engine reports them (uncompressed);
- the cpu image's start to SERVING (container created, model loaded and warmed up), the median of 5;
- the serving container's memory at rest and under load (16 concurrent clients for 30 s, Encode of corpus
  texts): the engine's figure for the container (`stats`) and the server process's resident set.

Everything runs on 127.0.0.1; the containers are removed afterwards. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import random
import re
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.testing.loopback import free_port, wait_until
from tests.deploy.containers import START, container, engine, serving
from tests.deploy.helpers import ROOT

# Where the image builds keep pip's downloads (deploy/images/pip-install.sh's cache mount, under podman).
PODMAN_DOWNLOADS = Path("/var/tmp/buildah-cache/root/.cache/mhaserve-pip")
CORPUS = ROOT / "loadtest" / "corpus.txt"


def build(targets: list[str], *extra: str, env: dict[str, str] | None = None) -> tuple[float, dict[str, float]]:
    """Seconds for the whole build.sh run, and per image as it reports them."""
    env = dict(os.environ) | {"CONTAINER_ENGINE": engine().name, "BUILD_ARGS": " ".join(extra)} | (env or {})
    start = time.monotonic()
    result = subprocess.run(
        [str(ROOT / "deploy/images/build.sh"), *targets],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    took = time.monotonic() - start
    assert result.returncode == 0, result.stderr[-4000:]
    return took, {m[0]: float(m[1]) for m in re.findall(r"^images: (\S+) built in (\d+) s$", result.stderr, re.M)}


def cold_build(targets: list[str]) -> list[tuple[str, str]]:
    """As on a fresh machine; the row for the whole build and one per image."""
    e = engine()
    if e.name != "podman":
        total, each = build(targets, "--no-cache")
        return [(f"build {' + '.join(targets)}, cold (--no-cache)", f"{total:.0f} s")]
    cold = Path("/var/tmp/mhaserve-figures-cold")
    aside = PODMAN_DOWNLOADS.with_name("mhaserve-pip.aside")
    assert not cold.exists() and not aside.exists(), f"left over from an interrupted run: {cold}, {aside}"
    (cold / "storage").mkdir(parents=True)
    conf = cold / "storage.conf"
    conf.write_text(f'[storage]\ndriver = "overlay"\ngraphroot = "{cold}/storage"\nrunroot = "{cold}/run"\n')
    env = {"CONTAINERS_STORAGE_CONF": str(conf)}
    moved = PODMAN_DOWNLOADS.exists()
    if moved:
        PODMAN_DOWNLOADS.rename(aside)
    try:
        total, each = build(targets, env=env)
    finally:
        subprocess.run(["podman", "rmi", "-a", "-f"], env=dict(os.environ) | env, capture_output=True)
        shutil.rmtree(cold, ignore_errors=True)
        if moved:
            shutil.rmtree(PODMAN_DOWNLOADS, ignore_errors=True)
            aside.rename(PODMAN_DOWNLOADS)
    rows = [(f"build {' + '.join(targets)}, cold (fresh image store and downloads)", f"{total:.0f} s")]
    base = total - sum(each.values())
    rows.append(
        ("  of which the base image from Debian's packages (deploy/images/base.sh) and pip's check", f"{base:.0f} s")
    )
    rows += [(f"  of which `{tag}`", f"{seconds:.0f} s") for tag, seconds in each.items()]
    return rows


def size_mb(image: str) -> float:
    return int(engine()("image", "inspect", "--format", "{{.Size}}", image).stdout.strip()) / 1e6


def memory(name: str) -> tuple[float, float]:
    """(the engine's memory figure for the container, the server process's resident set), in MB."""
    usage = engine()("stats", "--no-stream", "--format", "{{.MemUsage}}", name).stdout.split("/")[0].strip()
    m = re.fullmatch(r"([\d.]+)\s*([kMG]i?B)", usage)
    assert m, usage
    scale = {"kB": 1e-3, "KiB": 1.024e-3, "MB": 1, "MiB": 1.048576, "GB": 1e3, "GiB": 1073.741824}[m.group(2)]
    rss_kb = re.search(r"VmRSS:\s+(\d+) kB", engine()("exec", name, "cat", "/proc/1/status").stdout)
    assert rss_kb
    return float(m.group(1)) * scale, int(rss_kb.group(1)) / 1e3


def start_to_serving(image: str) -> float:
    grpc_port = free_port()
    started = time.monotonic()
    with container(image, "-p", f"127.0.0.1:{grpc_port}:50051", name=f"mhaserve-figures-{grpc_port}"):
        wait_until(lambda: serving(f"127.0.0.1:{grpc_port}"), "SERVING", START, 0.05)
        return time.monotonic() - started


def under_load(address: str, seconds: float, clients: int, sample: Callable[[], None]) -> int:
    """`clients` threads, each with a channel of its own, calling Encode with one corpus text at a time, for
    `seconds`; calls answered."""
    texts = [t for t in CORPUS.read_text().splitlines() if t.strip()]
    stop = time.monotonic() + seconds
    done: list[int] = []

    def caller(seed: int) -> None:
        rng, n = random.Random(seed), 0
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            while time.monotonic() < stop:
                stub.Encode(pb.EncodeRequest(texts=[rng.choice(texts)], truncate=True), timeout=30)
                n += 1
        done.append(n)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        sample()
        time.sleep(2)
    for t in threads:
        t.join()
    return sum(done)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", action="store_true", help="also a build without caches (about 10 min here)")
    parser.add_argument("--gpu", action="store_true", help="also build the gpu image (about 2 GB of CUDA packages)")
    opts = parser.parse_args()
    e = engine()
    targets = ["cpu", "loadtest", *(["gpu"] if opts.gpu else [])]
    rows: list[tuple[str, str]] = []

    if opts.cold:
        rows += cold_build(targets)
    build(targets)  # whatever the cache missed
    rows.append((f"build {' + '.join(targets)}, cached (nothing changed)", f"{build(targets)[0]:.0f} s"))
    for t in targets:
        rows.append((f"image `mhaserve:{t}`", f"{size_mb(f'mhaserve:{t}'):.0f} MB"))

    starts = [start_to_serving("mhaserve:cpu") for _ in range(5)]
    rows.append(("`cpu` container start to SERVING (median of 5)", f"{statistics.median(starts):.1f} s"))

    grpc_port = free_port()
    with container("mhaserve:cpu", "-p", f"127.0.0.1:{grpc_port}:50051", name=f"mhaserve-figures-{grpc_port}") as name:
        address = f"127.0.0.1:{grpc_port}"
        wait_until(lambda: serving(address), "SERVING", START, 0.1)
        time.sleep(10)
        rest = memory(name)
        rows.append(("`cpu` container memory at rest (engine / server RSS)", f"{rest[0]:.0f} MB / {rest[1]:.0f} MB"))
        peak = [0.0, 0.0]

        def sample() -> None:
            now = memory(name)
            peak[:] = [max(p, n) for p, n in zip(peak, now, strict=True)]

        calls = under_load(address, 30, 16, sample)
        rows.append(
            (
                f"`cpu` container memory under load, peak (16 clients, {calls / 30:.0f} calls/s)",
                f"{peak[0]:.0f} MB / {peak[1]:.0f} MB",
            )
        )

    print(
        f"Measured {dt.date.today().isoformat()} with {e.name} {e.version} on {platform.machine()}, "
        f"{os.cpu_count()} cores, {platform.freedesktop_os_release().get('PRETTY_NAME', platform.system())}\n"
    )
    print("| what | figure |\n| --- | --- |")
    for what, figure in rows:
        print(f"| {what} | {figure} |")


if __name__ == "__main__":
    main()
