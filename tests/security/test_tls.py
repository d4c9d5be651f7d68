"""TLS on the data port with real daemons and certificates made by openssl at test time.

* a reader that trusts the daemon's CA reads the same records as over plain TCP, with the
  shared secret checked inside the TLS connection (a wrong secret is still refused);
* a reader without TLS, or trusting another CA, is refused with a TransportError in
  bounded time and leaves nothing behind on the daemon;
* with ``--tls-client-auth`` only readers presenting a certificate of the daemon's CA get
  in; none, or one of a rogue CA, is refused;
* bad TLS settings stop the daemon with exit code 2 and a message naming the setting;
* a task's context and the daemon's negotiate TLS 1.3 with AES-GCM (what
  ``bench/bench_tls.py`` measures, docs/security.md).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from client.tls import TLS_CA_FILE_ENV, TLS_CERT_FILE_ENV, TLS_KEY_FILE_ENV, client_ssl_context
from exchange.addresses import parse_address
from exchange.errors import AuthenticationError, ExchangeError, TransportError
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

Daemon = Any
FAIL_WITHIN = 15.0
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}


def tls_flags(pki: Any, *extra: str) -> list[str]:
    return ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key), *extra]


def write(d: Daemon, pid: ResultPartitionID, n: int, secret: bytes | None = None) -> list[Any]:
    recs = [(i, b"r" * 64) for i in range(n)]
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, secret=secret, buffer_timeout=-1
    ) as w:
        w.emit_all(recs, partition_func=lambda k: 0)
    return recs


def read(d: Daemon, pid: ResultPartitionID, secret: bytes | None = None) -> list[Any]:
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, None)  # TCP, never the socket
    with PartitionReader([loc], secret=secret, **FAST) as reader:
        return list(reader)


def refused(d: Daemon, pid: ResultPartitionID, secret: bytes | None = None) -> ExchangeError:
    t0 = time.monotonic()
    with pytest.raises(ExchangeError) as info:
        read(d, pid, secret)
    assert time.monotonic() - t0 < FAIL_WITHIN
    d.wait_stats(lambda s: s["data_port"]["connections"] == 0 and s["data_port"]["readers"] == 0)
    return info.value


def trust(monkeypatch: pytest.MonkeyPatch, ca: Path | None, cert: Path | None = None,
          key: Path | None = None) -> None:  # fmt: skip
    for var, value in ((TLS_CA_FILE_ENV, ca), (TLS_CERT_FILE_ENV, cert), (TLS_KEY_FILE_ENV, key)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))


def present(monkeypatch: pytest.MonkeyPatch, pki: Any, client: str) -> None:
    """Trust the daemons' CA and present ``client``'s certificate: none, one of a rogue
    CA, or one the daemon's CA signed."""
    if client == "none":
        trust(monkeypatch, pki.ca)
    elif client == "rogue":
        trust(monkeypatch, pki.ca, pki.rogue_client_cert, pki.rogue_client_key)
    else:
        trust(monkeypatch, pki.ca, pki.client_cert, pki.client_key)


