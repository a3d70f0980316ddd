"""The server's name and version, as every API reports them (KServe's ServerMetadata, /info, the OpenAPI
document, `mhaserve --version`): one place, which no protocol adapter owns."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

SERVER_NAME = "mhaserve"


@cache
def server_version() -> str:
    """The installed distribution's version ("unknown" when run from a checkout that was not installed)."""
    try:
        return package_version("mhaserve")
    except PackageNotFoundError:
        return "unknown"
