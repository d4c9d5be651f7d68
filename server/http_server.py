"""The daemon's HTTP port: ``/metrics``, ``/healthz``, ``/api/stats`` and the dashboard at ``/``.

A deliberately small HTTP/1.1 server on asyncio streams (no new dependency): one request per
connection (``Connection: close``), GET only, no request bodies. It faces whatever can reach
the port, so it sets limits before it allocates: the request line and headers together may
take ``max_head_bytes`` (8 KiB; more is answered 431), at most ``MAX_HEADERS`` header lines,
``read_timeout`` seconds (5 s) to send them (a slowloris client gets 408 and is closed), the
same to take the response, ``max_connections_per_peer`` connections per client address
(more are closed unanswered) and ``max_connections`` clients at once. Beyond that a client
is still answered if it asks for ``/healthz`` (a liveness probe must not fail because
others hold every slot), anything else gets 503; the per-address cap bounds what one
address can hold, ``HARD_LIMIT_FACTOR`` times ``max_connections`` what all together can.

Parsing is sans-I/O: :func:`parse_request_head` turns the bytes of a request head into a
:class:`Request` or raises :class:`HttpRequestError` carrying the status to answer with;
:func:`encode_response` turns a :class:`Response` into bytes. :class:`HttpServer` only moves
bytes. Everything it serves is computed on the event loop, the thread that owns the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import json
import logging
import string
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from prometheus_client import CollectorRegistry, generate_latest

from exchange import __version__
from server.metrics import DaemonView, ExchangeCollector, stats_snapshot

__all__ = [
    "DEFAULT_MAX_HEAD_BYTES",
    "DEFAULT_READ_TIMEOUT",
    "METRICS_CONTENT_TYPE",
    "HttpRequestError",
    "HttpServer",
    "Request",
    "Response",
    "encode_response",
    "parse_request_head",
]

log = logging.getLogger("exchange.server.http")

DEFAULT_MAX_HEAD_BYTES: Final = 8 * 1024
DEFAULT_READ_TIMEOUT: Final = 5.0
DEFAULT_MAX_CONNECTIONS: Final = 64
DEFAULT_MAX_CONNECTIONS_PER_PEER: Final = 8
#: Connections beyond ``max_connections`` x this are closed at once, /healthz or not.
HARD_LIMIT_FACTOR: Final = 4
MAX_HEADERS: Final = 100
#: How long an error response waits for the client to stop sending before closing.
LINGER_TIMEOUT: Final = 1.0
LINGER_MAX_BYTES: Final = 64 * 1024

#: The Prometheus text format 0.0.4 (what every Prometheus version scrapes).
METRICS_CONTENT_TYPE: Final = "text/plain; version=0.0.4; charset=utf-8"
JSON_CONTENT_TYPE: Final = "application/json"
HTML_CONTENT_TYPE: Final = "text/html; charset=utf-8"
TEXT_CONTENT_TYPE: Final = "text/plain; charset=utf-8"
#: The dashboard is one self-contained page: inline script and style, fetches from itself.
DASHBOARD_CSP: Final = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
SERVER_HEADER: Final = f"exchange-daemon/{__version__}"

_TOKEN_CHARS: Final = frozenset(string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~")


# -- sans-I/O: requests and responses ------------------------------------------------------


class HttpRequestError(Exception):
    """The client sent a request we answer with an error status (the peer's fault)."""

    def __init__(self, status: HTTPStatus, detail: str) -> None:
        super().__init__(f"{status.value} {status.phrase}: {detail}")
        self.status = status
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    path: str
    query: str
    version: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        lower = name.lower()
        for key, value in self.headers:
            if key == lower:
                return value
        return None


@dataclass(frozen=True, slots=True)
class Response:
    status: HTTPStatus
    body: bytes = b""
    content_type: str = TEXT_CONTENT_TYPE
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def text(cls, status: HTTPStatus, text: str | None = None) -> Response:
        body = (text if text is not None else f"{status.value} {status.phrase}") + "\n"
        return cls(status, body.encode())

    @classmethod
    def json(cls, status: HTTPStatus, value: Any) -> Response:
        body = json.dumps(value, separators=(",", ":"), allow_nan=False).encode()
        return cls(status, body, JSON_CONTENT_TYPE)


def parse_request_head(
    head: bytes, *, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES, max_headers: int = MAX_HEADERS
) -> Request:
    """Parse a request line and headers, ending in ``\\r\\n\\r\\n``.

    Raises HttpRequestError: 431 when the head or the header count is over its limit, 400
    when it is malformed, 505 for an HTTP version other than 1.0 and 1.1.
    """
    if len(head) > max_head_bytes:
        raise HttpRequestError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"request head of {len(head)} bytes exceeds the limit of {max_head_bytes} bytes",
        )
    if not head.endswith(b"\r\n\r\n"):
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "request head is not terminated")
    lines = head[:-4].split(b"\r\n")
    if len(lines) - 1 > max_headers:
        raise HttpRequestError(
            HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
            f"{len(lines) - 1} header lines exceed the limit of {max_headers}",
        )
    try:
        request_line = lines[0].decode("ascii")
    except UnicodeDecodeError:
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "request line is not ASCII") from None
    parts = request_line.split(" ")
    if len(parts) != 3 or not all(parts):
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    if not set(method) <= _TOKEN_CHARS:
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "malformed method")
    if not version.startswith("HTTP/") or len(version) != 8 or version[6] != ".":
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "malformed HTTP version")
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise HttpRequestError(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED, f"{version} not supported")
    if not target.startswith("/") or any(c <= " " or c == "\x7f" for c in target):
        raise HttpRequestError(HTTPStatus.BAD_REQUEST, "request target must be an absolute path")
    path, _, query = target.partition("?")
    path = path.partition("#")[0]
    headers: list[tuple[str, str]] = []
    for raw in lines[1:]:
        name, colon, value = raw.partition(b":")
        if not colon or not name:
            raise HttpRequestError(HTTPStatus.BAD_REQUEST, "malformed header line")
        key = name.decode("latin-1")
        # No whitespace before the colon, no obsolete line folding (RFC 9112, 5.1 and 5.2).
        if not set(key) <= _TOKEN_CHARS:
            raise HttpRequestError(HTTPStatus.BAD_REQUEST, f"malformed header name {key!r}")
        headers.append((key.lower(), value.decode("latin-1").strip(" \t")))
    return Request(method, target, path, query, version, tuple(headers))


