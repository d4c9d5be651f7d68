"""Test certificates made with the ``openssl`` command line at test time.

``make_pki(directory)`` writes a CA, a server certificate for 127.0.0.1 / localhost, a
client certificate signed by the CA, and a rogue CA with a client certificate of its own
(each key chmod 600), and returns their paths. Used by the TLS tests and bench_tls.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_client_cert: Path
    rogue_client_key: Path


def openssl_available() -> bool:
    return shutil.which("openssl") is not None


def _run(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _key(path: Path) -> Path:
    _run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", path)
    os.chmod(path, 0o600)
    return path


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key = _key(d / f"{name}.key")
    cert = d / f"{name}.pem"
    _run("req", "-x509", "-new", "-key", key, "-days", "2", "-subj", f"/CN={name}", "-out", cert)
    return cert, key


def _signed(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key = _key(d / f"{name}.key")
    csr, cert, extfile = d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(ext)
    _run("req", "-new", "-key", key, "-subj", f"/CN={name}", "-out", csr)
    _run(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial",
        "-days", "2", "-extfile", extfile, "-out", cert,
    )  # fmt: skip
    return cert, key


def make_pki(d: Path) -> Pki:
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "exchange-test-ca")
    server = _signed(
        d,
        "daemon",
        ca,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    client = _signed(d, "task", ca, "extendedKeyUsage=clientAuth\n")
    rogue = _ca(d, "rogue-ca")
    rogue_client = _signed(d, "rogue-task", rogue, "extendedKeyUsage=clientAuth\n")
    return Pki(ca[0], *server, *client, rogue[0], *rogue_client)
