"""TLS on the daemon's data port (Python ``ssl``): the server context from the config.

The daemon presents ``tls_cert_file`` / ``tls_key_file``; with ``tls_ca_file`` and
``tls_client_auth`` it requires every peer to present a certificate signed by that CA
(mutual TLS). ``tls_ca_file`` alone checks the certificates clients present and lets in
clients that present none (logged as a warning at start). The shared-secret handshake
still runs inside the TLS connection, so a peer needs both the certificate (when required)
and the secret. The local Unix socket stays
plain: it is protected by file permissions on this host.
"""

from __future__ import annotations

import logging
import os
import ssl

from exchange.errors import ConfigError
from server.config import DaemonConfig, check_private_file

__all__ = ["server_ssl_context"]

log = logging.getLogger("exchange.server.tls")


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
    check_private_file("tls_key_file", str(key), mode)
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
    elif config.tls_ca_file is not None:
        # A certificate a client presents must chain to the CA; one without any is let in.
        ctx.verify_mode = ssl.CERT_OPTIONAL
        log.warning(
            "tls_ca_file is set without tls_client_auth: clients that present a certificate "
            "must chain to %s, clients without one are accepted; set --tls-client-auth to "
            "require one",
            config.tls_ca_file,
        )
    return ctx
