"""TLS for the client side of the data port (Python ``ssl``).

A task connects with TLS when a CA file is named, explicitly or by
``$EXCHANGE_TLS_CA_FILE`` (the executors' environment, as ``$EXCHANGE_SECRET_FILE``
names the shared secret); with ``$EXCHANGE_TLS_CERT_FILE`` / ``$EXCHANGE_TLS_KEY_FILE``
it presents a client certificate (mutual TLS). The server's certificate must chain to the
CA and name the host the task dials. TLS comes in addition to the shared-secret
handshake, which still runs inside the encrypted connection. Unix sockets never use TLS.
"""

from __future__ import annotations

import functools
import os
import ssl
from typing import Any, Final

from exchange.errors import ConfigError

__all__ = [
    "TLS_CA_FILE_ENV",
    "TLS_CERT_FILE_ENV",
    "TLS_KEY_FILE_ENV",
    "client_ssl_context",
    "connect_kwargs",
]

TLS_CA_FILE_ENV: Final = "EXCHANGE_TLS_CA_FILE"
TLS_CERT_FILE_ENV: Final = "EXCHANGE_TLS_CERT_FILE"
TLS_KEY_FILE_ENV: Final = "EXCHANGE_TLS_KEY_FILE"


def client_ssl_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext | None:
    """The client context for these files (each defaulting to its environment variable);
    None when no CA file is named (plain TCP). ConfigError for unusable files."""
    ca = ca_file or os.environ.get(TLS_CA_FILE_ENV) or None
    cert = cert_file or os.environ.get(TLS_CERT_FILE_ENV) or None
    key = key_file or os.environ.get(TLS_KEY_FILE_ENV) or None
    if ca is None:
        if cert is not None:
            raise ConfigError(
                "tls_ca_file", "a client certificate needs a CA file to check the daemon"
            )
        return None
    return _context(ca, cert, key)


@functools.lru_cache(maxsize=8)
def _context(ca: str, cert: str | None, key: str | None) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError("tls_ca_file", f"cannot load CA file {ca!r}: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert is not None:
        try:
            ctx.load_cert_chain(cert, key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                "tls_cert_file", f"cannot load client certificate {cert!r} / key {key!r}: {e}"
            ) from None
    elif key is not None:
        raise ConfigError("tls_key_file", "a client key without a client certificate")
    return ctx


def connect_kwargs(host: str, context: ssl.SSLContext | None) -> dict[str, Any]:
    """Keyword arguments for ``loop.create_connection`` to ``host``: TLS with ``context``
    (checking that the certificate names ``host``), or nothing for plain TCP."""
    if context is None:
        return {}
    return {"ssl": context, "server_hostname": host}
