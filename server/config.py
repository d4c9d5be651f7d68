"""The exchange daemon's configuration: one frozen :class:`DaemonConfig`, loaded in layers.

Precedence, highest first: command-line flags (``--network-memory 128mb``), environment
variables ``EXCHANGE_<SETTING>`` (``EXCHANGE_NETWORK_MEMORY=128mb``), a TOML file named by
``--config FILE`` or ``EXCHANGE_CONFIG`` (keys are the field names, with dashes or
underscores), then the defaults, which are Flink's.

Every value, whatever its source, goes through the one coercer of its setting in ``_SETTINGS``,
and ``DaemonConfig.__post_init__`` runs the same coercers, so a config built in code is checked
exactly like one loaded from the command line. An invalid value raises
:class:`~exchange.errors.ConfigError` naming the setting, quoting the value and saying where it
came from. The file system is only touched by :meth:`DaemonConfig.validate_paths` and
:meth:`DaemonConfig.load_secret`, never at construction.
"""

from __future__ import annotations

import argparse
import difflib
import grp
import logging
import os
import re
import stat
import tempfile
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, Final

from exchange.config_values import (
    format_size,
    is_power_of_two,
    parse_bool,
    parse_duration,
    parse_int,
    parse_size,
)
from exchange.errors import ConfigError
from exchange.partition.bounded_data import BOUNDED_DATA_KINDS, DEFAULT_BOUNDED_DATA_KIND
from exchange.paths import DEFAULT_SOCKET_NAME, default_spill_dir
from exchange.writer.record_writer import MIN_BUFFER_SIZE

#: The data port's write watermarks by default, in segments (256 / 128 KiB at 32 KiB).
#: The queue stops once this much output is pending (in the connection and its
#: transport), so the high one is also the most one ``writelines`` carries: at 2 segments
#: (Flink's Netty setting, where every buffer is a flush of its own anyway) that was a
#: send syscall, and a wake-up of the consumer, per 2 buffers.
DEFAULT_HIGH_WATERMARK_SEGMENTS: Final = 8
DEFAULT_LOW_WATERMARK_SEGMENTS: Final = 4

__all__ = [
    "CONFIG_ENV_VAR",
    "ENV_PREFIX",
    "OTHER_ENV_VARS",
    "DaemonConfig",
    "build_arg_parser",
    "config_from_namespace",
    "default_spill_dir",
    "env_var_name",
    "flag_name",
    "load_config",
    "unknown_env_vars",
]

ENV_PREFIX: Final = "EXCHANGE_"
CONFIG_ENV_VAR: Final = "EXCHANGE_CONFIG"
#: ``EXCHANGE_*`` variables that are no daemon setting but are read: by this loader (the
#: config file) or by tasks (``client/``: their daemon, application, read timeout).
OTHER_ENV_VARS: Final = frozenset(
    {CONFIG_ENV_VAR, "EXCHANGE_DAEMON", "EXCHANGE_APP_ID", "EXCHANGE_READ_TIMEOUT"}
)

log = logging.getLogger("exchange.server.config")

KIB: Final = 1024
MIB: Final = 1024 * KIB

