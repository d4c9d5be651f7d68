"""Connection handshake: version check and optional mutual shared-secret authentication.

Sans I/O: ``start``/``receive`` return the messages to send. A failure sets the state to
``FAILED``, stores the fatal ``ErrorResponse`` the caller should send (best effort) before
closing in ``error_response``, and raises::

    client                                   server
      ClientHello(version, client_nonce)  ->
                                          <-  ServerHello(version, auth_required, server_nonce)
      AuthResponse(mac, app_id)           ->                          (only if auth_required)
                                          <-  AuthOk(server_proof) | ErrorResponse(AUTH_FAILED)

    key          = secret                                              if app_id == ""
                 = HMAC-SHA256(secret, b"exchange-app-v1|" + app_id)   otherwise
    mac          = HMAC-SHA256(key, b"exchange-auth-v1|c" + server_nonce + client_nonce)
    server_proof = HMAC-SHA256(key, b"exchange-auth-v1|s" + client_nonce + server_nonce)

The per-application credential (``app_credential``) lets a client authenticate for one
application without holding the daemon's secret: the daemon derives the key from its
secret and the ``app_id`` the client names, so a credential works for its application only
and the connection is then confined to that application's partitions. A client holding the
daemon's secret derives the credential of the application it names. A credential is
handed to a task as text (``format_app_credential``: ``exchange-app-v1:<app_id>:<hex>``),
which a client passes wherever it would pass the secret.

Fresh nonces on both sides make every MAC valid for one connection only (no replay), and
the distinct labels keep a server's proof from being reflected as a client's MAC. A server
without a secret accepts every client without a secret. A client *with* a secret refuses a
server that does not ask for authentication (``auth_required=False``) with an
``AuthenticationError``: anyone could pose as such a daemon (no downgrade).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from enum import Enum
from typing import Final

from exchange.errors import (
    AuthenticationError,
    IllegalStateError,
    ProtocolError,
    UsageError,
    VersionMismatchError,
)
from exchange.protocol.messages import (
    NONCE_SIZE,
    PROTOCOL_VERSION,
    AuthOk,
    AuthResponse,
    ClientHello,
    ErrorResponse,
    Message,
    ServerHello,
    check_app_id,
    error_for_response,
    error_response_for,
)

__all__ = [
    "APP_CREDENTIAL_PREFIX",
    "ClientHandshake",
    "ClientHandshakeState",
    "ServerHandshake",
    "ServerHandshakeState",
    "app_credential",
    "client_mac",
    "format_app_credential",
    "parse_app_credential",
    "server_proof",
]

_CLIENT_LABEL: Final = b"exchange-auth-v1|c"
_SERVER_LABEL: Final = b"exchange-auth-v1|s"
_APP_LABEL: Final = b"exchange-app-v1|"
#: How a per-application credential starts when it is written down (a file, a variable).
APP_CREDENTIAL_PREFIX: Final = b"exchange-app-v1:"

NonceFactory = Callable[[int], bytes]


def client_mac(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the client sends in ``AuthResponse``."""
    return hmac.new(secret, _CLIENT_LABEL + server_nonce + client_nonce, hashlib.sha256).digest()


