"""Isolation between applications, with real daemons that hold a secret.

A partition belongs to the application whose producer created it. A client authenticates
for one application, with the daemon's secret and the application's id (it derives the
application's credential) or with only that application's credential
(``format_app_credential``); it can then read, write and release that application's
partitions and no other's. Partition ids are per application: another application's
partition, live or gone, is answered exactly as one that never existed
(``PartitionNotFoundError``, per channel: the connection and its other streams live on),
the same id written by another application is that application's own partition, and a
release leaves another application's alone. Over the data port and over the local socket
alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    AuthenticationError,
    ExchangeError,
    PartitionNotFoundError,
    ProducerFailedError,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.handshake import format_app_credential

pytestmark = pytest.mark.timeout(120)

Daemon = Any
SECRET = b"the-daemons-secret"
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
RECORDS = [(i, b"r" * 64) for i in range(500)]


@pytest.fixture
def daemon(start_daemon: Any, secret_file: str) -> Daemon:
    return start_daemon("--secret-file", secret_file)


def write(d: Daemon, pid: ResultPartitionID, secret: bytes, records: list[Any] = RECORDS) -> None:
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, secret=secret, buffer_timeout=-1
    ) as w:
        w.emit_all(records, partition_func=lambda k: 0)


def not_found(d: Daemon, pid: ResultPartitionID, secret: bytes, local: bool) -> str:
    """The text of the PartitionNotFoundError a read of ``pid`` fails with."""
    with pytest.raises(PartitionNotFoundError) as info:
        read(d, pid, secret, local)
    assert info.value.partition_id == pid
    return str(info.value).replace(repr(pid), "<pid>").replace(str(pid), "<pid>")


def read(d: Daemon, pid: ResultPartitionID, secret: bytes, local: bool) -> list[Any]:
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket if local else None)
    with PartitionReader([loc], secret=secret, **FAST) as reader:
        return list(reader)


def idle(d: Daemon) -> None:
    d.wait_stats(lambda s: s["data_port"]["connections"] == 0 and s["data_port"]["readers"] == 0)


@pytest.mark.parametrize("local", [False, True], ids=["data-port", "local-socket"])
def test_an_application_reads_its_partitions_and_not_anothers(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch, local: bool
) -> None:
    pid = ResultPartitionID("app-a-shuffle", 0, 0)
    monkeypatch.setenv("EXCHANGE_APP_ID", "app-a")
    write(daemon, pid, SECRET)  # the daemon's secret: derives app-a's credential
    assert read(daemon, pid, SECRET, local) == RECORDS
    # only app-a's credential, which names its application itself
    monkeypatch.delenv("EXCHANGE_APP_ID")
    assert read(daemon, pid, format_app_credential(SECRET, "app-a"), local) == RECORDS

    # another application, and none, are answered as for an id that never existed
    never = ResultPartitionID("never-written", 0, 0)
    for who in ({"EXCHANGE_APP_ID": "app-b"}, {}):
        monkeypatch.delenv("EXCHANGE_APP_ID", raising=False)
        for k, v in who.items():
            monkeypatch.setenv(k, v)
        assert not_found(daemon, pid, SECRET, local) == not_found(daemon, never, SECRET, local)
    cred_b = format_app_credential(SECRET, "app-b")
    assert not_found(daemon, pid, cred_b, local) == not_found(daemon, never, cred_b, local)
    idle(daemon)
    monkeypatch.setenv("EXCHANGE_APP_ID", "app-a")
    assert read(daemon, pid, SECRET, local) == RECORDS  # refusals changed nothing
    assert (
        get_runtime().run(release_dataset(daemon.local_socket, pid.dataset_id, secret=SECRET)) == 1
    )


def test_ids_are_per_application_another_cannot_take_one_first(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    # app-b writes app-a's id first: it makes its own partition, app-a still makes its own
    pid = ResultPartitionID("app-a-out", 0, 0)
    cred_a = format_app_credential(SECRET, "app-a")
    cred_b = format_app_credential(SECRET, "app-b")
    records_b = [(i, b"b") for i in range(10)]
    write(daemon, pid, cred_b, records_b)
    write(daemon, pid, cred_a)
    with pytest.raises(ExchangeError, match="already registered"):
        write(daemon, pid, cred_a)  # its own id twice: refused, as before
    assert read(daemon, pid, cred_a, local=False) == RECORDS
    assert read(daemon, pid, cred_b, local=True) == records_b
    # a release by app-b or by no application releases (and counts) only its own
    run = get_runtime().run
    assert run(release_dataset(daemon.local_socket, pid.dataset_id, secret=cred_b)) == 1
    assert run(release_dataset(daemon.local_socket, pid.dataset_id, secret=SECRET)) == 0
    daemon.wait_stats(lambda s: s["partitions"]["count"] == 1)
    assert read(daemon, pid, cred_a, local=False) == RECORDS
    assert run(release_dataset(daemon.local_socket, pid.dataset_id, secret=cred_a)) == 1
    daemon.wait_stats(lambda s: s["partitions"]["count"] == 0)


@pytest.mark.parametrize("local", [False, True], ids=["data-port", "local-socket"])
def test_a_gone_partition_is_not_found_for_another_application(daemon: Daemon, local: bool) -> None:
    # a failed partition's reason (here, user data) reached another application
    pid = ResultPartitionID("app-a-failed", 0, 0)
    cred_a = format_app_credential(SECRET, "app-a")
    cred_b = format_app_credential(SECRET, "app-b")
    writer = PartitionWriter(pid, 1, daemon_socket=daemon.local_socket, secret=cred_a)
    with pytest.raises(RuntimeError), writer as w:
        w.emit_to((1, "x"), 0)
        raise RuntimeError("card 4111-1111-1111-1111 declined")
    daemon.wait_stats(lambda s: s["partitions"]["count"] == 0)
    with pytest.raises(ProducerFailedError, match="4111"):
        read(daemon, pid, cred_a, local)  # its own application learns why
    never = ResultPartitionID("never-written", 0, 0)
    text = not_found(daemon, pid, cred_b, local)
    assert "4111" not in text and text == not_found(daemon, never, cred_b, local)
    idle(daemon)


def test_a_forged_or_mismatched_credential_is_refused(daemon: Daemon) -> None:
    pid = ResultPartitionID("app-a-forged", 0, 0)
    write(daemon, pid, format_app_credential(SECRET, "app-a"))
    forged = format_app_credential(b"not-the-daemons-secret", "app-a")
    with pytest.raises(AuthenticationError):
        read(daemon, pid, forged, local=False)
    # a credential is bound to its application: relabelled, it no longer authenticates
    key_hex = format_app_credential(SECRET, "app-a").rsplit(b":", 1)[1]
    with pytest.raises(AuthenticationError):
        read(daemon, pid, b"exchange-app-v1:app-b:" + key_hex, local=False)
    idle(daemon)
    with pytest.raises(ExchangeError):
        get_runtime().run(release_dataset(daemon.local_socket, pid.dataset_id, secret=forged))
    assert daemon.stats()["partitions"]["count"] == 1


def test_a_restarted_daemon_keeps_each_partitions_application(tmp_path: Path) -> None:
    """The owner is in the partition's manifest: a blocking partition served again after
    a restart is still its application's only."""
    helpers: Any = __import__("exchange_tests_daemon_helpers")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    spill = tmp_path / "spill"
    spill.mkdir()
    pid = ResultPartitionID("app-a-kept", 0, 0)
    cred_a = format_app_credential(SECRET, "app-a")
    d1 = helpers.DaemonProcess("--secret-file", str(secret), spill_dir=str(spill))
    d2 = None
    try:
        write(d1, pid, cred_a)
        d1.kill()  # not even a clean stop
        d2 = helpers.DaemonProcess("--secret-file", str(secret), spill_dir=str(spill))
        assert read(d2, pid, cred_a, local=False) == RECORDS
        with pytest.raises(PartitionNotFoundError):
            read(d2, pid, format_app_credential(SECRET, "app-b"), local=False)
        with pytest.raises(PartitionNotFoundError):
            read(d2, pid, SECRET, local=False)  # no application
        idle(d2)
        assert (
            get_runtime().run(release_dataset(d2.local_socket, pid.dataset_id, secret=cred_a)) == 1
        )
        d2.stop_clean()
    finally:
        for d in (d1, d2):
            if d is not None:
                d.cleanup()
