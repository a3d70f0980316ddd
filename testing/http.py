"""A plain HTTP client for the tests and tools: http.client, nothing between the test and the bytes it sends."""

from __future__ import annotations

import http.client
import json
import ssl
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from mhaserve.testing.loopback import WAIT


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    method: str,
    url: str,
    body: bytes | str | dict[str, Any] | list[Any] | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = WAIT,
    context: ssl.SSLContext | None = None,
) -> Reply:
    """One request on a fresh connection; a dict or list body is sent as JSON (with its content type).
    An https URL is spoken with `context` (TLS, and a client certificate if it holds one)."""
    parts = urlsplit(url)
    headers = dict(headers or {})
    if isinstance(body, dict | list):
        body = json.dumps(body)
        headers.setdefault("content-type", "application/json")
    host = parts.hostname or "127.0.0.1"
    conn: http.client.HTTPConnection
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=context)
    else:
        conn = http.client.HTTPConnection(host, parts.port, timeout=timeout)
    try:
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        conn.request(method, path or "/", body=body, headers=headers)
        response = conn.getresponse()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, response.read())
    finally:
        conn.close()
