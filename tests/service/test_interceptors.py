"""The interceptor on a bare grpc.aio server: a bug becomes a short INTERNAL, a ServiceError its own code;
and on the real server, a request message that does not parse INVALID_ARGUMENT."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from mhaserve.proto.encoder.v1 import encoder_pb2 as pb
from mhaserve.proto.encoder.v1 import encoder_pb2_grpc as pb_grpc
from mhaserve.runtime.errors import NotFound, ServiceError, Unavailable
from mhaserve.service.context import request_id
from mhaserve.service.metrics import Metrics
from mhaserve.service.rpc.interceptors import ServiceInterceptor
from mhaserve.testing.loopback import WAIT
from mhaserve.testing.metrics import from_registry
from mhaserve.testing.server import ServerThread, local_settings


async def _admit_all(time_left: float | None) -> ServiceError | None:
    return None


class Raw:
    """A server whose methods raise what the test asks, behind the real interceptor."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.seen_ids: list[str] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(WAIT)

    async def _start(self) -> int:
        async def bug(request: bytes, context: Any) -> bytes:
            self.seen_ids.append(request_id.get())
            raise KeyError("secret internals /etc/passwd")

        async def missing(request: bytes, context: Any) -> bytes:
            raise NotFound("no such thing")

        async def fine(request: bytes, context: Any) -> bytes:
            self.seen_ids.append(request_id.get())
            return request

        handlers = {
            name: grpc.unary_unary_rpc_method_handler(f)
            for name, f in (("Bug", bug), ("Missing", missing), ("Fine", fine))
        }
        self.server = grpc.aio.server(interceptors=[ServiceInterceptor(self.metrics, _admit_all)])
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Raw", handlers),))
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return int(port)

    def call(self, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            try:
                channel.unary_unary(f"/test.Raw/{method}")(b"x", timeout=WAIT, metadata=metadata)
            except grpc.RpcError as e:
                return e.code(), e.details()
        return grpc.StatusCode.OK, ""

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(WAIT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(WAIT)


@pytest.fixture(scope="module")
def raw() -> Iterator[Raw]:
    server = Raw()
    yield server
    server.close()


def test_a_bug_is_internal_without_its_internals(raw: Raw, caplog: pytest.LogCaptureFixture) -> None:
    code, details = raw.call("Bug", metadata=(("x-request-id", "req-42"),))
    assert code == grpc.StatusCode.INTERNAL
    assert details == "internal error (request id req-42; details are in the server log)"
    assert raw.seen_ids[-1] == "req-42"
    logged = [r for r in caplog.records if r.name == "mhaserve.service.rpc.interceptors"]
    assert logged and logged[-1].exc_info is not None  # the traceback is in the log, with the id


def test_a_service_error_keeps_its_code(raw: Raw) -> None:
    assert raw.call("Missing") == (grpc.StatusCode.NOT_FOUND, "no such thing")
    assert raw.call("Fine") == (grpc.StatusCode.OK, "")
    counts = {
        code: raw.metrics.registry.get_sample_value(
            "mhaserve_requests_total", {"method": f"test.Raw/{m}", "code": code}
        )
        for m, code in (("Missing", "NOT_FOUND"), ("Fine", "OK"))
    }
    assert counts == {"NOT_FOUND": 1.0, "OK": 1.0}


def test_a_request_that_does_not_parse_is_invalid_argument_and_counted(tiny_repo: Path) -> None:
    """Bytes that are not a message of the method's type (a string field that is not UTF-8, as a C++ or Go
    client can send; or no message at all) are the client's error: INVALID_ARGUMENT, counted, the server
    going on. grpc.aio's own parsing answered UNKNOWN naming the parser's exception class (unary) or
    INTERNAL (streams), with a traceback in the log."""
    not_utf8 = b"\x0a\x02\xff\xfe"  # field 1 (texts), 2 bytes: not UTF-8
    garbage = b"\xff\xff\xff\xff"
    with ServerThread(local_settings(tiny_repo)).ready() as srv, srv.channel() as channel:
        for method in ("/encoder.v1.EncoderService/Encode", "/inference.GRPCInferenceService/ModelInfer"):
            for data in (not_utf8, garbage):
                with pytest.raises(grpc.RpcError) as e:
                    channel.unary_unary(method)(data, timeout=WAIT)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
                assert "the request is not a valid message for this method" in str(e.value.details())
        # a stream answers what came before, then ends with the same status
        good = pb.EncodeRequest(texts=["fine"]).SerializeToString()
        stream = channel.stream_stream("/encoder.v1.EncoderService/EncodeStream")(iter([good, not_utf8]), timeout=WAIT)
        got = []
        with pytest.raises(grpc.RpcError) as e:
            got.extend(stream)
        assert len(got) == 1 and e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        counted = srv.server.metrics.registry.get_sample_value(
            "mhaserve_requests_total", {"method": "encoder.v1.EncoderService/Encode", "code": "INVALID_ARGUMENT"}
        )
        assert counted == 2.0
        reply = pb_grpc.EncoderServiceStub(channel).Encode(pb.EncodeRequest(texts=["still here"]), timeout=WAIT)
        assert len(reply.embeddings) == 1


def test_a_method_open_to_all_refuses_a_request_that_does_not_parse_as_any_other(
    tiny_repo: Path, grpc_front: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Health, reflection and the Open Inference Protocol's probes answer without the call bookkeeping (and without
    a key): bytes that are not their message are INVALID_ARGUMENT on either front, with no traceback in the log. On
    grpc.aio's front they were UNKNOWN naming the parser's exception class, and an ERROR with a traceback each (a
    log anyone reaching the port could fill); a call refused for its key, UNAUTHENTICATED, is so whatever its
    bytes, as the lean front answers it without reading them."""
    garbage = b"\xff\xff"
    keys = tmp_path / "keys"
    keys.write_text("secret\n")
    settings = local_settings(tiny_repo, grpc_front=grpc_front, api_keys_file=keys)
    with ServerThread(settings).ready() as srv, srv.channel() as channel:
        for method in (
            "/grpc.health.v1.Health/Check",
            "/inference.GRPCInferenceService/ServerLive",
            "/inference.GRPCInferenceService/ServerReady",
        ):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(method)(garbage, timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
            assert "the request is not a valid message for this method" in str(e.value.details())
        watch = channel.unary_stream("/grpc.health.v1.Health/Watch")(garbage, timeout=WAIT)
        with pytest.raises(grpc.RpcError) as e:
            next(watch)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        for reflection in ("v1", "v1alpha"):
            method = f"/grpc.reflection.{reflection}.ServerReflection/ServerReflectionInfo"
            answers = channel.stream_stream(method)(iter([garbage]), timeout=WAIT)
            with pytest.raises(grpc.RpcError) as e:
                next(answers)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, e.value.details())
        for method in ("/inference.GRPCInferenceService/ModelReady", "/encoder.v1.EncoderService/Encode"):
            with pytest.raises(grpc.RpcError) as e:
                channel.unary_unary(method)(garbage, timeout=WAIT)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, e.value.details())
        assert channel.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=WAIT) == b"\x08\x01"
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize(("remaining", "code"), [(30.0, "CANCELLED"), (0.0, "DEADLINE_EXCEEDED"), (None, "CANCELLED")])
def test_a_stream_closed_at_an_answer_by_its_writer_is_counted_as_its_client_gone(
    remaining: float | None, code: str
) -> None:
    """A client that cancels a stream, or whose deadline passes, while an answer is being written has that raised
    in the writer (grpc.aio's write, the lean front's), which leaves the stream's generator at its `yield` to be
    closed: it was counted OK, on both fronts."""
    metrics = Metrics()
    interceptor = ServiceInterceptor(metrics, _admit_all)

    async def answers(request: bytes, context: Any) -> Any:
        for i in range(3):
            yield i

    class Context:  # what the interceptor reads of grpc.aio's
        def set_trailing_metadata(self, metadata: Any) -> None:
            pass

        def time_remaining(self) -> float | None:
            return remaining

    async def written_once_then_closed() -> None:
        stream = interceptor._stream(answers, "test.Raw/Stream", "rid", lambda r: r, _admit_all)(b"x", Context())
        assert await stream.__anext__() == 0
        await stream.aclose()

    asyncio.run(written_once_then_closed())
    counted = from_registry(metrics.registry)
    assert counted.get("mhaserve_requests_total", method="test.Raw/Stream", code=code) == 1
    assert counted.get("mhaserve_requests_total", method="test.Raw/Stream", code="OK") == 0

    async def abandoned_while_written() -> None:
        """The server's grace period ended (`abandon`) while an answer was written: cancelled in the writer too."""
        stream = interceptor._stream(answers, "test.Raw/Late", "rid", lambda r: r, _admit_all)(b"x", Context())
        taken = asyncio.Event()

        async def writer() -> None:
            assert await stream.__anext__() == 0
            taken.set()
            await asyncio.sleep(WAIT)  # writing the answer: cancelled here, outside the stream's generator

        task = asyncio.create_task(writer())
        await taken.wait()
        assert interceptor.abandon(Unavailable("the server stopped")) == [task]
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await stream.aclose()

    asyncio.run(abandoned_while_written())
    counted = from_registry(metrics.registry)
    assert counted.get("mhaserve_requests_total", method="test.Raw/Late", code="UNAVAILABLE") == 1
