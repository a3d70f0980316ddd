"""`make gpu-check`: prove the CUDA path on a GPU host. Exits 1 if anything ran anywhere but CUDA.

1. The session really got CUDAExecutionProvider (ONNX Runtime falls back to the CPU silently).
2. Parity: the graph on CUDA against the same graph on the CPU, over batches with padding.
3. The server on CUDA: GetModelInfo reports CUDA, the metrics' provider gauge says so, and served
   embeddings equal the CPU engine's.
4. A short throughput run: concurrent clients through the server against the engine in-process on the
   same batch shapes (reported, not gated: the gate is parity and the provider).

Run: python -m mhaserve.testing.gpu_check --repository models --model all-minilm-l6-v2 [--graph fp16] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
import grpc.aio
import numpy as np
import numpy.typing as npt

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime.devices import CUDA, Device
from mhaserve.runtime.engine import OnnxEngine
from mhaserve.runtime.errors import ServiceError
from mhaserve.runtime.repository import GraphChoice, ModelEntry, ModelRepository, RepositoryError
from mhaserve.service.batching.padding import pad
from mhaserve.service.server import EncoderServer
from mhaserve.service.settings import Settings
from mhaserve.testing.metrics import from_registry

log = logging.getLogger("mhaserve.gpu_check")

# TF32 matmuls (ORT's CUDA default) and fused kernels move fp32 results by ~1e-4; fp16 by ~1e-2.
TOLERANCE = {"fp32": 2e-3, "fp16": 3e-2}
MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "a",
    "GPU inference with dynamic batching " * 8,
    "Une phrase en français.",
    "",
    "word " * 300,
]


class CheckFailed(RuntimeError):
    pass


def _batch(rng: np.random.Generator, rows: int, width: int, vocab: int) -> tuple[npt.NDArray[np.int64], ...]:
    lengths = rng.integers(1, width + 1, size=rows)
    lengths[0] = width
    seqs = [rng.integers(1, vocab, size=n).astype(np.int64) for n in lengths]
    return pad(seqs, 0)


def _compare(what: str, got: npt.NDArray[np.float32], want: npt.NDArray[np.float32], precision: str) -> str:
    diff = float(np.abs(got - want).max())
    cos = float(((got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)).min())
    line = f"{what}: max |diff| {diff:.2e} (tolerance {TOLERANCE[precision]:.0e}), min cosine {cos:.7f}"
    if diff > TOLERANCE[precision] or cos < MIN_COSINE[precision]:
        raise CheckFailed(line)
    return line


def check_engine(entry: ModelEntry, threads: int | None) -> tuple[OnnxEngine, OnnxEngine, list[str]]:
    m = entry.manifest

    def engine(device: Device) -> OnnxEngine:
        return OnnxEngine(
            entry.graph_path,
            max_seq_len=m.max_seq_len,
            vocab_size=m.vocab_size,
            device=device,
            intra_op_threads=threads,
        )

    try:
        cuda = engine("cuda")
    except ServiceError as e:
        raise CheckFailed(e.message) from None
    if cuda.providers[0] != CUDA or not cuda.on_cuda:
        raise CheckFailed(f"the session did not get CUDA: {cuda.providers}")
    cpu = engine("cpu")
    precision = m.graphs[entry.graph].precision
    rng = np.random.default_rng(0)
    lines = [f"session providers: {cuda.providers}"]
    for rows, width in ((1, 1), (1, m.max_seq_len), (3, 7), (32, 128), (8, m.max_seq_len)):
        ids, mask = _batch(rng, rows, min(width, m.max_seq_len), m.vocab_size)
        lines.append(_compare(f"engine {rows}x{width}", cuda.run(ids, mask), cpu.run(ids, mask), precision))
    return cuda, cpu, lines


async def check_server(
    settings: Settings, cpu: OnnxEngine, entry: ModelEntry, seconds: float, clients: int
) -> list[str]:
    server = EncoderServer(settings)
    await server.start()
    try:
        await server.ready()
        assert server.model is not None
        lines = [f"server session provider: {server.model.provider}"]
        gauge = from_registry(server.metrics.registry).get("mhaserve_execution_provider_info", provider=CUDA)
        if server.model.provider != CUDA or gauge != 1:
            raise CheckFailed(f"the server's session runs on {server.model.provider}, not CUDA")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.EncoderServiceStub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
            if info.execution_provider != CUDA:
                raise CheckFailed(f"GetModelInfo reports {info.execution_provider}")
            reply = await stub.Encode(pb.EncodeRequest(texts=TEXTS, truncate=True, normalize=False), timeout=60)
            served = np.array([e.values for e in reply.embeddings], dtype=np.float32)
            assert server.model is not None
            tok = server.model.tokenizer
            want = np.stack([cpu.run(*pad([np.array(tok.encode(t).ids, dtype=np.int64)], 0))[0] for t in TEXTS])
            lines.append(_compare("served vs CPU engine", served, want, entry.manifest.graphs[entry.graph].precision))
            lines.append(await server_throughput(stub, seconds, clients))
        return lines
    finally:
        await server.stop(5)


async def server_throughput(stub: pb_grpc.EncoderServiceStub, seconds: float, clients: int) -> str:
    texts = [f"throughput sentence number {i} " + "with some words " * (i % 12) for i in range(32)]
    done = 0
    stop_at = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            # the longest texts pass a small model's maximum (the tiny test model's 160 tokens): truncate them
            reply = await stub.Encode(pb.EncodeRequest(texts=texts, truncate=True), timeout=60)
            done += len(reply.embeddings)

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    rate = done / (time.perf_counter() - start)
    if done == 0:
        raise CheckFailed("the throughput run embedded nothing")
    return f"throughput through the server: {rate:,.0f} inputs/s ({clients} clients x 32 texts per request)"


def engine_throughput(engine: OnnxEngine, seconds: float, rows: int, width: int, vocab: int) -> str:
    ids, mask = _batch(np.random.default_rng(1), rows, width, vocab)
    engine.run(ids, mask)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        engine.run(ids, mask)
        n += rows
    return f"throughput in-process, batches of {rows}x{width}: {n / (time.perf_counter() - start):,.0f} inputs/s"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mhaserve.testing.gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--repository", type=Path, default=Path("models"))
    p.add_argument("--model", default=None)
    p.add_argument("--graph", default="auto", choices=["auto", "fp32", "optimized", "fp16"])
    p.add_argument("--seconds", type=float, default=10.0, help="length of each throughput run")
    p.add_argument("--clients", type=int, default=16)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    graph: GraphChoice = args.graph
    try:
        entry = ModelRepository(args.repository).entry(args.model, graph=graph, device="cuda")  # as served below
        print(f"gpu-check: {entry.name} version {entry.version}, {entry.graph} graph")
        cuda, cpu, lines = check_engine(entry, threads=None)
        for line in lines:
            print(f"  ok  {line}")
        settings = Settings(
            repository=args.repository,
            model=(entry.name,),
            graph=graph,
            port=0,
            metrics_port=0,
            http_port=0,
            device="cuda",
        )
        for line in asyncio.run(check_server(settings, cpu, entry, args.seconds, args.clients)):
            print(f"  ok  {line}")
        print(f"  ok  {engine_throughput(cuda, args.seconds / 2, 64, 128, entry.manifest.vocab_size)}")
    except (CheckFailed, RepositoryError, ServiceError) as e:
        print(f"gpu-check: FAILED: {getattr(e, 'message', e)}", file=sys.stderr)
        return 1
    print("gpu-check: passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
