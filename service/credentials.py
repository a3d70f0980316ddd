"""What a server knows its callers by and shows them: the API and admin keys (their digests) and the TLS
material, read once, at start-up.

A server reads them as it starts (server.read_credentials); the supervisor of `--processes N` reads them
before it starts any process, and hands what it read to every process it starts, then and again later. A
process started again read the files anew: with the keys file rotated meanwhile (for a restart later), the
old key and the new each worked on about half the connections behind one port, a renewed certificate was
presented beside the old one, and a keys file empty or half written then failed its start again and again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhaserve.service.auth import Keys
from mhaserve.service.tls import TlsMaterial


@dataclass(frozen=True)
class Credentials:
    """The keys, and the TLS material (None: plaintext). Plain values: the supervisor pickles them for each
    process it starts."""

    keys: Keys
    tls: TlsMaterial | None
