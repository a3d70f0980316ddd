"""What text-embeddings-inference's `Info` says of a served model, for both of its APIs here: tei.v1's gRPC
`Info` (service/tei_v1.py) and the top of HTTP's `GET /info` (service/utility.py), which a TEI client reads."""

from __future__ import annotations

from typing import Any

from mhaserve.service.pipeline import TOKENIZE_THREADS, Pipeline

DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}


def tei_info(pipeline: Pipeline) -> dict[str, Any]:
    """TEI's fields of its Info but the server's own (its version, git sha, image label), by TEI's names."""
    entry, limits = pipeline.model.entry, pipeline.limits
    return {
        "model_id": entry.manifest.source,
        "model_sha": entry.sha256,
        "model_dtype": DTYPES.get(entry.manifest.graph(entry.graph).precision, "float32"),
        "served_model_name": pipeline.model.name,
        "model_type": {"embedding": {"pooling": entry.pooling}},
        "max_concurrent_requests": limits.max_queue_size,
        "max_input_length": entry.max_tokens,
        "max_batch_tokens": limits.max_batch_tokens,
        "max_batch_requests": None,  # TEI's: none unless set; batches here are bounded by tokens
        "max_client_batch_size": limits.max_client_batch_size,
        "auto_truncate": pipeline.auto_truncate,
        # TEI's tokenisers, one a thread; here the threads beside the event loop (which tokenises short requests)
        "tokenization_workers": TOKENIZE_THREADS,
    }