MIN_SEGMENT_SIZE: Final = 4 * KIB
MAX_SEGMENT_SIZE: Final = 16 * MIB
MIN_SEGMENTS: Final = 16
MAX_SECRET_SIZE: Final = 64 * KIB
#: A shorter secret can be guessed offline from one recorded handshake.
MIN_SECRET_SIZE: Final = 16
#: The placeholder ``deploy/k8s/secret.yaml`` ships with (never a real secret).
PLACEHOLDER_SECRETS: Final = frozenset({b"REPLACE-ME-with-openssl-rand-hex-32"})
# sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_UNIX_SOCKET_PATH: Final = 107
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")
_LOG_LEVEL_ALIASES: Final = {"WARN": "WARNING"}
_NONE_WORDS: Final = frozenset({"", "none"})
_UNLIMITED_WORDS: Final = frozenset({"", "none", "unlimited", "-1"})


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything an exchange daemon is configured with. Sizes in bytes, durations in seconds."""

    host: str = "127.0.0.1"
    http_host: str = "127.0.0.1"
    advertise_host: str | None = None
    data_port: int = 0
    http_port: int = 0
    local_socket: str | None = None
    local_socket_group: str | None = None
    local_socket_mode: int = 0o600
    network_memory: int = 64 * MIB
    segment_size: int = 32 * KIB
    exclusive_buffers_per_channel: int = 2
    #: None: each reader's own default (32 for a batch reader, 8 for a streaming one)
    floating_buffers_per_gate: int | None = None
    producer_credit: int = 32
    max_overdraft_buffers_per_partition: int = 5
    high_watermark: int | None = None
    low_watermark: int | None = None
    partition_request_backoff_initial: float = 0.1
    partition_request_backoff_max: float = 10.0
    buffer_timeout: float = 0.1
    max_connections: int = 1024
    max_unauthenticated_connections: int | None = None
    max_unauthenticated_per_peer: int | None = None
    max_requests_per_connection: int = 512
    max_partitions_per_app: int | None = None
    max_pinned_segments_per_app: int | None = None
    max_readers_per_app: int | None = None
    max_reader_memory_per_app: int | None = None
    max_subpartitions_per_partition: int = 1024
    spill_quota_per_app: int | None = None
    spill_min_free: int | None = None
    handshake_timeout: float = 10.0
    peer_timeout: float = 60.0
    spill_dir: str = field(default_factory=default_spill_dir)
    blocking_shuffle_type: str = DEFAULT_BOUNDED_DATA_KIND
    secret_file: str | None = None
    log_level: str = "INFO"
    blocking_partition_ttl: float = 3600.0
    debloat_enabled: bool = False
    debloat_target: float = 1.0
    debloat_period: float = 0.2
    debloat_samples: int = 20
    debloat_threshold_percent: int = 25
    debloat_min_buffer_size: int = 256
    debloat_initial_buffer_size: int | None = None
    checkpoint_alignment_limit: int | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_ca_file: str | None = None
    tls_client_auth: bool = False
    require_tls_remote: bool = False
    shared_memory: bool = True
    shared_memory_per_app: int | None = None
    max_consumer_pins_per_process: int = 128

    def __post_init__(self) -> None:
        for f in fields(self):
            coerced = _SETTINGS[f.name].coerce(getattr(self, f.name), f.name)
            object.__setattr__(self, f.name, coerced)
        self._check_relations()

    def _check_relations(self) -> None:
        """Checks that involve more than one setting."""
        if self.num_segments < MIN_SEGMENTS:
            raise ConfigError(
                "network_memory",
                f"{self.network_memory} bytes ({format_size(self.network_memory)}) hold only "
                f"{self.num_segments} segments of segment_size {format_size(self.segment_size)}; "
                f"at least {MIN_SEGMENTS} are required",
            )
        if self.exclusive_buffers_per_channel > self.num_segments:
            raise ConfigError(
                "exclusive_buffers_per_channel",
                f"{self.exclusive_buffers_per_channel} exceeds the {self.num_segments} segments "
                "of network_memory",
            )
        per_app = self.shared_memory_per_app
        if per_app is not None and per_app < self.segment_size:
            raise ConfigError(
                "shared_memory_per_app",
                f"{per_app} bytes hold no segment of segment_size {self.segment_size}",
            )
        high, low = self.effective_high_watermark, self.effective_low_watermark
        if low >= high:
            # Name the watermark the user set; if both are set, the low one gives way.
            name = "high_watermark" if self.low_watermark is None else "low_watermark"
            raise ConfigError(
                name,
                f"low_watermark ({low} bytes) must be below high_watermark ({high} bytes)",
            )
        if self.partition_request_backoff_initial > self.partition_request_backoff_max:
            raise ConfigError(
                "partition_request_backoff_initial",
                f"{self.partition_request_backoff_initial}s exceeds "
                f"partition_request_backoff_max ({self.partition_request_backoff_max}s)",
            )
        if self.debloat_min_buffer_size > self.segment_size:
            raise ConfigError(
                "debloat_min_buffer_size",
                f"{self.debloat_min_buffer_size} bytes exceeds segment_size "
                f"({self.segment_size} bytes)",
            )
        initial = self.debloat_initial_buffer_size
        if initial is not None and not (
            self.debloat_min_buffer_size <= initial <= self.segment_size
        ):
            raise ConfigError(
                "debloat_initial_buffer_size",
                f"{initial} bytes is outside [debloat_min_buffer_size, segment_size] = "
                f"[{self.debloat_min_buffer_size}, {self.segment_size}]",
            )
        if (self.tls_key_file is None) != (self.tls_cert_file is None):
            missing = "tls_key_file" if self.tls_key_file is None else "tls_cert_file"
            raise ConfigError(
                missing, "TLS needs both tls_cert_file and tls_key_file (set neither for none)"
            )
        if self.tls_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(
                "tls_ca_file", "checks client certificates of a TLS data port: set tls_cert_file"
            )
        if self.tls_client_auth and (self.tls_cert_file is None or self.tls_ca_file is None):
            raise ConfigError(
                "tls_client_auth",
                "requiring client certificates needs TLS (tls_cert_file, tls_key_file) and "
                "the CA that signs them (tls_ca_file)",
            )
        pending = self.max_unauthenticated_connections
        if pending is not None and pending >= self.max_connections:
            raise ConfigError(
                "max_unauthenticated_connections",
                f"{pending} must be below max_connections ({self.max_connections}): "
                "authenticated connections keep the difference as their headroom",
            )
        per_peer = self.max_unauthenticated_per_peer
        if per_peer is not None and per_peer > self.effective_max_unauthenticated:
            raise ConfigError(
                "max_unauthenticated_per_peer",
                f"{self.max_unauthenticated_per_peer} exceeds max_unauthenticated_connections "
                f"({self.effective_max_unauthenticated})",
            )
        if self.local_socket_group is not None and not self.local_socket_mode & 0o070:
            raise ConfigError(
                "local_socket_group",
                f"{self.local_socket_group!r} would get no access: local_socket_mode "
                f"{self.local_socket_mode:04o} grants its group nothing (use 0660)",
            )
        if self.data_port != 0 and self.data_port == self.http_port:
            raise ConfigError(
                "http_port", f"{self.http_port} is also the data_port; use two different ports"
            )

    @property
    def num_segments(self) -> int:
        """Number of segments in the NetworkBufferPool (network_memory // segment_size)."""
        return self.network_memory // self.segment_size

    @property
    def effective_max_unauthenticated(self) -> int:
        """Connections that may be authenticating at once: the setting, or a quarter of
        max_connections (at most 256), so authenticated work keeps the rest."""
        if self.max_unauthenticated_connections is not None:
            return self.max_unauthenticated_connections
        return max(1, min(256, self.max_connections // 4))

    @property
    def effective_max_unauthenticated_per_peer(self) -> int:
        """The setting, or 8 (at most ``effective_max_unauthenticated``)."""
        if self.max_unauthenticated_per_peer is not None:
            return self.max_unauthenticated_per_peer
        return min(8, self.effective_max_unauthenticated)

    @property
    def effective_max_partitions_per_app(self) -> int:
        """Partitions one application may hold; 0 = unlimited. Default 4 per segment of
        network memory (a partition being written needs at least one)."""
        v = self.max_partitions_per_app
        return 4 * self.num_segments if v is None else v

    @property
    def effective_max_pinned_segments_per_app(self) -> int:
        """The sum of the pool maxima of one application's partitions; 0 = unlimited.
        Default: 1.5 x the network memory's segments, so that no partition of one
        application can require the whole pool (a pool's maximum is about twice what it
        requires) and others keep room."""
        v = self.max_pinned_segments_per_app
        return 3 * self.num_segments // 2 if v is None else v

    @property
    def effective_max_readers_per_app(self) -> int:
        """Readers of blocking partitions one application may have open; 0 = unlimited.
        Default: one per segment of network memory."""
        v = self.max_readers_per_app
        return self.num_segments if v is None else v

    @property
    def effective_max_reader_memory_per_app(self) -> int:
        """Bytes of read buffers (outside network memory) one application's readers may
        hold; 0 = unlimited. Default: as much as the network memory."""
        v = self.max_reader_memory_per_app
        return self.network_memory if v is None else v

    @property
    def effective_shared_memory_per_app(self) -> int:
        """Bytes of one application's shared arena, whole segments: the setting, or a
        quarter of network_memory (at least 16 segments)."""
        v = self.shared_memory_per_app
        if v is None:
            v = max(self.network_memory // 4, 16 * self.segment_size)
        return v // self.segment_size * self.segment_size

    @property
    def effective_high_watermark(self) -> int:
        """The write high watermark in bytes; 8 * segment_size unless set."""
        if self.high_watermark is None:
            return DEFAULT_HIGH_WATERMARK_SEGMENTS * self.segment_size
        return self.high_watermark

    @property
    def effective_low_watermark(self) -> int:
        """The write low watermark in bytes; 4 * segment_size unless set."""
        if self.low_watermark is None:
            return DEFAULT_LOW_WATERMARK_SEGMENTS * self.segment_size
        return self.low_watermark

    def resolved_local_socket(self) -> str:
        """The Unix socket path for local tasks; by default ``DEFAULT_SOCKET_NAME`` under
        spill_dir, the path tasks look for when nothing else names their daemon."""
        if self.local_socket is not None:
            return self.local_socket
        return os.path.join(self.spill_dir, DEFAULT_SOCKET_NAME)

    def validate_paths(self) -> None:
        """Create spill_dir if needed and check that it is writable and the socket path usable."""
        spill = self.spill_dir
        try:
            os.makedirs(spill, mode=0o700, exist_ok=True)
        except FileExistsError:
            raise ConfigError("spill_dir", f"{spill!r} exists and is not a directory") from None
        except OSError as exc:
            raise ConfigError("spill_dir", f"{spill!r} cannot be created: {exc}") from None
        if not os.path.isdir(spill):
            raise ConfigError("spill_dir", f"{spill!r} is not a directory")
        # Probe by creating a file: os.access() says yes to root and ignores read-only mounts.
        try:
            fd, probe = tempfile.mkstemp(prefix=".exchange-probe-", dir=spill)
        except OSError as exc:
            raise ConfigError("spill_dir", f"{spill!r} is not writable: {exc}") from None
        os.close(fd)
        os.unlink(probe)

        sock = self.resolved_local_socket()
        derived = " (derived from spill_dir)" if self.local_socket is None else ""
        if len(os.fsencode(sock)) > MAX_UNIX_SOCKET_PATH:
            raise ConfigError(
                "local_socket",
                f"{sock!r}{derived} is {len(os.fsencode(sock))} bytes long; Unix socket paths "
                f"are limited to {MAX_UNIX_SOCKET_PATH} bytes",
            )
        parent = os.path.dirname(sock) or "."
        if not os.path.isdir(parent):
            raise ConfigError("local_socket", f"{sock!r}: directory {parent!r} does not exist")
        if os.path.lexists(sock) and not stat.S_ISSOCK(os.lstat(sock).st_mode):
            raise ConfigError("local_socket", f"{sock!r} exists and is not a socket")
        self.local_socket_gid()

    def local_socket_gid(self) -> int | None:
        """The gid of local_socket_group (a numeric gid is taken as it is: a container's
        group need not be named in the daemon's /etc/group); None when unset."""
        group = self.local_socket_group
        if group is None:
            return None
        if group.isdigit():
            return int(group)
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(
                "local_socket_group", f"no group {group!r} on this host (give its gid instead)"
            ) from None

    def load_secret(self) -> bytes | None:
        """Read the shared secret from secret_file (trailing newlines stripped); None if unset.

        Refuses a missing, empty, oversized or non-regular file, and one that other users may
        read or write (it must be like ``chmod 600``).
        """
        path = self.secret_file
        if path is None:
            return None
        try:
            # stat before open: opening a FIFO would block.
            if not stat.S_ISREG(os.stat(path).st_mode):
                raise ConfigError("secret_file", f"{path!r} is not a regular file")
            with open(path, "rb") as fh:
                check_private_file("secret_file", path, os.fstat(fh.fileno()).st_mode)
                data = fh.read(MAX_SECRET_SIZE + 1)
        except FileNotFoundError:
            raise ConfigError("secret_file", f"{path!r} does not exist") from None
        except OSError as exc:
            raise ConfigError("secret_file", f"{path!r} cannot be read: {exc}") from None
        if len(data) > MAX_SECRET_SIZE:
            raise ConfigError("secret_file", f"{path!r} is larger than {MAX_SECRET_SIZE} bytes")
        secret = data.rstrip(b"\r\n")
        if not secret:
            raise ConfigError("secret_file", f"{path!r} is empty")
        if len(secret) < MIN_SECRET_SIZE:
            raise ConfigError(
                "secret_file",
                f"{path!r} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_SIZE} "
                "(make one with: openssl rand -hex 32)",
            )
        if secret in PLACEHOLDER_SECRETS:
            raise ConfigError(
                "secret_file",
                f"{path!r} holds the placeholder of deploy/k8s/secret.yaml, not a secret; "
                "create one with: openssl rand -hex 32",
            )
        return secret

    def to_dict(self) -> dict[str, object]:
        """The effective settings by field name, for printing; the secret itself is never read."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def check_private_file(setting: str, path: str, mode: int) -> None:
    """ConfigError naming ``setting`` unless the file of ``mode`` is its owner's only
    (no group or other permission at all: ``chmod 600`` or ``400``)."""
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            setting,
            f"{path!r} is accessible by other users or its group (mode "
            f"{stat.filemode(mode)}); restrict it with chmod 600",
        )


# --- one coercer per setting -------------------------------------------------------------

_Coerce = Callable[[Any, str], Any]


@dataclass(frozen=True, slots=True)
class _Setting:
    coerce: _Coerce
    toml_types: tuple[type, ...]
    metavar: str
    help: str


def _host(value: Any, setting: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(setting, f"{value!r} is not a string")
    if not value or len(value) > 253 or any(c.isspace() or not c.isprintable() for c in value):
        raise ConfigError(setting, f"{value!r} is not a host name or address")
    return value


#: Addresses that mean "every interface": a consumer cannot dial them.
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", "[::]", "*"})


def _optional_advertise_host(value: Any, setting: str) -> str | None:
    if value is None or value == "":
        return None
    host = _host(value, setting)
    if host in WILDCARD_HOSTS:
        raise ConfigError(
            setting, f"{value!r} means every interface; consumers need one name or address"
        )
    return host


_GROUP_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}")


def _optional_group(value: Any, setting: str) -> str | None:
    """A group name or a numeric gid, kept as text; looked up by ``socket_gid``."""
    if value is None or value == "":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if isinstance(value, str):
        text = value.strip()
        if (text.isdigit() and int(text) < 2**32 - 1) or _GROUP_NAME.fullmatch(text):
            return text
    raise ConfigError(setting, f"{value!r} is not a group name or numeric gid")


def _socket_mode(value: Any, setting: str) -> int:
    """A socket file mode: octal text (``0660``, ``0o660``) or an int; owner rw required,
    group access only with write (connecting needs it), nothing for other users."""
    mode = value
    if isinstance(value, str):
        text = value.strip().lower().removeprefix("0o")
        mode = int(text, 8) if text and set(text) <= set("01234567") else None
    if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
        raise ConfigError(setting, f"{value!r} is not an octal file mode such as 0600 or 0660")
    if mode & 0o007:
        raise ConfigError(
            setting,
            f"{mode:04o} lets every local user connect; give access through "
            "local_socket_group (0660) instead",
        )
    if mode & 0o600 != 0o600:
        raise ConfigError(setting, f"{mode:04o} must give the daemon's user read and write (0600)")
    if mode & 0o070 and not mode & 0o020:
        raise ConfigError(
            setting, f"{mode:04o}: connecting to a socket needs write permission (use 0660)"
        )
    return mode


def _path(value: Any, setting: str) -> str:
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str):
        raise ConfigError(setting, f"{value!r} is not a path")
    if not value or "\0" in value:
        raise ConfigError(setting, f"{value!r} is not a usable path")
    return os.path.expanduser(value)


def _optional_path(value: Any, setting: str) -> str | None:
    if value is None or value == "":
        return None
    return _path(value, setting)


def _int(minimum: int, maximum: int | None = None) -> _Coerce:
    def coerce(value: Any, setting: str) -> int:
        return parse_int(value, setting, minimum=minimum, maximum=maximum)

    return coerce


def _optional_int(minimum: int) -> _Coerce:
    required = _int(minimum)

    def coerce(value: Any, setting: str) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE_WORDS):
            return None
        result: int = required(value, setting)
        return result

    return coerce


def _size(minimum: int, maximum: int | None = None, power_of_two: bool = False) -> _Coerce:
    def coerce(value: Any, setting: str) -> int:
        size = parse_size(value, setting)
        if size < minimum:
            raise ConfigError(setting, f"{value!r} is below the minimum of {format_size(minimum)}")
        if maximum is not None and size > maximum:
            raise ConfigError(setting, f"{value!r} exceeds the maximum of {format_size(maximum)}")
        if power_of_two and not is_power_of_two(size):
            raise ConfigError(setting, f"{value!r} ({size} bytes) is not a power of two")
        return size

    return coerce


def _optional_size(minimum: int, none_words: frozenset[str] = _NONE_WORDS) -> _Coerce:
    required = _size(minimum)

    def coerce(value: Any, setting: str) -> int | None:
        if value is None or (isinstance(value, str) and value.strip().lower() in none_words):
            return None
        if value == -1 and "-1" in none_words and not isinstance(value, bool):
            return None
        result: int = required(value, setting)
        return result

    return coerce


def _duration(positive: bool, allow_negative_one: bool = False) -> _Coerce:
    def coerce(value: Any, setting: str) -> float:
        seconds = parse_duration(value, setting, allow_negative_one=allow_negative_one)
        if positive and seconds <= 0:
            raise ConfigError(setting, f"{value!r} must be a positive duration")
        return seconds

    return coerce


def _bool(value: Any, setting: str) -> bool:
    return parse_bool(value, setting)


def _blocking_shuffle_type(value: Any, setting: str) -> str:
    if isinstance(value, str) and value.strip().lower() in BOUNDED_DATA_KINDS:
        return value.strip().lower()
    raise ConfigError(
        setting,
        f"{value!r} is not a blocking shuffle type; "
        f"expected one of {', '.join(BOUNDED_DATA_KINDS)}",
    )


def _log_level(value: Any, setting: str) -> str:
    if isinstance(value, str):
        level = value.strip().upper()
        level = _LOG_LEVEL_ALIASES.get(level, level)
        if level in LOG_LEVELS:
            return level
    raise ConfigError(
        setting, f"{value!r} is not a log level; expected one of {', '.join(LOG_LEVELS)}"
    )


_STR: Final[tuple[type, ...]] = (str,)
_INT: Final[tuple[type, ...]] = (int,)
_SIZE: Final[tuple[type, ...]] = (int, str)
_DURATION: Final[tuple[type, ...]] = (int, float, str)

_SETTINGS: Final[dict[str, _Setting]] = {
    "host": _Setting(_host, _STR, "HOST", "address the data port binds to"),
    "http_host": _Setting(
        _host,
        _STR,
        "HOST",
        "address the HTTP port (/metrics, /healthz, dashboard) binds to; loopback by default",
    ),
    "advertise_host": _Setting(
        _optional_advertise_host,
        _STR,
        "HOST",
        "name or address remote consumers dial; unset: host, or for a wildcard host this "
        "host's name when it resolves to a non-loopback address (else the daemon refuses "
        "to start)",
    ),
    "data_port": _Setting(
        _int(0, 65535), _INT, "PORT", "TCP port for remote consumers; 0 lets the OS pick"
    ),
    "http_port": _Setting(
        _int(0, 65535), _INT, "PORT", "HTTP port for /metrics and the dashboard; 0 = OS picks"
    ),
    "local_socket": _Setting(
        _optional_path,
        _STR,
        "PATH",
        f"Unix socket for tasks on this host ({DEFAULT_SOCKET_NAME} in spill_dir unless set)",
    ),
    "local_socket_group": _Setting(
        _optional_group,
        _STR + _INT,
        "GROUP",
        "group (name or gid) the local socket is given to; its members connect when "
        "local_socket_mode grants the group access (e.g. Spark's gid 185 in Kubernetes)",
    ),
    "local_socket_mode": _Setting(
        _socket_mode,
        _STR + _INT,
        "MODE",
        "file mode of the local socket, octal: 0600 (the daemon's user only) or 0660 "
        "(and its group); never other users",
    ),
    "network_memory": _Setting(
        _size(1), _SIZE, "SIZE", "memory of the NetworkBufferPool, e.g. 64mb"
    ),
    "segment_size": _Setting(
        _size(MIN_SEGMENT_SIZE, MAX_SEGMENT_SIZE, power_of_two=True),
        _SIZE,
        "SIZE",
        "size of one network buffer: a power of two from 4kb to 16mb",
    ),
    "exclusive_buffers_per_channel": _Setting(
        _int(1), _INT, "N", "buffers each remote input channel owns (at least 1)"
    ),
    "floating_buffers_per_gate": _Setting(
        _optional_int(0),
        _INT,
        "N",
        "buffers an input gate shares among its channels; default: 32 for a batch reader, "
        "8 (Flink's) for a streaming one",
    ),
    "producer_credit": _Setting(
        _int(1, 1024),
        _INT,
        "N",
        "segments a producer task may have in flight to this daemon (its credit window)",
    ),
    "max_overdraft_buffers_per_partition": _Setting(
        _int(0, 1024),
        _INT,
        "N",
        "segments a backpressured producer may take beyond its partition's pool to finish "
        "a record that spans buffers (Flink's overdraft buffers; 0: none)",
    ),
    "high_watermark": _Setting(
        _optional_size(1), _SIZE, "SIZE", "write high watermark; default 8 x segment_size"
    ),
    "low_watermark": _Setting(
        _optional_size(0), _SIZE, "SIZE", "write low watermark; default 4 x segment_size"
    ),
    "partition_request_backoff_initial": _Setting(
        _duration(positive=True), _DURATION, "DURATION", "first retry delay of a partition request"
    ),
    "partition_request_backoff_max": _Setting(
        _duration(positive=True),
        _DURATION,
        "DURATION",
        "longest retry delay of a partition request",
    ),
    "buffer_timeout": _Setting(
        _duration(positive=False, allow_negative_one=True),
        _DURATION,
        "DURATION",
        "flush interval of partly filled buffers; 0 = every record, -1 = only full buffers",
    ),
    "max_connections": _Setting(_int(1), _INT, "N", "most TCP connections served at once"),
    "max_unauthenticated_connections": _Setting(
        _optional_int(1),
        _INT,
        "N",
        "data-port connections that may be authenticating at once (TLS and handshake), below "
        "max_connections; default a quarter of max_connections, at most 256",
    ),
    "max_unauthenticated_per_peer": _Setting(
        _optional_int(1),
        _INT,
        "N",
        "data-port connections one peer address may have authenticating at once; default 8 "
        "(at most max_unauthenticated_connections)",
    ),
    "max_requests_per_connection": _Setting(
        _int(1), _INT, "N", "partition requests open at once on one connection"
    ),
    "max_partitions_per_app": _Setting(
        _optional_int(0),
        _INT,
        "N",
        "partitions one application may hold at once; 0 = unlimited; "
        "default 4 x the segments of network_memory",
    ),
    "max_pinned_segments_per_app": _Setting(
        _optional_int(0),
        _INT,
        "N",
        "segments the partitions of one application may pin (the sum of their pools' "
        "maximum sizes); 0 = unlimited; default 1.5 x the segments of network_memory",
    ),
    "max_readers_per_app": _Setting(
        _optional_int(0),
        _INT,
        "N",
        "readers of blocking partitions one application may have open at once; "
        "0 = unlimited; default the segments of network_memory",
    ),
    "max_reader_memory_per_app": _Setting(
        _optional_size(0),
        _SIZE,
        "SIZE",
        "read buffers (outside network memory) one application's readers may hold; "
        "0 = unlimited; default network_memory",
    ),
    "max_subpartitions_per_partition": _Setting(
        _int(1),
        _INT,
        "N",
        "subpartitions one CreatePartition may ask for (a blocking one keeps a file each)",
    ),
    "spill_quota_per_app": _Setting(
        _optional_size(0),
        _SIZE,
        "SIZE",
        "bytes one application's blocking partitions may fill in spill_dir; 0 = unlimited; "
        "default half the size of spill_dir's file system",
    ),
    "spill_min_free": _Setting(
        _optional_size(0),
        _SIZE,
        "SIZE",
        "free space spill_dir's file system keeps: spills stop below it; 0 = none; "
        "default 5% of the file system, at most 1 GiB",
    ),
    "handshake_timeout": _Setting(
        _duration(positive=True), _DURATION, "DURATION", "time a new connection has to authenticate"
    ),
    "peer_timeout": _Setting(
        _duration(positive=False),
        _DURATION,
        "DURATION",
        "drop a client that leaves a keepalive Ping unanswered this long (it stopped reading "
        "or stopped mid-frame) and release its buffers; 0 = never",
    ),
    "spill_dir": _Setting(
        _path, _STR, "DIR", "directory for spilled and blocking partitions (created if missing)"
    ),
    "blocking_shuffle_type": _Setting(
        _blocking_shuffle_type,
        _STR,
        "TYPE",
        "how a finished blocking partition is read (Flink's "
        "taskmanager.network.blocking-shuffle.type): file (default) reads each buffer into "
        "a read segment (two to eight per reader); mmap sends slices of its mapped files "
        "(no read copy, no read segments; a spill file truncated or unreadable under it is "
        "a SIGBUS of the daemon); a restored partition keeps the type it was written with",
    ),
    "secret_file": _Setting(
        _optional_path, _STR, "FILE", "file holding the shared secret (chmod 600)"
    ),
    "log_level": _Setting(_log_level, _STR, "LEVEL", f"one of {', '.join(LOG_LEVELS)}"),
    "blocking_partition_ttl": _Setting(
        _duration(positive=False),
        _DURATION,
        "DURATION",
        "lifetime of a blocking partition nobody releases; 0 = keep until released",
    ),
    "debloat_enabled": _Setting(
        _bool, (bool,), "BOOL", "adapt buffer sizes to keep in-flight data near debloat_target"
    ),
    "debloat_target": _Setting(
        _duration(positive=True), _DURATION, "DURATION", "in-flight data the debloater aims at"
    ),
    "debloat_period": _Setting(
        _duration(positive=True), _DURATION, "DURATION", "how often the buffer size is recomputed"
    ),
    "debloat_samples": _Setting(
        _int(1), _INT, "N", "throughput samples in the debloater's moving average"
    ),
    "debloat_threshold_percent": _Setting(
        _int(0, 100), _INT, "PERCENT", "smallest size change (percent) worth announcing"
    ),
    "debloat_min_buffer_size": _Setting(
        _size(MIN_BUFFER_SIZE),
        _SIZE,
        "SIZE",
        "smallest buffer size the debloater announces (at least 256 B, the smallest buffer "
        "a producer cuts)",
    ),
    "debloat_initial_buffer_size": _Setting(
        _optional_size(1),
        _SIZE,
        "SIZE",
        "buffer size the debloater starts from; default 1 KiB (clamped to the segment size)",
    ),
    "checkpoint_alignment_limit": _Setting(
        _optional_size(1, _UNLIMITED_WORDS),
        _SIZE,
        "SIZE",
        "most bytes buffered while aligning a checkpoint; default unlimited",
    ),
    "tls_cert_file": _Setting(
        _optional_path, _STR, "FILE", "PEM certificate (chain) of the data port; enables TLS"
    ),
    "tls_key_file": _Setting(
        _optional_path, _STR, "FILE", "PEM private key of tls_cert_file (chmod 600)"
    ),
    "tls_ca_file": _Setting(
        _optional_path, _STR, "FILE", "PEM CA bundle that client certificates must chain to"
    ),
    "tls_client_auth": _Setting(
        _bool,
        (bool,),
        "BOOL",
        "require a client certificate signed by tls_ca_file (mutual TLS)",
    ),
    "require_tls_remote": _Setting(
        _bool,
        (bool,),
        "BOOL",
        "refuse data-port connections without TLS from peers that are not on loopback",
    ),
    "shared_memory": _Setting(
        _bool,
        (bool,),
        "BOOL",
        "producer tasks on this host write into a shared arena of their application "
        "(memfd, else /dev/shm) instead of pushing bytes over the Unix socket; off: the "
        "socket",
    ),
    "shared_memory_per_app": _Setting(
        _optional_size(1),
        _SIZE,
        "SIZE",
        "the shared arena of one application (its local producers' partitions); "
        "default network_memory / 4, at least 16 segments",
    ),
    "max_consumer_pins_per_process": _Setting(
        _int(0),
        _INT,
        "N",
        "shared segments kept out of the pool for one live consumer process whose "
        "connections the daemon dropped (it may still read them); once it has this many, "
        "its connections read over the socket until it exits; 0 = unlimited",
    ),
}

# A setting without a flag or coercer would be silently unconfigurable.
assert list(_SETTINGS) == [f.name for f in fields(DaemonConfig)]


# --- loading -----------------------------------------------------------------------------


#: Boolean settings: flags ``--x`` / ``--no-x`` (argparse.BooleanOptionalAction).
_BOOL_FLAGS: Final = {
    "debloat_enabled": "--debloat",
    "tls_client_auth": "--tls-client-auth",
    "require_tls_remote": "--require-tls-remote",
    "shared_memory": "--shared-memory",
}


def flag_name(setting: str) -> str:
    """The command-line flag of a setting: ``network_memory`` -> ``--network-memory``."""
    return _BOOL_FLAGS.get(setting) or "--" + setting.replace("_", "-")


def env_var_name(setting: str) -> str:
    """The environment variable of a setting: ``network_memory`` -> ``EXCHANGE_NETWORK_MEMORY``."""
    return ENV_PREFIX + setting.upper()


def _default_text(f: Field[Any]) -> str:
    """The default ``--help`` shows: the value the daemon really takes when nothing is set."""
    if f.name == "local_socket":  # derived from spill_dir's default
        return DaemonConfig().resolved_local_socket()
    if f.name == "local_socket_mode":
        return f"{f.default:04o}"
    if f.default_factory is not MISSING:
        return str(f.default_factory())
    if f.default is None:
        return "none"
    if _SETTINGS[f.name].toml_types is _SIZE and isinstance(f.default, int):
        return format_size(f.default)
    return str(f.default)


def build_arg_parser() -> argparse.ArgumentParser:
    """The daemon's argument parser: ``--config FILE`` and one flag per setting.

    Flags keep their raw strings (every default is suppressed), so :func:`config_from_namespace`
    can tell a given flag from an absent one and report bad values as ``ConfigError``.
    """
    parser = argparse.ArgumentParser(
        prog="exchange-daemon",
        description="Exchange daemon: serves result partitions to PySpark tasks.",
        epilog=(
            f"Each setting can also be set by an environment variable {ENV_PREFIX}<SETTING> "
            "or a key in the TOML config file. Flags override the environment, which overrides "
            "the file. Sizes take units (32kb, 64 MiB, 1g); durations too (100ms, 10s, 2m)."
        ),
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML file with settings [env {CONFIG_ENV_VAR}]",
    )
    for f in fields(DaemonConfig):
        spec = _SETTINGS[f.name]
        suffix = f" [env {env_var_name(f.name)}; default: {_default_text(f)}]"
        help_text = (spec.help + suffix).replace("%", "%%")
        if f.name in _BOOL_FLAGS:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                metavar=spec.metavar,
                default=argparse.SUPPRESS,
                help=help_text,
            )
    return parser


def load_config(argv: Sequence[str] | None, env: Mapping[str, str] | None = None) -> DaemonConfig:
    """Build the daemon's config from flags (``argv``; None = ``sys.argv[1:]``), env and file.

    ``env`` defaults to ``os.environ``. Malformed command lines and ``--help`` exit the way
    argparse does; every invalid value raises ``ConfigError``.
    """
    args = build_arg_parser().parse_args(argv)
    return config_from_namespace(args, os.environ if env is None else env)


def config_from_namespace(args: argparse.Namespace, env: Mapping[str, str]) -> DaemonConfig:
    """Build the config from a namespace parsed by (an extension of) :func:`build_arg_parser`.

    Attributes that are not settings are ignored, so a caller may add flags of its own.
    """
    for warning in unknown_env_vars(env):
        log.warning("%s", warning)
    values: dict[str, Any] = {}
    config_file = getattr(args, "config", None) or env.get(CONFIG_ENV_VAR) or None
    if config_file is not None:
        values.update(_read_config_file(config_file))
    for name, spec in _SETTINGS.items():
        raw = env.get(env_var_name(name), "")
        if raw != "":  # an empty variable counts as unset
            values[name] = _coerce(spec, raw, name, f"environment variable {env_var_name(name)}")
    for name, spec in _SETTINGS.items():
        if hasattr(args, name):
            flag = flag_name(name)
            source = f"{flag}/--no-{flag[2:]}" if name in _BOOL_FLAGS else flag
            values[name] = _coerce(spec, getattr(args, name), name, source)
    return DaemonConfig(**values)


def unknown_env_vars(env: Mapping[str, str]) -> list[str]:
    """A warning for each ``EXCHANGE_*`` variable in ``env`` that nothing reads (a typo
    would otherwise be ignored without a word), naming the closest known variable."""
    known = {env_var_name(name) for name in _SETTINGS} | OTHER_ENV_VARS
    warnings = []
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            warnings.append(f"environment variable {name} is not a setting, ignored{hint}")
    return warnings


def _coerce(spec: _Setting, value: Any, setting: str, source: str) -> Any:
    try:
        return spec.coerce(value, setting)
    except ConfigError as exc:
        detail = str(exc).removeprefix(f"invalid value for {exc.setting!r}: ")
        raise ConfigError(exc.setting, f"{detail} (from {source})") from None


def _read_config_file(path: str) -> dict[str, Any]:
    """Read a TOML config file into coerced values by field name."""
    try:
        with open(path, "rb") as fh:
            document = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"config file {path!r} does not exist") from None
    except OSError as exc:
        raise ConfigError("config", f"config file {path!r} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"config file {path!r} is not valid TOML: {exc}") from None

    values: dict[str, Any] = {}
    seen: dict[str, str] = {}
    for key, value in document.items():
        name = key.replace("-", "_")
        spec = _SETTINGS.get(name)
        if spec is None:
            close = difflib.get_close_matches(name, list(_SETTINGS), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(key, f"unknown setting {key!r} in config file {path!r}{hint}")
        if name in seen:
            raise ConfigError(
                name, f"set twice in config file {path!r}, as {seen[name]!r} and {key!r}"
            )
        seen[name] = key
        source = f"key {key!r} in config file {path!r}"
        wrong_bool = isinstance(value, bool) and bool not in spec.toml_types
        if wrong_bool or not isinstance(value, spec.toml_types):
            expected = " or ".join(t.__name__ for t in spec.toml_types)
            raise ConfigError(
                name,
                f"{value!r} has TOML type {type(value).__name__}, expected {expected} ({source})",
            )
        values[name] = _coerce(spec, value, name, source)
    return values
