"""API keys: `authorization: Bearer <key>`, whatever the protocol (gRPC metadata or an HTTP header).

Keys come from `--api-keys-file` (one per line) and `MHASERVE_API_KEYS` (comma-separated). Only their
sha256 digests are kept; a presented key is hashed and compared with `hmac.compare_digest` against
every digest, without stopping at a match, so neither the time taken nor the log says which key, or
how much of one, was right. Keys never reach a log line or an error message. Methods listed in
`--open-methods` (health checks and reflection by default) need no key. The gRPC interceptor that
applies this is rpc/auth.py.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Sequence
from pathlib import Path

from mhaserve.runtime.errors import PermissionDenied, ServiceError, Unauthenticated
from mhaserve.service.context import Throttle

AUTHORIZATION = "authorization"
SCHEME = "bearer"
# Characters gRPC metadata values may hold; a key outside them could never be sent.
_PRINTABLE_ASCII = frozenset(chr(c) for c in range(0x21, 0x7F))
_TRAILING_COMMENT = re.compile(r"\s#")

# Callable without an API key: orchestrators' health probes, and reflection (it lists methods, answers none).
OPEN_METHODS = (
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.health.v1.Health/List",  # every service's status at once: what Check answers one by one
    # the Open Inference Protocol's server probes, open as its REST /v2/health/live and /ready are
    "/inference.GRPCInferenceService/ServerLive",
    "/inference.GRPCInferenceService/ServerReady",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
)
# Each port logs a call refused for want of a valid key at INFO with its request id, to be found by the client's; a
# client with a wrong key in a loop wrote 9,000 such lines a second. At most this many a second in each process, then
# one saying how many were left out; mhaserve_requests_total counts every one. A valid client key on the repository
# API ("denied ...", PERMISSION_DENIED) is a line each: a key holder probing the admin API is what to see.
REFUSAL_LINES_A_SECOND = 10
MESSAGE = "missing or invalid API key: send 'authorization: Bearer <key>'"
ADMIN_MESSAGE = "the repository API (index, load, unload) needs an admin key (--admin-keys-file, MHASERVE_ADMIN_KEYS)"


class AuthError(ValueError):
    """The API keys cannot be read or are malformed; the message names the file and line, never the key."""


KEY_RULE = "an API key must be printable ASCII without spaces (gRPC metadata carries it)"


def is_valid_key(key: str) -> bool:
    return set(key) <= _PRINTABLE_ASCII


def _check_key(key: str, where: str) -> str:
    if not is_valid_key(key):
        raise AuthError(f"{where}: {KEY_RULE}")
    return key


def read_keys_file(path: Path, flag: str = "--api-keys-file") -> list[str]:
    """The keys of a file: one per line, surrounding blanks stripped, blank lines and whole-line `#` comments
    skipped; `flag` names the option that gave it in the errors."""
    try:
        # utf-8-sig: a byte-order mark (a Windows editor's "UTF-8 with BOM") was read as the first key's
        text = path.read_text(encoding="utf-8-sig")
    except OSError as e:
        raise AuthError(f"cannot read {flag} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise AuthError(f"{flag} {path} is not UTF-8 text") from None
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        # A key may hold a '#' (it is printable ASCII), so only a line's own comment is one; `key  # why` was
        # refused as a key with spaces, which sent the user looking for a space in the key.
        if _TRAILING_COMMENT.search(line):
            raise AuthError(
                f"{path} line {number}: a '#' comment must be on a line of its own, not after a key (a key holds no "
                "spaces)"
            )
        keys.append(_check_key(line, f"{path} line {number}"))
    if not keys:
        raise AuthError(f"{flag} {path} holds no key (one per line; a line that starts with '#' is a comment)")
    return keys


def load_keys(
    keys_file: Path | None,
    env_keys: Sequence[str] = (),
    env: str = "MHASERVE_API_KEYS",
    flag: str = "--api-keys-file",
) -> list[str]:
    """Every configured key, the file's first; empty when authentication is off."""
    keys = read_keys_file(keys_file, flag) if keys_file is not None else []
    keys += [_check_key(k, env) for k in env_keys]
    return keys


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


class KeyRing:
    """The digests of the accepted keys."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k) for k in keys]

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"KeyRing(<{len(self._digests)} keys>)"

    def accepts(self, presented: str | bytes) -> bool:
        """Constant time in the key presented and in which key matched: every digest is compared."""
        digest = _digest(presented)
        match = False
        for d in self._digests:
            match |= hmac.compare_digest(digest, d)
        return match


def bearer(metadata: Sequence[tuple[str, str | bytes]] | None) -> tuple[str | bytes | None, str]:
    """The token of `authorization: Bearer <token>`, or None and why not (for the log; never the token)."""
    values = [v for k, v in metadata or () if k == AUTHORIZATION]
    if not values:
        return None, "no authorization header"
    if len(values) > 1:
        return None, "more than one authorization header"
    value = values[0]
    text = value.decode("latin-1") if isinstance(value, bytes) else value
    scheme, _, token = text.strip().partition(" ")
    if scheme.lower() != SCHEME or not token.strip():
        return None, "authorization is not 'Bearer <key>'"
    return token.strip(), "unknown key"


def is_open(method: str, open_methods: Sequence[str]) -> bool:
    """Whether `method` is listed, exactly or by its service's `/pkg.Service/*`."""
    return any(m == method or (m.endswith("/*") and method.startswith(m[:-1])) for m in open_methods)


class Keys:
    """Who may call what: the API keys (every model call) and the admin keys (the repository API too).

    With no key of either kind configured, authentication is off. Otherwise a call needs a valid key,
    and a repository call (loading and unloading models) needs an admin key: a client key gets
    PERMISSION_DENIED there, which tells its holder the key is right but not enough.
    """

    def __init__(self, client: KeyRing, admin: KeyRing | None = None) -> None:
        self.client = client
        self.admin = admin or KeyRing(())

    @property
    def enabled(self) -> bool:
        return bool(len(self.client) or len(self.admin))

    def refusal(self, token: str | bytes | None, *, admin: bool) -> ServiceError | None:
        """Why a call presenting `token` may not go on, or None."""
        if not self.enabled:
            return None
        # Both rings are always compared, so the time taken does not say which kind of key was sent.
        is_client = token is not None and self.client.accepts(token)
        is_admin = token is not None and self.admin.accepts(token)
        if is_admin or (is_client and not admin):
            return None
        if is_client:
            return PermissionDenied(ADMIN_MESSAGE)
        return Unauthenticated(MESSAGE)


def refusal_lines() -> Throttle:
    """The filter of a port's logger for its lines of calls without a valid key ("refused ..."):
    REFUSAL_LINES_A_SECOND."""
    return Throttle(("refused ",), interval=1.0, burst=REFUSAL_LINES_A_SECOND)