def encode_response(resp: Response) -> bytes:
    """Status line, headers (always ``Connection: close``) and body."""
    lines = [
        f"HTTP/1.1 {resp.status.value} {resp.status.phrase}",
        f"Server: {SERVER_HEADER}",
        f"Content-Type: {resp.content_type}",
        f"Content-Length: {len(resp.body)}",
        "Cache-Control: no-store",
        "X-Content-Type-Options: nosniff",
        "Connection: close",
        *(f"{name}: {value}" for name, value in resp.headers),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + resp.body


def _peer_host(writer: asyncio.StreamWriter) -> str:
    """The client's address without its port (what the per-peer cap counts)."""
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


def _load_dashboard() -> bytes:
    return importlib.resources.files("server").joinpath("static/dashboard.html").read_bytes()


# -- the server ----------------------------------------------------------------------------


class HttpServer:
    """The HTTP port of one daemon.

    ``registry`` defaults to a fresh CollectorRegistry holding an ExchangeCollector of
    ``daemon`` (never prometheus_client's global registry).
    """

    def __init__(
        self,
        daemon: DaemonView,
        *,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_connections_per_peer: int = DEFAULT_MAX_CONNECTIONS_PER_PEER,
        registry: CollectorRegistry | None = None,
    ) -> None:
        if read_timeout <= 0:
            raise ValueError(f"read_timeout must be positive, got {read_timeout}")
        if max_head_bytes < 64:
            raise ValueError(f"max_head_bytes must be at least 64, got {max_head_bytes}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be positive, got {max_connections}")
        if max_connections_per_peer < 1:
            raise ValueError(
                f"max_connections_per_peer must be positive, got {max_connections_per_peer}"
            )
        self.daemon = daemon
        self.read_timeout = read_timeout
        self.max_head_bytes = max_head_bytes
        self.max_connections = max_connections
        self.max_connections_per_peer = max_connections_per_peer
        self.collector = ExchangeCollector(daemon)
        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(self.collector)
        self.registry = registry
        self._dashboard = _load_dashboard()
        self._server: asyncio.Server | None = None
        self._clients: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        self._per_peer: dict[str, int] = {}
        #: connections closed unanswered: their address held max_connections_per_peer
        self.refused_connections = 0
        self._closing = False
        self.requests_served = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on ``host:port`` (0 = any free port); returns the bound address."""
        if self._server is not None:
            raise RuntimeError("HttpServer already started")
        self._server = await asyncio.start_server(
            self._on_client, host, port, limit=self.max_head_bytes, reuse_address=True
        )
        addr = self._server.sockets[0].getsockname()
        return str(addr[0]), int(addr[1])

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None or not self._server.sockets:
            return None
        addr = self._server.sockets[0].getsockname()
        return str(addr[0]), int(addr[1])

    @property
    def num_connections(self) -> int:
        return len(self._clients)

    async def close(self) -> None:
        """Stop listening and drop every open client connection."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        clients = list(self._clients.items())
        for task, writer in clients:
            writer.transport.abort()
            task.cancel()
        if clients:
            await asyncio.gather(*(t for t, _ in clients), return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    # -- one connection --------------------------------------------------------------------

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        peer = _peer_host(writer)
        held = self._per_peer.get(peer, 0)
        if (
            self._closing
            or held >= self.max_connections_per_peer
            or len(self._clients) >= HARD_LIMIT_FACTOR * self.max_connections
        ):
            if not self._closing:
                self.refused_connections += 1
                log.debug("HTTP connection from %s refused: %d held", peer, held)
            writer.transport.abort()
            return
        self._clients[task] = writer
        self._per_peer[peer] = held + 1
        try:
            await self._serve(reader, writer, over_limit=len(self._clients) > self.max_connections)
        except (ConnectionError, TimeoutError):
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()
            if not self._closing:
                raise
        except Exception:  # a bug must cost one request, never the port
            log.exception("HTTP connection failed")
            writer.transport.abort()
        finally:
            del self._clients[task]
            left = self._per_peer.pop(peer) - 1
            if left:
                self._per_peer[peer] = left
            writer.close()
            await self._wait_closed(writer)

    async def _wait_closed(self, writer: asyncio.StreamWriter) -> None:
        """Let the transport flush and close; abort it if the client does not read."""
        try:
            async with asyncio.timeout(self.read_timeout):
                await writer.wait_closed()
        except (TimeoutError, OSError):
            writer.transport.abort()

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, over_limit: bool
    ) -> None:
        """Read one request and answer it; ``over_limit``: only ``/healthz`` is served."""
        try:
            async with asyncio.timeout(self.read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            await self._send(writer, Response.text(HTTPStatus.REQUEST_TIMEOUT))
            return
        except asyncio.LimitOverrunError:
            err = HttpRequestError(
                HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE,
                f"request head exceeds the limit of {self.max_head_bytes} bytes",
            )
            await self._send_error(reader, writer, err)
            return
        except asyncio.IncompleteReadError as e:
            if e.partial:  # the client hung up halfway through its request
                log.debug("HTTP client closed after %d bytes of a request head", len(e.partial))
            return
        try:
            request = parse_request_head(head, max_head_bytes=self.max_head_bytes)
        except HttpRequestError as err:
            await self._send_error(reader, writer, err)
            return
        if over_limit and request.path != "/healthz":
            busy = HttpRequestError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"too many connections (limit {self.max_connections}); /healthz is still served",
            )
            await self._send_error(reader, writer, busy)
            return
        resp = self.handle(request)
        self.requests_served += 1
        log.debug("%s %s -> %d", request.method, request.target, resp.status.value)
        await self._send(writer, resp)

    async def _send(self, writer: asyncio.StreamWriter, resp: Response) -> None:
        writer.write(encode_response(resp))
        async with asyncio.timeout(self.read_timeout):
            await writer.drain()

    async def _send_error(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, err: HttpRequestError
    ) -> None:
        """Answer a bad request, then read what the client still sends before closing.

        Closing a socket with unread bytes makes the kernel send a reset, which may destroy
        the response before the client reads it; so half-close and drain first (a lingering
        close, bounded in time and bytes).
        """
        log.debug("bad HTTP request: %s", err)
        await self._send(writer, Response.text(err.status, err.detail))
        if not writer.can_write_eof():
            return
        writer.write_eof()
        with contextlib.suppress(TimeoutError, ConnectionError):
            async with asyncio.timeout(min(LINGER_TIMEOUT, self.read_timeout)):
                drained = 0
                while drained < LINGER_MAX_BYTES:
                    chunk = await reader.read(16 * 1024)
                    if not chunk:
                        break
                    drained += len(chunk)

    # -- routes ----------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        """The response to one parsed request."""
        if request.method != "GET":
            return Response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                b"405 Method Not Allowed: only GET\n",
                headers=(("Allow", "GET"),),
            )
        try:
            match request.path:
                case "/metrics":
                    return Response(
                        HTTPStatus.OK, generate_latest(self.registry), METRICS_CONTENT_TYPE
                    )
                case "/healthz":
                    if getattr(self.daemon, "shutting_down", False):
                        return Response.json(
                            HTTPStatus.SERVICE_UNAVAILABLE, {"status": "shutting_down"}
                        )
                    return Response.json(HTTPStatus.OK, {"status": "ok"})
                case "/api/stats":
                    snapshot = stats_snapshot(self.daemon, sent=self.collector.sent)
                    return Response.json(HTTPStatus.OK, snapshot)
                case "/" | "/index.html":
                    return Response(
                        HTTPStatus.OK,
                        self._dashboard,
                        HTML_CONTENT_TYPE,
                        headers=(("Content-Security-Policy", DASHBOARD_CSP),),
                    )
                case _:
                    return Response.text(HTTPStatus.NOT_FOUND)
        except Exception:
            log.exception("HTTP %s failed", request.path)
            return Response.text(HTTPStatus.INTERNAL_SERVER_ERROR)
