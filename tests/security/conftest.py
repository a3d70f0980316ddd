"""Test certificates, made at test time with the openssl command: a CA, a server certificate for
127.0.0.1 and localhost, a client certificate it signed, and a second CA with a client of its own (a
stranger mutual TLS must refuse)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

OPENSSL = shutil.which("openssl")
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path
    stranger_cert: Path  # a client certificate signed by other_ca
    stranger_key: Path


def _openssl(*args: str | Path, cwd: Path) -> None:
    assert OPENSSL is not None
    subprocess.run([OPENSSL, *map(str, args)], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    _openssl(
        "req", "-x509", *KEY, "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
        "-subj", f"/CN=mhaserve test {name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"


def _leaf(d: Path, name: str, ca: str, extensions: str) -> tuple[Path, Path]:
    (d / f"{name}.ext").write_text(extensions)
    _openssl("req", *KEY, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=d,
    )  # fmt: skip
    return d / f"{name}.pem", d / f"{name}.key"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if OPENSSL is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    ca, _ = _ca(d, "ca")
    other_ca, _ = _ca(d, "other-ca")
    server = _leaf(
        d,
        "server",
        "ca",
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    client_ext = "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n"
    client = _leaf(d, "client", "ca", client_ext)
    stranger = _leaf(d, "stranger", "other-ca", client_ext)
    return Pki(ca, *server, *client, other_ca, *stranger)
