"""Drive a running mhaserve with Triton's own Python clients (tritonclient[grpc] and [http]) and print JSON.

Runs under .venv-triton (tritonclient needs protobuf < 7, mhaserve protobuf >= 7), never in the
project's venv, and imports nothing from mhaserve. The interop tests start a server, run this script
and compare what it prints with what encoder.v1's Encode returns.

    .venv-triton/bin/python tests/kserve/triton_client.py run < spec.json        # gRPC; spec: see `run`
    .venv-triton/bin/python tests/kserve/triton_client.py run_http < spec.json   # HTTP; spec: see `run_http`
    .venv-triton/bin/python tests/kserve/triton_client.py describe          # tritonclient's message definitions
"""

from __future__ import annotations

import json
import queue
import sys
from typing import Any

import numpy as np

TIMEOUT = 30.0  # seconds, for every call


def _client() -> Any:
    # Imported here, so the test suite can import `describe_file` from this module without tritonclient.
    import tritonclient.grpc as grpcclient

    return grpcclient


def embeddings(result: Any) -> dict[str, Any]:
    response = result.get_response()
    out = response.outputs[0]
    return {
        "embeddings": result.as_numpy("embeddings").tolist(),
        "datatype": out.datatype,
        "shape": list(out.shape),
        "model_name": response.model_name,
        "model_version": response.model_version,
        "id": response.id,
        "input_tokens": response.parameters["input_tokens"].int64_param,
    }


def text_input(texts: list[str], name: str = "text") -> Any:
    tensor = _client().InferInput(name, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_))
    return tensor