def server_proof(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the server sends in ``AuthOk``."""
    return hmac.new(secret, _SERVER_LABEL + client_nonce + server_nonce, hashlib.sha256).digest()


def app_credential(secret: bytes, app_id: str) -> bytes:
    """The key of application ``app_id`` under the daemon secret ``secret``."""
    _check_secret(secret)
    check_app_id(app_id)
    if not app_id:
        raise UsageError("app_id must not be empty for an application credential")
    return hmac.new(secret, _APP_LABEL + app_id.encode("utf-8"), hashlib.sha256).digest()


def format_app_credential(secret: bytes, app_id: str) -> bytes:
    """The credential of ``app_id`` as text to hand to that application's tasks."""
    key = app_credential(secret, app_id)
    return APP_CREDENTIAL_PREFIX + app_id.encode("utf-8") + b":" + key.hex().encode()


def parse_app_credential(text: bytes) -> tuple[str, bytes]:
    """``(app_id, key)`` of a ``format_app_credential`` text; UsageError when malformed."""
    if not text.startswith(APP_CREDENTIAL_PREFIX):
        raise UsageError("not an application credential (exchange-app-v1:<app_id>:<hex>)")
    app, sep, hexkey = text[len(APP_CREDENTIAL_PREFIX) :].rpartition(b":")
    try:
        app_id = app.decode("utf-8")
        key = bytes.fromhex(hexkey.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise UsageError("malformed application credential") from None
    if not sep or not app_id or len(key) != hashlib.sha256().digest_size:
        raise UsageError("malformed application credential")
    return check_app_id(app_id), key


def _check_secret(secret: bytes | None) -> None:
    if secret is not None and (not isinstance(secret, bytes) or not secret):
        raise UsageError("secret must be non-empty bytes, or None to disable authentication")


def _nonce(factory: NonceFactory) -> bytes:
    nonce = factory(NONCE_SIZE)
    if not isinstance(nonce, bytes) or len(nonce) != NONCE_SIZE:
        raise UsageError(f"nonce_factory must return {NONCE_SIZE} bytes, got {nonce!r}")
    return nonce


class ClientHandshakeState(Enum):
    INITIAL = "initial"
    AWAIT_SERVER_HELLO = "await_server_hello"
    AWAIT_AUTH_OK = "await_auth_ok"
    ESTABLISHED = "established"
    FAILED = "failed"


class ServerHandshakeState(Enum):
    AWAIT_CLIENT_HELLO = "await_client_hello"
    AWAIT_AUTH_RESPONSE = "await_auth_response"
    ESTABLISHED = "established"
    FAILED = "failed"


class ClientHandshake:
    """The client's side: ``start()``, then ``receive()`` each message until established.

    ``secret`` is the daemon's secret, or an application credential
    (``format_app_credential``), which names its application itself. ``app_id`` names the
    application a holder of the daemon's secret speaks for (``""``: none).
    """

    def __init__(
        self,
        secret: bytes | None,
        *,
        nonce_factory: NonceFactory = os.urandom,
        version: int = PROTOCOL_VERSION,
        address: str | None = None,
        app_id: str = "",
    ) -> None:
        _check_secret(secret)
        check_app_id(app_id)
        if secret is not None and secret.startswith(APP_CREDENTIAL_PREFIX):
            cred_app, secret = parse_app_credential(secret)
            if app_id and app_id != cred_app:
                raise UsageError(f"the credential is application {cred_app!r}'s, not {app_id!r}'s")
            app_id = cred_app
        elif secret is not None and app_id:
            secret = app_credential(secret, app_id)
        self.app_id = app_id
        self._secret = secret
        self._nonce_factory = nonce_factory
        self._version = version
        self._address = address
        self._client_nonce = b""
        self._server_nonce = b""
        self._authenticated = False
        self.state = ClientHandshakeState.INITIAL
        self.error_response: ErrorResponse | None = None

    @property
    def is_established(self) -> bool:
        return self.state is ClientHandshakeState.ESTABLISHED

    @property
    def authenticated(self) -> bool:
        """True once the server proved that it knows the secret."""
        return self._authenticated

    def start(self) -> list[Message]:
        """The opening ``ClientHello``."""
        if self.state is not ClientHandshakeState.INITIAL:
            raise IllegalStateError(f"handshake already started (state {self.state.name})")
        self._client_nonce = _nonce(self._nonce_factory)
        self.state = ClientHandshakeState.AWAIT_SERVER_HELLO
        return [ClientHello(self._version, self._client_nonce)]

    def receive(self, msg: Message) -> list[Message]:
        """Handle a message from the server; returns what to send next."""
        state = self.state
        if state in (
            ClientHandshakeState.INITIAL,
            ClientHandshakeState.ESTABLISHED,
            ClientHandshakeState.FAILED,
        ):
            raise IllegalStateError(f"client handshake cannot receive in state {state.name}")
        match msg:
            case ErrorResponse():
                # The server already gave up; nothing to answer.
                self.state = ClientHandshakeState.FAILED
                raise error_for_response(msg, self._address)
            case ServerHello() if state is ClientHandshakeState.AWAIT_SERVER_HELLO:
                return self._on_server_hello(msg)
            case AuthOk() if state is ClientHandshakeState.AWAIT_AUTH_OK:
                return self._on_auth_ok(msg)
            case _:
                raise self._fail(
                    ProtocolError(
                        f"unexpected {type(msg).__name__} in handshake state {state.name}"
                    )
                )

    def _on_server_hello(self, msg: ServerHello) -> list[Message]:
        if msg.version != self._version:
            raise self._fail(VersionMismatchError(msg.version, self._version))
        self._server_nonce = msg.server_nonce
        if not msg.auth_required:
            if self._secret is not None:
                # No downgrade: a peer that skips authentication could be anyone.
                raise self._fail(
                    AuthenticationError(
                        "the server does not authenticate, but this client holds a secret; "
                        "configure the daemon with the same secret"
                        + (f" (daemon={self._address})" if self._address else "")
                    )
                )
            self.state = ClientHandshakeState.ESTABLISHED
            return []
        if self._secret is None:
            raise self._fail(
                AuthenticationError("the server requires authentication; no secret configured")
            )
        self.state = ClientHandshakeState.AWAIT_AUTH_OK
        mac = client_mac(self._secret, self._client_nonce, msg.server_nonce)
        return [AuthResponse(mac, self.app_id)]

    def _on_auth_ok(self, msg: AuthOk) -> list[Message]:
        assert self._secret is not None
        expected = server_proof(self._secret, self._client_nonce, self._server_nonce)
        if not hmac.compare_digest(msg.server_proof, expected):
            raise self._fail(AuthenticationError("the server failed to prove the shared secret"))
        self._authenticated = True
        self.state = ClientHandshakeState.ESTABLISHED
        return []

    def _fail(self, exc: ProtocolError) -> ProtocolError:
        self.state = ClientHandshakeState.FAILED
        self.error_response = error_response_for(exc)
        return exc


class ServerHandshake:
    """The server's side: ``receive()`` each message until established."""

    def __init__(
        self,
        secret: bytes | None,
        *,
        nonce_factory: NonceFactory = os.urandom,
        version: int = PROTOCOL_VERSION,
    ) -> None:
        _check_secret(secret)
        self._secret = secret
        self._nonce_factory = nonce_factory
        self._version = version
        self._client_nonce = b""
        self._server_nonce = b""
        #: The application the client authenticated for ("" : none, or no secret).
        self.app_id = ""
        self.state = ServerHandshakeState.AWAIT_CLIENT_HELLO
        self.error_response: ErrorResponse | None = None

    @property
    def is_established(self) -> bool:
        return self.state is ServerHandshakeState.ESTABLISHED

    @property
    def auth_required(self) -> bool:
        return self._secret is not None

    def receive(self, msg: Message) -> list[Message]:
        """Handle a message from the client; returns what to send next.

        Anything but the expected handshake message is a ``ProtocolError`` (an
        ``AuthenticationError`` while authentication is pending).
        """
        state = self.state
        if state in (ServerHandshakeState.ESTABLISHED, ServerHandshakeState.FAILED):
            raise IllegalStateError(f"server handshake cannot receive in state {state.name}")
        match msg:
            case ClientHello() if state is ServerHandshakeState.AWAIT_CLIENT_HELLO:
                return self._on_client_hello(msg)
            case AuthResponse() if state is ServerHandshakeState.AWAIT_AUTH_RESPONSE:
                return self._on_auth_response(msg)
            case _ if state is ServerHandshakeState.AWAIT_AUTH_RESPONSE:
                raise self._fail(
                    AuthenticationError(
                        f"client sent {type(msg).__name__} instead of authenticating"
                    )
                )
            case _:
                raise self._fail(
                    ProtocolError(
                        f"unexpected {type(msg).__name__} in handshake state {state.name}"
                    )
                )

    def _on_client_hello(self, msg: ClientHello) -> list[Message]:
        if msg.version != self._version:
            raise self._fail(VersionMismatchError(msg.version, self._version))
        self._client_nonce = msg.client_nonce
        self._server_nonce = _nonce(self._nonce_factory)
        auth = self._secret is not None
        self.state = (
            ServerHandshakeState.AWAIT_AUTH_RESPONSE if auth else ServerHandshakeState.ESTABLISHED
        )
        return [ServerHello(self._version, auth, self._server_nonce)]

    def _on_auth_response(self, msg: AuthResponse) -> list[Message]:
        assert self._secret is not None
        app = msg.app_id
        key = app_credential(self._secret, app) if app else self._secret
        expected = client_mac(key, self._client_nonce, self._server_nonce)
        if not hmac.compare_digest(msg.mac, expected):
            what = f"application {app!r}'s credential" if app else "secret"
            raise self._fail(AuthenticationError(f"client failed authentication: wrong {what}"))
        self.app_id = app
        self.state = ServerHandshakeState.ESTABLISHED
        return [AuthOk(server_proof(key, self._client_nonce, self._server_nonce))]

    def _fail(self, exc: ProtocolError) -> ProtocolError:
        self.state = ServerHandshakeState.FAILED
        self.error_response = error_response_for(exc)
        return exc
