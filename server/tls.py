"""TLS on the daemon's data port (Python ``ssl``): the server context from the config.

The daemon presents ``tls_cert_file`` / ``tls_key_file``; with ``tls_ca_file`` and
``tls_client_auth`` it requires every peer to present a certificate signed by that CA
(mutual TLS). The shared-secret handshake still runs inside the TLS connection, so a peer
needs both the certificate (when required) and the secret. The local Unix socket stays
plain: it is protected by file permissions on this host.
"""

from __future__ import annotations

import os
import ssl
import stat

from exchange.errors import ConfigError
from server.config import DaemonConfig

__all__ = ["server_ssl_context"]


def server_ssl_context(config: DaemonConfig) -> ssl.SSLContext | None:
    """The data port's context; None when TLS is not configured. ConfigError naming the
    setting when a file cannot be loaded."""
    if config.tls_cert_file is None:
        return None
    key = config.tls_key_file
    try:
        mode = os.stat(key).st_mode if key is not None else 0
    except OSError as e:
        raise ConfigError("tls_key_file", f"{key!r} cannot be read: {e}") from None
    if mode & (stat.S_IROTH | stat.S_IWOTH):
        raise ConfigError(
            "tls_key_file",
            f"{key!r} is accessible by other users (mode {stat.filemode(mode)}); "
            "restrict it with chmod 600",
        )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert_file, config.tls_key_file)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            "tls_cert_file",
            f"cannot load certificate {config.tls_cert_file!r} with key "
            f"{config.tls_key_file!r}: {e}",
        ) from None
    if config.tls_ca_file is not None:
        try:
            ctx.load_verify_locations(cafile=config.tls_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                "tls_ca_file", f"cannot load CA file {config.tls_ca_file!r}: {e}"
            ) from None
    if config.tls_client_auth:
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