def ids_inputs(ids: list[list[int]], mask: list[list[int]]) -> list[Any]:
    tensors = []
    for name, rows in (("input_ids", ids), ("attention_mask", mask)):
        array = np.array(rows, dtype=np.int64)
        tensor = _client().InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def status_of(call: Any) -> dict[str, str]:
    """The status a call failed with (or OK)."""
    from tritonclient.utils import InferenceServerException

    try:
        call()
    except InferenceServerException as e:
        return {"status": str(e.status()), "message": str(e.message())}
    return {"status": "OK", "message": ""}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """spec: url, model, texts (list of str), ids and mask (padded rows of the same shape)."""
    model, texts = spec["model"], spec["texts"]
    grpcclient = _client()
    client = grpcclient.InferenceServerClient(url=spec["url"])
    out: dict[str, Any] = {}
    try:
        out["live"] = client.is_server_live(client_timeout=TIMEOUT)
        out["ready"] = client.is_server_ready(client_timeout=TIMEOUT)
        out["model_ready"] = client.is_model_ready(model, client_timeout=TIMEOUT)
        out["model_ready_missing"] = client.is_model_ready("no-such-model", client_timeout=TIMEOUT)
        out["server_metadata"] = client.get_server_metadata(as_json=True, client_timeout=TIMEOUT)
        out["model_metadata"] = client.get_model_metadata(model, as_json=True, client_timeout=TIMEOUT)
        out["model_config"] = client.get_model_config(model, as_json=True, client_timeout=TIMEOUT)
        out["statistics_before"] = client.get_inference_statistics(model, as_json=True, client_timeout=TIMEOUT)

        requested = [grpcclient.InferRequestedOutput("embeddings")]
        result = client.infer(
            model, [text_input(texts)], outputs=requested, request_id="text-1", client_timeout=TIMEOUT
        )
        out["infer_text"] = embeddings(result)
        result = client.infer(
            model, [text_input(texts)], parameters={"normalize": False}, model_version="", client_timeout=TIMEOUT
        )
        out["infer_text_raw"] = embeddings(result)
        result = client.infer(model, [text_input(texts)], parameters={"dimensions": 8}, client_timeout=TIMEOUT)
        out["infer_text_dims"] = embeddings(result)
        result = client.infer(model, ids_inputs(spec["ids"], spec["mask"]), client_timeout=TIMEOUT)
        out["infer_ids"] = embeddings(result)

        # The streaming API: one request per text, answers matched by id.
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)), stream_timeout=TIMEOUT)
        for i, text in enumerate(texts):
            # An empty final answer asked for (tritonclient's flag), which a model that is not decoupled never
            # sends: its one answer is marked final.
            final = i == 0
            client.async_stream_infer(
                model, [text_input([text])], request_id=f"stream-{i}", enable_empty_final_response=final
            )
        client.async_stream_infer(model, [text_input(["x"], name="nope")], request_id="stream-bad")
        stream: dict[str, Any] = {}
        for _ in range(len(texts) + 1):
            result, error = answers.get(timeout=TIMEOUT)
            if error is not None:
                stream["error"] = str(error)
            else:
                answer = embeddings(result)
                answer["final"] = result.get_response().parameters["triton_final_response"].bool_param
                stream[answer["id"]] = answer
        client.stop_stream()
        out["stream"] = stream

        bad_dtype = grpcclient.InferInput("input_ids", [1, 2], "INT32")
        bad_dtype.set_data_from_numpy(np.array([[2, 3]], dtype=np.int32))
        # Shared memory (never registered: the server refuses the tensors that name a region, whatever it holds)
        shm_input = grpcclient.InferInput("text", [1], "BYTES")
        shm_input.set_shared_memory("in0", 16)
        shm_output = grpcclient.InferRequestedOutput("embeddings")
        shm_output.set_shared_memory("out0", 4 * 32 * len(texts))
        out["errors"] = {
            "wrong_datatype": status_of(lambda: client.infer(model, [bad_dtype], client_timeout=TIMEOUT)),
            "dimensions_too_many": status_of(
                lambda: client.infer(model, [text_input(texts)], parameters={"dimensions": 33}, client_timeout=TIMEOUT)
            ),
            "dimensions_not_int": status_of(
                lambda: client.infer(model, [text_input(texts)], parameters={"dimensions": "8"}, client_timeout=TIMEOUT)
            ),
            "shared_memory_input": status_of(lambda: client.infer(model, [shm_input], client_timeout=TIMEOUT)),
            "shared_memory_output": status_of(
                lambda: client.infer(model, [text_input(texts)], outputs=[shm_output], client_timeout=TIMEOUT)
            ),
            "missing_input": status_of(
                lambda: client.infer(model, ids_inputs(spec["ids"], spec["mask"])[:1], client_timeout=TIMEOUT)
            ),
            "unknown_model": status_of(
                lambda: client.infer("no-such-model", [text_input(texts)], client_timeout=TIMEOUT)
            ),
            "unknown_version": status_of(
                lambda: client.infer(model, [text_input(texts)], model_version="999", client_timeout=TIMEOUT)
            ),
            "metadata_unknown_model": status_of(
                lambda: client.get_model_metadata("no-such-model", client_timeout=TIMEOUT)
            ),
        }
        # Still serving after the errors.
        out["infer_after_errors"] = embeddings(client.infer(model, [text_input(texts)], client_timeout=TIMEOUT))
        out["statistics_after"] = client.get_inference_statistics(model, as_json=True, client_timeout=TIMEOUT)
    finally:
        client.close()
    return out


