"""Benchmark: the cost of TLS on the data port, with and without it in one run.

Run ``python bench/bench_tls.py`` (``--quick`` for a short run). Two real daemons
(``python -m server``), identical but for ``--tls-cert-file/--tls-key-file`` on one
(certificates made with the openssl CLI at start, ``tests/security/certs.py``), each hold
a FILLED blocking partition of 4 KiB ``bytes`` records written by a producer task
process over the local socket (``PartitionWriter``). Each round, a fresh consumer task
process reads each partition over loopback TCP with ``PartitionReader`` and checks every
record (``_common.Checker``): the plain daemon, then the TLS one (the reader trusts the
CA through ``$EXCHANGE_TLS_CA_FILE``). Figures: GB/s of record payload, medians of the rounds,
and their ratio (plain / TLS; Flink reports losing about 4x with SSL); and the CPU each
side spends per 32 KiB of payload, with and without TLS (the daemon's threads' from
``/proc`` around the read, in nanoseconds; the consumer process's own), the figure to
trust on a loaded machine.
Beside them, the floor of the ``ssl`` module on this machine (``ssl_floor``): the CPU to
encrypt and to decrypt the same frames with the daemon's and the task's own contexts over
``MemoryBIO`` pairs in this process (what uvloop's SSL transport does per buffer, without
sockets or an event loop), and the protocol and cipher they negotiate. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import shutil
import ssl
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    GB,
    ROOT,
    BenchError,
    Daemon,
    fill_partition,
    json_line,
    median,
    read_partition,
    threads_cpu,
)

RECORD = 4096
SEGMENT = 32 * 1024
CA_ENV = "EXCHANGE_TLS_CA_FILE"


def _certs() -> Any:
    path = ROOT / "tests" / "security" / "certs.py"
    spec = importlib.util.spec_from_file_location("bench_tls_certs", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def ssl_floor(pki: Any, frames: int = 2048) -> dict[str, Any]:
    """CPU microseconds per 32 KiB to encrypt and to decrypt BufferResponse frames (header
    piece + 32 KiB view, 8 per write batch, as the daemon's ``writelines``) with the
    daemon's and the task's contexts over MemoryBIOs (uvloop's SSLProtocol's own calls:
    ``write`` per piece then one ``outgoing.read``; ``incoming.write`` then ``read`` into
    one buffer until ``SSLWantReadError``); medians of 3, and what is negotiated."""
    from client.tls import client_ssl_context
    from exchange.protocol.codec import BUFFER_RESPONSE_HEADER_SIZE
    from server.config import DaemonConfig
    from server.tls import server_ssl_context

    config = DaemonConfig(tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    server_ctx, client_ctx = server_ssl_context(config), client_ssl_context(str(pki.ca))
    assert server_ctx is not None and client_ctx is not None
    s_in, s_out, c_in, c_out = (ssl.MemoryBIO() for _ in range(4))
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    for _ in range(8):  # the handshake, both ends over the BIOs
        for end in (client, server):
            with contextlib.suppress(ssl.SSLWantReadError):
                end.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    header = os.urandom(BUFFER_RESPONSE_HEADER_SIZE)
    payload = memoryview(os.urandom(SEGMENT))
    into = memoryview(bytearray(8 * (SEGMENT + 1024)))
    enc: list[float] = []
    dec: list[float] = []
    clock = time.process_time
    for _ in range(3):
        enc_s = dec_s = 0.0
        for _ in range(frames // 8):  # each batch decrypted before the next: memory reused
            t0 = clock()
            for _ in range(8):
                server.write(header)
                server.write(payload)
            batch = s_out.read()
            t1 = clock()
            c_in.write(batch)
            with contextlib.suppress(ssl.SSLWantReadError):
                while client.read(len(into), into):
                    pass
            t2 = clock()
            enc_s += t1 - t0
            dec_s += t2 - t1
        enc.append(enc_s * 1e6 / frames)
        dec.append(dec_s * 1e6 / frames)
    cipher = client.cipher()
    return {
        "version": client.version(),
        "cipher": cipher[0] if cipher else None,
        "encrypt_us": median(enc),
        "decrypt_us": median(dec),
    }


def read_once(
    daemon: Daemon, dataset: str, count: int, ca: str | None
) -> tuple[float, float, float]:
    """One consumer task process reads the partition over TCP (TLS if ``ca``): GB/s, and
    the daemon's and the consumer's CPU microseconds per 32 KiB of payload."""
    cpu0 = threads_cpu(daemon.pid)
    res = read_partition(daemon, dataset, 1, RECORD, count, env={CA_ENV: ca})
    daemon_cpu = threads_cpu(daemon.pid) - cpu0
    per_32k = 1e6 * SEGMENT / (count * RECORD)
    gbps = float(count * RECORD / (res["t1"] - res["t0"]) / GB)
    return gbps, daemon_cpu * per_32k, float(res["cpu"]) * per_32k


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="64 MB per run, 3 rounds")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    total = 64_000_000 if args.quick else 512_000_000
    count = total // RECORD // 4096 * 4096

    work = Path(tempfile.mkdtemp(prefix="xbench-tls-"))
    pki = _certs().make_pki(work / "pki")
    floor = ssl_floor(pki)  # before the daemons start: this process alone
    tls = ["--tls-cert-file", str(pki.server_cert), "--tls-key-file", str(pki.server_key)]
    runs: dict[str, list[float]] = {"plain": [], "tls": []}
    cpu: dict[str, list[float]] = {f"{k}_{who}": [] for k in runs for who in ("daemon", "consumer")}
    plain_d, tls_d = Daemon(), Daemon(*tls)
    try:
        if tls_d.info.get("tls") is not True:
            raise BenchError(f"the TLS daemon does not report TLS: {tls_d.info}")
        fill_partition(plain_d, "plain", 1, RECORD, count)
        fill_partition(tls_d, "tls", 1, RECORD, count)
        for _ in range(rounds):
            for key, daemon, ca in (("plain", plain_d, None), ("tls", tls_d, str(pki.ca))):
                gbps, daemon_us, consumer_us = read_once(daemon, key, count, ca)
                runs[key].append(gbps)
                cpu[f"{key}_daemon"].append(daemon_us)
                cpu[f"{key}_consumer"].append(consumer_us)
        whole = plain_d.stop() and tls_d.stop()
    finally:
        plain_d.close()
        tls_d.close()
        shutil.rmtree(work, ignore_errors=True)
    if not whole:
        raise BenchError("a daemon's network pool was not whole when it stopped")

    m = {k: median(v) for k, v in runs.items()}
    c = {k: median(v) for k, v in cpu.items()}
    results: dict[str, Any] = {
        "bench": "tls",
        "quick": args.quick,
        "rounds": rounds,
        "payload_bytes_per_run": count * RECORD,
        "record_bytes": RECORD,
        "plain_gbps": m["plain"],
        "tls_gbps": m["tls"],
        "plain_over_tls": m["plain"] / m["tls"],
        "flink_plain_over_ssl": 4.0,
        **{f"{k}_us_per_32k": round(v, 2) for k, v in c.items()},
        "tls_over_plain_cpu": (c["tls_daemon"] + c["tls_consumer"])
        / (c["plain_daemon"] + c["plain_consumer"]),
        "tls_version": floor["version"],
        "tls_cipher": floor["cipher"],
        "ssl_floor_encrypt_us_per_32k": round(floor["encrypt_us"], 2),
        "ssl_floor_decrypt_us_per_32k": round(floor["decrypt_us"], 2),
        "plain_runs": [round(v, 3) for v in runs["plain"]],
        "tls_runs": [round(v, 3) for v in runs["tls"]],
    }
    print(f"data port, loopback, {count * RECORD / 1e6:.0f} MB per run, median of {rounds}")
    print(f"  plain TCP   {m['plain']:6.2f} GB/s   runs {results['plain_runs']}")
    print(f"  TLS         {m['tls']:6.2f} GB/s   runs {results['tls_runs']}")
    print(f"  plain / TLS {results['plain_over_tls']:.2f} (Flink: about 4)")
    print(
        f"  CPU per 32 KiB, daemon / consumer: plain {c['plain_daemon']:.1f} / "
        f"{c['plain_consumer']:.1f} us, TLS {c['tls_daemon']:.1f} / {c['tls_consumer']:.1f} us"
        f" (TLS / plain {results['tls_over_plain_cpu']:.2f})"
    )
    print(
        f"  ssl module floor ({floor['version']}, {floor['cipher']}), per 32 KiB: encrypt "
        f"{floor['encrypt_us']:.1f} us, decrypt {floor['decrypt_us']:.1f} us"
    )
    print(json_line(results))


if __name__ == "__main__":
    main()