@pytest.fixture
def secret_file(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_bytes(b"s3cret-of-this-application\n")
    os.chmod(path, 0o600)
    return path


def test_tls_with_shared_secret(
    start_daemon: Callable[..., Daemon],
    pki: Any,
    secret_file: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    d = start_daemon(*tls_flags(pki), "--secret-file", str(secret_file))
    assert d.info["tls"] is True
    secret = b"s3cret-of-this-application"
    pid = ResultPartitionID("tls", 0, 0)
    recs = write(d, pid, 20_000, secret)
    trust(monkeypatch, pki.ca)
    assert read(d, pid, secret) == recs
    assert read(d, pid, secret) == recs  # a blocking partition, read twice
    # TLS does not replace the secret: a wrong one is refused inside the TLS connection
    assert isinstance(refused(d, pid, b"wrong"), AuthenticationError)
    assert isinstance(refused(d, pid, None), AuthenticationError)


def test_task_and_daemon_negotiate_tls13_with_aes_gcm(
    start_daemon: Callable[..., Daemon], pki: Any
) -> None:
    # AES-GCM runs on AES-NI here (ChaCha20-Poly1305 costs ~10 % more per 32 KiB);
    # a context capped at TLS 1.2 or preferring ChaCha20 would change what TLS costs
    d = start_daemon(*tls_flags(pki))
    host, port = parse_address(d.data_address)
    ctx = client_ssl_context(str(pki.ca))
    assert ctx is not None
    with (
        socket.create_connection((host, port), timeout=FAIL_WITHIN) as raw,
        ctx.wrap_socket(raw, server_hostname=host) as tls,
    ):
        assert tls.version() == "TLSv1.3"
        cipher = tls.cipher()
        assert cipher is not None and cipher[0] in {
            "TLS_AES_256_GCM_SHA384",
            "TLS_AES_128_GCM_SHA256",
        }
    # it never sent the shared-secret handshake: dropped, nothing left
    d.wait_stats(lambda s: s["data_port"]["connections"] == 0)


@pytest.mark.parametrize("client_ca", ["none", "rogue"])
def test_untrusted_or_plain_client_refused(
    start_daemon: Callable[..., Daemon], pki: Any, monkeypatch: pytest.MonkeyPatch, client_ca: str
) -> None:
    d = start_daemon(*tls_flags(pki))
    pid = ResultPartitionID("tls-refused", 0, 0)
    write(d, pid, 100)
    trust(monkeypatch, None if client_ca == "none" else pki.rogue_ca)
    err = refused(d, pid)
    assert isinstance(err, TransportError), repr(err)
    if client_ca == "rogue":
        assert "CERTIFICATE_VERIFY_FAILED" in str(err)
    trust(monkeypatch, pki.ca)
    assert len(read(d, pid)) == 100  # the daemon serves trusting clients unharmed


@pytest.mark.parametrize("client", ["none", "rogue", "trusted"])
def test_mutual_tls(
    start_daemon: Callable[..., Daemon], pki: Any, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    d = start_daemon(*tls_flags(pki, "--tls-ca-file", str(pki.ca), "--tls-client-auth"))
    pid = ResultPartitionID("mtls", 0, 0)
    recs = write(d, pid, 1000)
    present(monkeypatch, pki, client)
    if client == "trusted":
        assert read(d, pid) == recs
    else:
        assert isinstance(refused(d, pid), TransportError)


@pytest.mark.parametrize("client", ["none", "rogue", "trusted"])
def test_ca_without_client_auth_checks_presented_certificates(
    start_daemon: Callable[..., Daemon], pki: Any, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    # tls_ca_file alone accepted every client silently, a rogue certificate included
    d = start_daemon(*tls_flags(pki, "--tls-ca-file", str(pki.ca)))
    deadline = time.monotonic() + 30  # the warning, logged at start
    while "clients without one are accepted" not in d.stderr:
        assert time.monotonic() < deadline, d.stderr
        time.sleep(0.05)
    pid = ResultPartitionID("ca-only", 0, 0)
    recs = write(d, pid, 200)
    present(monkeypatch, pki, client)
    if client == "rogue":
        assert isinstance(refused(d, pid), TransportError)
    else:
        assert read(d, pid) == recs


def test_bad_tls_settings_refused(
    run_daemon_cli: Callable[..., Any], pki: Any, tmp_path: Path
) -> None:
    base = ["--data-port", "0", "--http-port", "0", "--spill-dir", str(tmp_path / "s")]
    loose_key = tmp_path / "loose.key"
    loose_key.write_bytes(pki.server_key.read_bytes())
    os.chmod(loose_key, 0o644)
    cases = [
        (["--tls-cert-file", str(pki.server_cert)], "tls_key_file"),
        (["--tls-key-file", str(pki.server_key)], "tls_cert_file"),
        ([*tls_flags(pki), "--tls-client-auth"], "tls_client_auth"),
        (["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(loose_key)], "chmod 600"),
        (["--tls-cert-file", str(pki.ca), "--tls-key-file", str(pki.server_key)], "tls_cert_file"),
        ([*tls_flags(pki), "--tls-ca-file", str(tmp_path / "nope.pem")], "tls_ca_file"),
    ]
    for flags, words in cases:
        result = run_daemon_cli([*base, *flags])
        assert result.returncode == 2, (flags, result.stderr)
        assert words in result.stderr, (flags, result.stderr)
        assert "Traceback" not in result.stderr