def run_http(spec: dict[str, Any]) -> dict[str, Any]:
    """The same over HTTP with tritonclient.http: spec: url (host:port), model, texts, ids and mask."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    model, texts = spec["model"], spec["texts"]
    client = httpclient.InferenceServerClient(url=spec["url"], network_timeout=TIMEOUT, connection_timeout=TIMEOUT)

    def text_tensor(values: list[str], binary: bool = True) -> Any:
        tensor = httpclient.InferInput("text", [len(values)], "BYTES")
        tensor.set_data_from_numpy(np.array([v.encode() for v in values], dtype=np.object_), binary_data=binary)
        return tensor

    def ids_tensors(binary: bool = True) -> list[Any]:
        tensors = []
        for name in ("input_ids", "attention_mask"):
            array = np.array(spec["ids" if name == "input_ids" else "mask"], dtype=np.int64)
            tensor = httpclient.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array, binary_data=binary)
            tensors.append(tensor)
        return tensors

    def result(r: Any) -> dict[str, Any]:
        response = r.get_response()
        return {
            "embeddings": r.as_numpy("embeddings").tolist(),
            "model_name": response["model_name"],
            "model_version": response["model_version"],
            "id": response.get("id", ""),
            "input_tokens": response["parameters"]["input_tokens"],
            "binary": "data" not in response["outputs"][0],
        }

    def status(call: Any) -> dict[str, str]:
        try:
            call()
        except InferenceServerException as e:
            return {"status": str(e.status()), "message": str(e.message())}
        return {"status": "OK", "message": ""}

    out: dict[str, Any] = {}
    try:
        out["live"] = client.is_server_live()
        out["ready"] = client.is_server_ready()
        out["model_ready"] = client.is_model_ready(model)
        out["model_ready_missing"] = client.is_model_ready("no-such-model")
        out["server_metadata"] = client.get_server_metadata()
        out["model_metadata"] = client.get_model_metadata(model)
        out["model_config"] = client.get_model_config(model)
        out["statistics_before"] = client.get_inference_statistics(model)
        # tritonclient's defaults: binary inputs, and every output asked for as binary data
        out["infer_text"] = result(client.infer(model, [text_tensor(texts)], request_id="http-1"))
        out["infer_text_json"] = result(
            client.infer(
                model,
                [text_tensor(texts, binary=False)],
                outputs=[httpclient.InferRequestedOutput("embeddings", binary_data=False)],
            )
        )
        out["infer_text_raw"] = result(client.infer(model, [text_tensor(texts)], parameters={"normalize": False}))
        out["infer_text_dims"] = result(client.infer(model, [text_tensor(texts)], parameters={"dimensions": 8}))
        out["infer_ids"] = result(client.infer(model, ids_tensors(), model_version="1"))
        out["infer_ids_json"] = result(client.infer(model, ids_tensors(binary=False)))
        out["infer_gzip"] = result(client.infer(model, [text_tensor(texts)], request_compression_algorithm="gzip"))
        bad_dtype = httpclient.InferInput("input_ids", [1, 2], "INT32")
        bad_dtype.set_data_from_numpy(np.array([[2, 3]], dtype=np.int32))
        shm_input = httpclient.InferInput("text", [1], "BYTES")
        shm_input.set_shared_memory("in0", 16)
        shm_output = httpclient.InferRequestedOutput("embeddings")
        shm_output.set_shared_memory("out0", 4 * 32 * len(texts))
        out["errors"] = {
            "wrong_datatype": status(lambda: client.infer(model, [bad_dtype])),
            "dimensions_too_many": status(
                lambda: client.infer(model, [text_tensor(texts)], parameters={"dimensions": 33})
            ),
            "dimensions_not_int": status(
                lambda: client.infer(model, [text_tensor(texts)], parameters={"dimensions": True})
            ),
            "shared_memory_input": status(lambda: client.infer(model, [shm_input])),
            "shared_memory_output": status(lambda: client.infer(model, [text_tensor(texts)], outputs=[shm_output])),
            "missing_input": status(lambda: client.infer(model, ids_tensors()[:1])),
            "unknown_model": status(lambda: client.infer("no-such-model", [text_tensor(texts)])),
            "unknown_version": status(lambda: client.infer(model, [text_tensor(texts)], model_version="999")),
            "metadata_unknown_model": status(lambda: client.get_model_metadata("no-such-model")),
        }
        out["infer_after_errors"] = result(client.infer(model, [text_tensor(texts)]))
        out["statistics_after"] = client.get_inference_statistics(model)
    finally:
        client.close()
    return out


def repository(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Triton's model repository extension: spec: url (gRPC), http (HTTP host:port), steps of
    {"op": index|load|unload|index_http|load_http|unload_http, "model": ...}; each step's result or error. A
    load's "timeout" (seconds) is how long its client waits: gRPC's deadline, or the network_timeout of an HTTP
    client of its own (tritonclient's default is 60 s), which then gives up and closes its connection."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    grpc_client = grpcclient.InferenceServerClient(url=spec["url"])
    http_client: Any = None
    if spec.get("http"):
        http_client = httpclient.InferenceServerClient(url=spec["http"], network_timeout=TIMEOUT)
    out: list[dict[str, Any]] = []
    try:
        for step in spec["steps"]:
            op, model = step["op"], step.get("model", "")
            try:
                if op == "index":
                    index = grpc_client.get_model_repository_index(as_json=True, client_timeout=TIMEOUT)
                    out.append({"index": index.get("models", [])})
                elif op == "load":
                    grpc_client.load_model(model, client_timeout=step.get("timeout", TIMEOUT))
                    out.append({})
                elif op == "unload":
                    grpc_client.unload_model(model, client_timeout=TIMEOUT)
                    out.append({})
                elif op == "index_http":
                    out.append({"index": http_client.get_model_repository_index()})
                elif op == "load_http" and "timeout" in step:
                    impatient = httpclient.InferenceServerClient(url=spec["http"], network_timeout=step["timeout"])
                    try:
                        impatient.load_model(model)
                    finally:
                        impatient.close()
                    out.append({})
                elif op == "load_http":
                    http_client.load_model(model)
                    out.append({})
                elif op == "unload_http":
                    http_client.unload_model(model)
                    out.append({})
                else:
                    raise ValueError(f"unknown step {op!r}")
            except InferenceServerException as e:
                out.append({"error": f"{e.status()}: {e.message()}"})
            except TimeoutError as e:  # tritonclient.http's network_timeout
                out.append({"error": f"timeout: {e}"})
    finally:
        grpc_client.close()
        if http_client is not None:
            http_client.close()
    return out


def describe_file(file: Any) -> dict[str, Any]:
    """Every message field (number, type, repeated, message or enum type, presence: `optional`), enum value and
    method of a .proto file."""
    table: dict[str, Any] = {}

    def message(m: Any) -> None:
        table[m.full_name] = {
            f.name: [
                f.number,
                f.type,
                f.is_repeated,
                (f.message_type or f.enum_type).full_name if (f.message_type or f.enum_type) else "",
                f.has_presence,
            ]
            for f in m.fields
        }
        for e in m.enum_types:
            table[e.full_name] = {v.name: v.number for v in e.values}
        for n in m.nested_types:
            message(n)

    for m in file.message_types_by_name.values():
        message(m)
    for e in file.enum_types_by_name.values():
        table[e.full_name] = {v.name: v.number for v in e.values}
    for s in file.services_by_name.values():
        table[s.full_name] = {
            x.name: [x.input_type.full_name, x.output_type.full_name, x.client_streaming, x.server_streaming]
            for x in s.methods
        }
    return table


def describe() -> dict[str, Any]:
    """tritonclient's own copy of the protocol: the reference for wire compatibility."""
    from tritonclient.grpc import model_config_pb2, service_pb2

    return {**describe_file(service_pb2.DESCRIPTOR), **describe_file(model_config_pb2.DESCRIPTOR)}


def main() -> int:
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "run":
        print(json.dumps(run(json.load(sys.stdin))))
    elif command == "run_http":
        print(json.dumps(run_http(json.load(sys.stdin))))
    elif command == "repository":
        print(json.dumps(repository(json.load(sys.stdin))))
    elif command == "describe":
        print(json.dumps(describe()))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
