"""Tests for exchange.protocol.handshake."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Iterator

import pytest

from exchange.errors import (
    AuthenticationError,
    IllegalStateError,
    LocalProtocolError,
    ProtocolError,
    UsageError,
    VersionMismatchError,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol import (
    PROTOCOL_VERSION,
    AuthOk,
    AuthResponse,
    BufferResponse,
    ClientHandshake,
    ClientHandshakeState,
    ClientHello,
    DataType,
    ErrorCode,
    ErrorResponse,
    InPlaceFrameDecoder,
    Message,
    PartitionRequest,
    ServerHandshake,
    ServerHandshakeState,
    ServerHello,
    encode,
)
from exchange.protocol.handshake import (
    app_credential,
    format_app_credential,
    parse_app_credential,
)

CLIENT_NONCE = bytes(range(16))
SERVER_NONCE = bytes(range(100, 116))


def fixed(nonce: bytes) -> Callable[[int], bytes]:
    def factory(n: int) -> bytes:
        assert n == 16
        return nonce

    return factory


def client(secret: bytes | None, **kw: object) -> ClientHandshake:
    return ClientHandshake(secret, nonce_factory=fixed(CLIENT_NONCE), **kw)  # type: ignore[arg-type]


def server(secret: bytes | None, **kw: object) -> ServerHandshake:
    return ServerHandshake(secret, nonce_factory=fixed(SERVER_NONCE), **kw)  # type: ignore[arg-type]


def over_the_wire(msgs: list[Message]) -> list[Message]:
    """Encode and decode, as the real transport would."""
    decoder = InPlaceFrameDecoder()
    out = decoder.feed(b"".join(b"".join(encode(m)) for m in msgs))
    assert out == msgs
    return out


def run(c: ClientHandshake, s: ServerHandshake) -> list[Message]:
    """Drive both sides to completion; returns the transcript."""
    transcript: list[Message] = []
    to_server = over_the_wire(c.start())
    while to_server:
        transcript.extend(to_server)
        to_client: list[Message] = []
        for m in to_server:
            to_client.extend(s.receive(m))
        to_client = over_the_wire(to_client)
        transcript.extend(to_client)
        to_server = []
        for m in to_client:
            to_server.extend(c.receive(m))
        to_server = over_the_wire(to_server)
    return transcript


def reference_mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, b"exchange-auth-v1|" + label + a + b, hashlib.sha256).digest()


# -- success ------------------------------------------------------------------------------


def test_no_secret() -> None:
    c, s = client(None), server(None)
    transcript = run(c, s)
    assert transcript == [
        ClientHello(PROTOCOL_VERSION, CLIENT_NONCE),
        ServerHello(PROTOCOL_VERSION, False, SERVER_NONCE),
    ]
    assert c.is_established and s.is_established
    assert not c.authenticated


def test_right_secret_authenticates_both_ways() -> None:
    secret = b"s3cr3t"
    c, s = client(secret), server(secret)
    transcript = run(c, s)
    assert transcript == [
        ClientHello(PROTOCOL_VERSION, CLIENT_NONCE),
        ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE),
        AuthResponse(reference_mac(secret, b"c", SERVER_NONCE, CLIENT_NONCE)),
        AuthOk(reference_mac(secret, b"s", CLIENT_NONCE, SERVER_NONCE)),
    ]
    assert c.is_established and s.is_established
    assert c.authenticated
    assert c.error_response is None and s.error_response is None


def test_client_with_secret_refuses_a_server_without_one() -> None:
    """Defect 9 (auth downgrade): a client configured with a secret must not talk to a
    peer that does not prove it knows the secret (anyone could impersonate a daemon)."""
    c, s = client(b"secret"), server(None)
    with pytest.raises(AuthenticationError, match="does not authenticate"):
        run(c, s)
    assert c.state is ClientHandshakeState.FAILED
    assert not c.authenticated
    assert c.error_response is not None and c.error_response.code is ErrorCode.AUTH_FAILED


def test_default_nonces_are_random() -> None:
    (a,) = ClientHandshake(None).start()
    (b,) = ClientHandshake(None).start()
    assert isinstance(a, ClientHello) and isinstance(b, ClientHello)
    assert len(a.client_nonce) == 16
    assert a.client_nonce != b.client_nonce


# -- authentication failures --------------------------------------------------------------


def test_wrong_secret() -> None:
    c, s = client(b"right"), server(b"wrong")
    s.receive(*c.start())
    (auth,) = c.receive(ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE))
    with pytest.raises(AuthenticationError):
        s.receive(auth)
    assert s.state is ServerHandshakeState.FAILED
    assert not s.is_established
    resp = s.error_response
    assert resp is not None and resp.code is ErrorCode.AUTH_FAILED and resp.is_fatal
    # The client learns why, and does not echo an error back.
    with pytest.raises(AuthenticationError):
        c.receive(resp)
    assert c.state is ClientHandshakeState.FAILED
    assert c.error_response is None


def test_server_that_cannot_prove_the_secret_is_rejected() -> None:
    c = client(b"secret")
    c.start()
    c.receive(ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE))
    forged = reference_mac(b"other", b"s", CLIENT_NONCE, SERVER_NONCE)
    with pytest.raises(AuthenticationError):
        c.receive(AuthOk(forged))
    assert not c.is_established
    assert c.error_response is not None and c.error_response.code is ErrorCode.AUTH_FAILED


def test_reflected_client_mac_is_not_a_server_proof() -> None:
    c = client(b"secret")
    c.start()
    (auth,) = c.receive(ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE))
    assert isinstance(auth, AuthResponse)
    with pytest.raises(AuthenticationError):
        c.receive(AuthOk(auth.mac))


def test_replayed_auth_response_fails_with_a_new_server_nonce() -> None:
    secret = b"secret"
    c, s = client(secret), server(secret)
    transcript = run(c, s)
    recorded = transcript[2]
    s2 = ServerHandshake(secret, nonce_factory=fixed(bytes(16)))
    s2.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))
    with pytest.raises(AuthenticationError):
        s2.receive(recorded)


def test_client_without_secret_vs_server_requiring_one() -> None:
    c, s = client(None), server(b"secret")
    (hello,) = c.start()
    (server_hello,) = s.receive(hello)
    with pytest.raises(AuthenticationError, match="no secret"):
        c.receive(server_hello)
    assert c.state is ClientHandshakeState.FAILED
    assert c.error_response is not None and c.error_response.code is ErrorCode.AUTH_FAILED
    # Whatever the client sends instead of authenticating, the server refuses it.
    with pytest.raises(AuthenticationError):
        s.receive(c.error_response)
    assert s.error_response is not None and s.error_response.code is ErrorCode.AUTH_FAILED
    assert s.error_response.is_fatal


def test_client_skipping_authentication_is_refused() -> None:
    s = server(b"secret")
    s.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))
    with pytest.raises(AuthenticationError):
        s.receive(PartitionRequest(ResultPartitionID("ds", 0), 0, 1, 2))
    assert s.error_response is not None and s.error_response.code is ErrorCode.AUTH_FAILED


class Spy:
    def __init__(self, result: bool | None = None) -> None:
        self.calls: list[tuple[bytes, bytes]] = []
        self.result = result
        self.real = hmac.compare_digest

    def __call__(self, a: bytes, b: bytes) -> bool:
        self.calls.append((a, b))
        return self.real(a, b) if self.result is None else self.result


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spy]:
    s = Spy()
    monkeypatch.setattr(hmac, "compare_digest", s)
    yield s


def test_macs_are_compared_in_constant_time(spy: Spy) -> None:
    secret = b"secret"
    transcript = run(client(secret), server(secret))
    auth, ok = transcript[2], transcript[3]
    assert isinstance(auth, AuthResponse) and isinstance(ok, AuthOk)
    assert spy.calls == [(auth.mac, auth.mac), (ok.server_proof, ok.server_proof)]


def test_compare_digest_result_decides(spy: Spy) -> None:
    spy.result = False
    with pytest.raises(AuthenticationError):
        run(client(b"secret"), server(b"secret"))
    assert len(spy.calls) == 1


# -- version and order --------------------------------------------------------------------


def test_server_rejects_another_version() -> None:
    c, s = client(None, version=PROTOCOL_VERSION + 1), server(None)
    (hello,) = c.start()
    with pytest.raises(VersionMismatchError) as info:
        s.receive(hello)
    assert (info.value.theirs, info.value.ours) == (PROTOCOL_VERSION + 1, PROTOCOL_VERSION)
    resp = s.error_response
    assert resp is not None and resp.code is ErrorCode.VERSION_MISMATCH and resp.is_fatal
    # the server's answer tells the client that *it* speaks an unsupported version
    with pytest.raises(LocalProtocolError, match="version"):
        c.receive(resp)


def test_client_rejects_another_version() -> None:
    c = client(None)
    c.start()
    with pytest.raises(VersionMismatchError) as info:
        c.receive(ServerHello(PROTOCOL_VERSION + 1, False, SERVER_NONCE))
    assert (info.value.theirs, info.value.ours) == (PROTOCOL_VERSION + 1, PROTOCOL_VERSION)
    assert c.error_response is not None
    assert c.error_response.code is ErrorCode.VERSION_MISMATCH


NOT_HANDSHAKE: list[Message] = [
    PartitionRequest(ResultPartitionID("ds", 0), 0, 1, 2),
    BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"x"),
    AuthOk(bytes(32)),
    ServerHello(PROTOCOL_VERSION, False, SERVER_NONCE),
]


@pytest.mark.parametrize("msg", NOT_HANDSHAKE, ids=lambda m: type(m).__name__)
def test_server_rejects_messages_before_hello(msg: Message) -> None:
    s = server(None)
    with pytest.raises(ProtocolError) as info:
        s.receive(msg)
    assert not isinstance(info.value, AuthenticationError)
    assert s.state is ServerHandshakeState.FAILED
    assert s.error_response is not None and s.error_response.code is ErrorCode.PROTOCOL_ERROR


def test_server_rejects_auth_response_when_no_auth_was_asked() -> None:
    s = server(None)
    with pytest.raises(ProtocolError):
        s.receive(AuthResponse(bytes(32)))


def test_second_client_hello_during_auth_is_refused() -> None:
    s = server(b"secret")
    s.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))
    with pytest.raises(AuthenticationError):
        s.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))


@pytest.mark.parametrize("msg", NOT_HANDSHAKE[:3], ids=lambda m: type(m).__name__)
def test_client_rejects_messages_before_server_hello(msg: Message) -> None:
    c = client(b"secret")
    c.start()
    with pytest.raises(ProtocolError):
        c.receive(msg)
    assert c.state is ClientHandshakeState.FAILED
    assert c.error_response is not None and c.error_response.code is ErrorCode.PROTOCOL_ERROR


def test_client_rejects_a_second_server_hello() -> None:
    c = client(b"secret")
    c.start()
    c.receive(ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE))
    with pytest.raises(ProtocolError):
        c.receive(ServerHello(PROTOCOL_VERSION, True, SERVER_NONCE))


def test_per_channel_error_during_handshake_still_fails_it() -> None:
    c = client(None)
    c.start()
    with pytest.raises(LocalProtocolError):
        c.receive(ErrorResponse(ErrorCode.PROTOCOL_ERROR, "bad", 3))
    assert c.state is ClientHandshakeState.FAILED


# -- misuse -------------------------------------------------------------------------------


def test_calls_out_of_order() -> None:
    c = client(None)
    with pytest.raises(IllegalStateError):
        c.receive(ServerHello(PROTOCOL_VERSION, False, SERVER_NONCE))
    c.start()
    with pytest.raises(IllegalStateError):
        c.start()
    c2, s2 = client(None), server(None)
    run(c2, s2)
    with pytest.raises(IllegalStateError):
        c2.receive(ServerHello(PROTOCOL_VERSION, False, SERVER_NONCE))
    with pytest.raises(IllegalStateError):
        s2.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))


def test_failed_handshake_refuses_further_messages() -> None:
    s = server(None)
    with pytest.raises(ProtocolError):
        s.receive(AuthOk(bytes(32)))
    with pytest.raises(IllegalStateError):
        s.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))


@pytest.mark.parametrize("secret", [b"", "text", bytearray(b"x")])
def test_bad_secrets(secret: object) -> None:
    with pytest.raises(UsageError):
        ClientHandshake(secret)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        ServerHandshake(secret)  # type: ignore[arg-type]


def test_bad_nonce_factory() -> None:
    c = ClientHandshake(None, nonce_factory=lambda n: bytes(n - 1))
    with pytest.raises(UsageError):
        c.start()
    s = ServerHandshake(None, nonce_factory=lambda n: "x" * n)  # type: ignore[arg-type,return-value]
    with pytest.raises(UsageError):
        s.receive(ClientHello(PROTOCOL_VERSION, CLIENT_NONCE))


# -- per-application credentials ---------------------------------------------------------


def reference_app_key(secret: bytes, app_id: str) -> bytes:
    return hmac.new(secret, b"exchange-app-v1|" + app_id.encode(), hashlib.sha256).digest()


@pytest.mark.parametrize("holds", ["daemon-secret", "app-credential"])
def test_a_client_authenticates_for_its_application(holds: str) -> None:
    secret = b"s3cr3t"
    key = reference_app_key(secret, "app-1")
    assert app_credential(secret, "app-1") == key
    if holds == "daemon-secret":
        c = client(secret, app_id="app-1")
    else:
        c = client(format_app_credential(secret, "app-1"))
    s = server(secret)
    transcript = run(c, s)
    assert transcript[2:] == [
        AuthResponse(reference_mac(key, b"c", SERVER_NONCE, CLIENT_NONCE), "app-1"),
        AuthOk(reference_mac(key, b"s", CLIENT_NONCE, SERVER_NONCE)),
    ]
    assert c.authenticated and c.app_id == s.app_id == "app-1"


def test_an_application_credential_does_not_authenticate_another_application() -> None:
    secret = b"s3cr3t"
    key_hex = format_app_credential(secret, "app-1").rsplit(b":", 1)[1]
    c = client(b"exchange-app-v1:app-2:" + key_hex)
    assert c.app_id == "app-2"
    s = server(secret)
    (ch,) = c.start()
    (sh,) = s.receive(ch)
    (auth,) = c.receive(sh)
    with pytest.raises(AuthenticationError, match="app-2"):
        s.receive(auth)
    assert s.app_id == "" and s.error_response is not None
    assert s.error_response.code is ErrorCode.AUTH_FAILED


def test_a_credential_and_another_app_id_conflict() -> None:
    cred = format_app_credential(b"s3cr3t", "app-1")
    with pytest.raises(UsageError, match="app-1"):
        ClientHandshake(cred, app_id="app-2")
    assert ClientHandshake(cred, app_id="app-1").app_id == "app-1"


@pytest.mark.parametrize(
    "text",
    [
        b"exchange-app-v1:",
        b"exchange-app-v1:app",
        b"exchange-app-v1::" + bytes(32).hex().encode(),
        b"exchange-app-v1:app:" + bytes(31).hex().encode(),
        b"exchange-app-v1:app:zz",
        b"exchange-app-v1:\xff:" + bytes(32).hex().encode(),
    ],
)
def test_malformed_credentials_are_usage_errors(text: bytes) -> None:
    with pytest.raises(UsageError):
        parse_app_credential(text)
    with pytest.raises(UsageError):
        ClientHandshake(text)


@pytest.mark.parametrize("app_id", [7, "x" * 256, "\ud800"])
def test_invalid_app_ids(app_id: object) -> None:
    with pytest.raises(UsageError):
        ClientHandshake(b"s", app_id=app_id)  # type: ignore[arg-type]
    with pytest.raises(UsageError):
        AuthResponse(bytes(32), app_id)  # type: ignore[arg-type]
