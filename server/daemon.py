"""ExchangeDaemon: one per executor host; owns the network memory and the partitions.

It hosts the NetworkBufferPool, the ResultPartitionManager, the data port (remote
consumers), the local endpoint (tasks on this host) and the HTTP port (/metrics, /healthz,
dashboard). Blocking partitions are released explicitly (per exchange) or after their
time to live. ``shutdown`` stops accepting work, lets in-flight streams finish for a grace
period, fails what is left (consumers get a typed error, never a silent short read),
and checks that every segment came back.

Restarts: every partition keeps a manifest in the spill directory
(``exchange.partition.partition_manifest``). At startup, before any port opens, the
daemon reads the manifests its predecessor left: finished blocking partitions whose spill
files are intact are served again (their time to live counted from when they were
finished); those whose files are missing, truncated or corrupt are refused (readers get a
PartitionDataLostError naming the file); partitions that were still being written or
were pipelined died with the old daemon (readers get a ProducerFailedError instead of
retrying a partition that will never come). A clean shutdown keeps finished blocking
partitions on disk for the next daemon (an upgrade loses none of them). Checking the
files reads each once, so startup takes longer the more data the old daemon left.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import os
import resource
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Final

from exchange.addresses import format_address
from exchange.errors import (
    ConfigError,
    CorruptRecordError,
    ExchangeError,
    LimitExceededError,
    PartitionDataLostError,
    PartitionReleasedError,
    ProducerFailedError,
)
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.partition_manifest import (
    ManifestState,
    PartitionManifest,
    delete_partition_files,
    manifest_key,
    orphan_spill_files,
    read_manifest,
    scan_manifests,
    verify_spilled_data,
)
from exchange.partition.reader_budget import ReaderBudget
from exchange.partition.result_partition import ResultPartition
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.partition.spill_space import SpillSpace
from exchange.protocol.codec import max_frame_size_for
from exchange.protocol.local_messages import DaemonInfo
from server.config import WILDCARD_HOSTS, DaemonConfig, env_var_name
from server.http_server import DEFAULT_MAX_CONNECTIONS, HARD_LIMIT_FACTOR, HttpServer
from server.jobs import JobView
from server.local_endpoint import LocalEndpoint
from server.metrics import TaskReport
from server.partition_request_server import DataServer, is_loopback
from server.shared_arenas import SharedArenas
from server.spill_dir import SpillDirectory
from server.tls import server_ssl_context

__all__ = ["ExchangeDaemon"]

log = logging.getLogger("exchange.server.daemon")

GIB: Final = 1 << 30


class ExchangeDaemon:
    """The exchange daemon's state and servers."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.daemon_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.segment_size = config.segment_size
        self.network_pool = NetworkBufferPool(config.num_segments, config.segment_size)
        #: each application's shared arena, for its producer tasks on this host
        self.shared_arenas = SharedArenas(config)
        self.manager = ResultPartitionManager()
        self.started_at = time.time()
        self.shutting_down = False
        self.data_address = ""
        self.http_address = ""
        self.local_socket = ""
        self.tls = False
        self._secret = config.load_secret()
        #: spill_dir, checked and locked at start; the daemon's files are in its
        #: ``partitions`` subdirectory (``server.spill_dir``).
        self.spill = SpillDirectory(config.spill_dir)
        self.partition_dir = self.spill.partitions
        # with a secret, manifests carry an HMAC: forged ones are refused at restart
        self._manifest_key = manifest_key(self._secret) if self._secret is not None else None
        #: bytes each application's blocking partitions may spill (set up at start: the
        #: defaults depend on the spill directory's file system)
        self.spill_space = SpillSpace(self.partition_dir)
        self.reader_budget = ReaderBudget(
            config.effective_max_readers_per_app, config.effective_max_reader_memory_per_app
        )
        common: dict[str, Any] = dict(
            segment_size=config.segment_size,
            secret=self._secret,
            high_watermark=config.effective_high_watermark,
            low_watermark=config.effective_low_watermark,
            max_connections=config.max_connections,
            max_requests=config.max_requests_per_connection,
            handshake_timeout=config.handshake_timeout,
            peer_timeout=config.peer_timeout or None,
            release_dataset=self.release_dataset,
        )
        self.data_server = DataServer(
            self.manager,
            max_unauthenticated=config.effective_max_unauthenticated,
            max_unauthenticated_per_peer=config.effective_max_unauthenticated_per_peer,
            require_tls_remote=config.require_tls_remote,
            **common,
        )
        self.local_endpoint = LocalEndpoint(
            self, max_frame_size=max_frame_size_for(config.segment_size), **common
        )
        self.http: HttpServer | None = None
        #: (application, partition id) -> when its blocking partition was finished
        self._finished_at: dict[tuple[str, ResultPartitionID], float] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._stopped = asyncio.Event()
        # cumulative counters (survive partition release)
        self.bytes_in = 0
        self.partitions_created = 0
        self.partitions_released = 0
        self.partitions_failed = 0
        self._released_bytes_out = 0
        self._released_buffers_out = 0
        self._released_back_pressure = 0.0
        #: What startup found of the previous daemon's partitions.
        self.recovered = {"restored": 0, "refused": 0, "failed": 0, "expired": 0}

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Start every server; returns the ready line's fields."""
        self.spill.open()  # ConfigError: a foreign or open spill_dir, or another daemon's
        try:
            return await self._start()
        except BaseException:
            self.spill.close()
            raise

    async def _start(self) -> dict[str, Any]:
        cfg = self.config
        cfg.validate_paths()
        advertise = advertised_host(cfg)  # refused before any port opens
        ssl_context = server_ssl_context(cfg)
        ensure_fd_limit(cfg)
        self._set_up_spill_space()
        self.recover_partitions()
        bound, port = await self.data_server.start(cfg.host, cfg.data_port, ssl_context)
        if cfg.advertise_host is None and cfg.host not in WILDCARD_HOSTS:
            # the address the name given to host bound
            advertise = bound
        self.tls = ssl_context is not None
        if not is_loopback(bound) and self._secret is None and not self.tls:
            log.warning(
                "the data port listens on %s with neither a secret nor TLS: anyone who reaches "
                "it can read every partition and feed records that consumer tasks unpickle; "
                "set --secret-file and TLS, or bind --host to loopback",
                bound,
            )
        self.data_address = format_address(advertise, port)
        self.local_socket = await self.local_endpoint.start_unix(
            cfg.resolved_local_socket(), mode=cfg.local_socket_mode, gid=cfg.local_socket_gid()
        )
        self.http = HttpServer(self)
        hh, hp = await self.http.start(cfg.http_host, cfg.http_port)
        self.http_address = format_address(hh, hp)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        return self.ready_info()

    def _set_up_spill_space(self) -> None:
        """Apply spill_quota_per_app and spill_min_free, whose defaults are fractions of
        the spill directory's file system."""
        cfg = self.config
        st = os.statvfs(self.partition_dir)
        fs_size = st.f_blocks * st.f_frsize
        quota = fs_size // 2 if cfg.spill_quota_per_app is None else cfg.spill_quota_per_app
        floor = min(fs_size // 20, GIB) if cfg.spill_min_free is None else cfg.spill_min_free
        self.spill_space.quota = quota or None
        self.spill_space.min_free = floor
        log.info(
            "spilling to %s: %s per application, keeping %d bytes free",
            self.partition_dir,
            f"{quota} bytes" if quota else "no limit",
            floor,
        )

    def ready_info(self) -> dict[str, Any]:
        return {
            "event": "ready",
            "daemon_id": self.daemon_id,
            "pid": os.getpid(),
            "data": self.data_address,
            "http": self.http_address,
            "local_socket": self.local_socket,
            "segment_size": self.segment_size,
            "segments": self.network_pool.total_segments,
            "recovered": dict(self.recovered),
            "tls": self.tls,
        }

    #: The settings tasks on this host take from their daemon (``DaemonInfo.settings``).
    TASK_SETTINGS = (
        "exclusive_buffers_per_channel",
        "floating_buffers_per_gate",
        "partition_request_backoff_initial",
        "partition_request_backoff_max",
        "buffer_timeout",
        "debloat_enabled",
        "debloat_target",
        "debloat_period",
        "debloat_samples",
        "debloat_threshold_percent",
        "debloat_min_buffer_size",
        "debloat_initial_buffer_size",
        "checkpoint_alignment_limit",
    )

    def info(self) -> DaemonInfo:
        """Who this daemon is and the settings its tasks use."""
        cfg = self.config
        return DaemonInfo(
            self.daemon_id,
            self.data_address,
            self.segment_size,
            {name: getattr(cfg, name) for name in self.TASK_SETTINGS},
        )

    def request_stop(self) -> None:
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def shutdown(self, grace: float = 5.0) -> bool:
        """Stop cleanly; True if every segment came back to the pool."""
        self.shutting_down = True
        self.data_server.stop_accepting()
        self.local_endpoint.stop_accepting()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._streams_in_flight():
            await asyncio.sleep(0.05)
        leftover = self._streams_in_flight()
        if leftover:
            log.warning("shutdown: failing %d unfinished stream(s)", leftover)
        for part in self.manager.partitions:
            part.keep_spilled_data()  # finished blocking partitions wait for the next daemon
        self.manager.release_all(ProducerFailedError("the exchange daemon is shutting down"))
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        await self.local_endpoint.close()
        await self.data_server.close()
        if self.http is not None:
            await self.http.close()
        await asyncio.sleep(0)
        self.network_pool.check_consistency()
        whole = self.network_pool.is_whole()
        if not whole:
            log.error("shutdown: network pool not whole: %s", self.network_pool.stats())
        self.network_pool.destroy()
        whole = self.shared_arenas.close() and whole
        self.spill.close()  # the next daemon may take over what is left
        return whole

    def _streams_in_flight(self) -> int:
        """Partitions still being written, or pipelined ones still being read."""
        n = 0
        for p in self.manager.partitions:
            if not p.is_finished or (p.partition_type.is_pipelined and not p.is_released):
                n += 1
        return n

    # -- partitions ----------------------------------------------------------------------

    def create_partition(
        self,
        pid: ResultPartitionID,
        ptype: ResultPartitionType,
        num_subpartitions: int,
        *,
        app_id: str = "",
        network_pool: NetworkBufferPool | None = None,
    ) -> ResultPartition:
        """A new partition of application ``app_id`` (only its connections may use it),
        its segments from ``network_pool`` (the application's shared arena) or the
        daemon's own pool.

        LimitExceededError when it has more subpartitions than
        ``max_subpartitions_per_partition`` or ``app_id`` would exceed
        ``max_partitions_per_app`` or ``max_pinned_segments_per_app``; other applications
        are not concerned. SpillError when a blocking one may not spill (the
        application's spill quota is used up, the disk's free space below the floor).
        """
        limit = self.config.max_subpartitions_per_partition
        if num_subpartitions > limit:
            raise LimitExceededError(
                f"a partition of {num_subpartitions} subpartitions",
                pid,
                setting="max_subpartitions_per_partition",
                limit=limit,
            )
        max_segments = max(num_subpartitions * 2 + 8, 16)
        nbp = self.network_pool if network_pool is None else network_pool
        if num_subpartitions <= nbp.total_segments - nbp.num_required:
            self._check_app_limits(pid, app_id, max_segments)
        # else the pool cannot be had at all: InsufficientBuffersError names network_memory
        pool = nbp.create_buffer_pool(
            num_subpartitions, max_segments, self.config.max_overdraft_buffers_per_partition
        )
        try:
            part = ResultPartition(
                pid,
                ptype,
                num_subpartitions,
                pool,
                spill_dir=self.partition_dir,
                keep_manifest=True,
                bounded_data_kind=self.config.blocking_shuffle_type,
                app_id=app_id,
                spill_account=self.spill_space.account(app_id) if ptype.is_blocking else None,
                manifest_key=self._manifest_key,
                reader_account=self.reader_budget.account(app_id),
            )
        except BaseException:
            pool.destroy()
            raise
        try:
            self.manager.register_result_partition(part)
        except BaseException:
            part.release()  # its manifest and pool go
            raise
        part.add_release_listener(self._on_partition_released)
        self.partitions_created += 1
        return part

    def _check_app_limits(self, pid: ResultPartitionID, app_id: str, max_segments: int) -> None:
        cfg = self.config
        max_partitions = cfg.effective_max_partitions_per_app
        max_pinned = cfg.effective_max_pinned_segments_per_app
        if not (max_partitions or max_pinned):
            return
        mine = [p for p in self.manager.partitions if p.app_id == app_id]
        who = f"application {app_id!r}" if app_id else "no application"
        limit = max_partitions
        if limit and len(mine) >= limit:
            raise LimitExceededError(
                f"{who} holds {len(mine)} partitions on this daemon",
                pid,
                setting="max_partitions_per_app",
                limit=limit,
            )
        limit = max_pinned
        # a finished blocking partition gave its pool back: it pins nothing
        pinned = sum(p.buffer_pool.max_segments for p in mine if not p.buffer_pool.is_destroyed)
        if limit and pinned + max_segments > limit:
            raise LimitExceededError(
                f"{who}'s partitions may pin {pinned} segments; this one would add {max_segments}",
                pid,
                setting="max_pinned_segments_per_app",
                limit=limit,
            )

    def recover_partitions(self) -> None:
        """Take over what a previous daemon left in the spill directory (see the module
        docstring); called by ``start`` before any port opens."""
        directory = self.partition_dir
        ttl = self.config.blocking_partition_ttl
        for path in scan_manifests(directory):
            try:
                manifest = read_manifest(path, self._manifest_key)  # IntegrityError: forged
            except (OSError, CorruptRecordError) as e:
                log.warning("deleting a damaged partition manifest: %s", e)
                delete_partition_files(path)
                self.recovered["refused"] += 1
                continue
            pid = manifest.partition_id
            if manifest.state is not ManifestState.FINISHED:
                what = "pipelined" if manifest.partition_type.is_pipelined else "unfinished"
                self.manager.remember_gone(
                    pid,
                    ProducerFailedError(
                        f"the {what} partition died with its exchange daemon (restarted)", pid
                    ),
                    manifest.app_id,
                )
                delete_partition_files(path)
                self.recovered["failed"] += 1
                continue
            age = max(0.0, time.time() - (manifest.finished_at or 0.0))
            if ttl > 0 and age >= ttl:
                self.manager.remember_gone(
                    pid,
                    PartitionReleasedError(
                        f"partition was released (time to live of {ttl:.0f}s ran out)", pid
                    ),
                    manifest.app_id,
                )
                delete_partition_files(path)
                self.recovered["expired"] += 1
                continue
            try:
                verify_spilled_data(manifest, directory)
                self._restore(path, manifest, age)
            except (OSError, ExchangeError) as e:
                error = (
                    e
                    if isinstance(e, PartitionDataLostError)
                    else PartitionDataLostError(f"cannot be served again: {e}", pid)
                )
                log.warning("refusing blocking partition %s after restart: %s", pid, error)
                self.manager.remember_gone(pid, error, manifest.app_id)
                delete_partition_files(path)
                self.recovered["refused"] += 1
                continue
            self.recovered["restored"] += 1
        for orphan in orphan_spill_files(directory):
            with contextlib.suppress(FileNotFoundError):
                orphan.unlink()
        if any(self.recovered.values()):
            log.info("partitions of the previous daemon: %s", self.recovered)
        old = next(self.spill.root.glob("*.manifest"), None)
        if old is not None:  # never touched: this daemon did not write them
            log.warning(
                "%s holds partitions of a daemon of an earlier version (e.g. %s); they are not "
                "served: their files stay until removed",
                self.spill.root,
                old.name,
            )

    def _restore(self, path: Path, manifest: PartitionManifest, age: float) -> None:
        # a finished blocking partition writes nothing: its pool holds no segment (readers
        # read with their own), so a restart with less network memory restores it too
        pool = self.network_pool.create_buffer_pool(0, 1)
        try:
            part = ResultPartition.restore(
                path,
                manifest,
                pool,
                spill_account=self.spill_space.account(manifest.app_id),
                reader_account=self.reader_budget.account(manifest.app_id),
            )
            self.manager.register_result_partition(part)
        except BaseException:
            pool.destroy()
            raise
        part.add_release_listener(self._on_partition_released)
        self._finished_at[(part.app_id, part.partition_id)] = time.monotonic() - age
        self.partitions_created += 1

    def _on_partition_released(self, part: ResultPartition) -> None:
        st = part.stats()
        self._released_bytes_out += st.bytes_out
        self._released_buffers_out += st.buffers_out
        self._released_back_pressure += st.back_pressured_seconds
        self.partitions_released += 1
        self._finished_at.pop((part.app_id, part.partition_id), None)

    def release_dataset(self, dataset_id: str, app_id: str | None = None) -> int:
        """Release the partitions of ``dataset_id`` that application ``app_id`` created
        (another application's are neither released nor counted); None: every one."""
        return self.manager.release_dataset(dataset_id, app_id=app_id)

    async def _sweep_loop(self) -> None:
        """Release blocking partitions whose time to live ran out (0 disables)."""
        ttl = self.config.blocking_partition_ttl
        if ttl <= 0:
            return
        interval = min(max(ttl / 10, 0.05), 30.0)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for part in self.manager.partitions:
                if not (part.partition_type.is_blocking and part.is_finished):
                    continue
                t = self._finished_at.setdefault((part.app_id, part.partition_id), now)
                readers = sum(getattr(s, "num_readers", 0) for s in part.subpartitions)
                if now - t >= ttl and readers == 0:
                    log.info("releasing %s: time to live of %.0fs ran out", part.partition_id, ttl)
                    part.release()

    # -- statistics ----------------------------------------------------------------------

    def local_endpoint_stats(self) -> dict[str, int]:
        return self.local_endpoint.stats()

    def task_reports(self) -> list[TaskReport]:
        """What consumer tasks on this host last reported of their gates (TaskMetrics)."""
        return self.local_endpoint.task_reports()

    def job_views(self) -> list[JobView]:
        """The streaming jobs whose drivers published their status here (JobStatus)."""
        return self.local_endpoint.jobs.views()

    def totals(self) -> dict[str, float]:
        live = [p.stats() for p in self.manager.partitions]
        return {
            "bytes_in": float(self.bytes_in),
            "bytes_out": float(self._released_bytes_out + sum(s.bytes_out for s in live)),
            "buffers_out": float(self._released_buffers_out + sum(s.buffers_out for s in live)),
            "partitions_created": float(self.partitions_created),
            "partitions_released": float(self.partitions_released),
            "partitions_failed": float(self.partitions_failed),
            "back_pressured_seconds": self._released_back_pressure
            + sum(s.back_pressured_seconds for s in live),
        }


#: Descriptors a daemon needs besides its connections: listening sockets, the event loop,
#: logs, spill files being written or read (each open reader of a blocking partition).
FD_RESERVE: Final = 256


def fd_budget(config: DaemonConfig) -> int:
    """Descriptors the configured limits may take at once: the data port's and the local
    socket's connections, the HTTP port's, and ``FD_RESERVE``."""
    return 2 * config.max_connections + HARD_LIMIT_FACTOR * DEFAULT_MAX_CONNECTIONS + FD_RESERVE


def ensure_fd_limit(config: DaemonConfig) -> None:
    """Raise the soft RLIMIT_NOFILE to what the limits need, or refuse to start.

    A daemon that runs out of descriptors fails producers, readers and its HTTP port alike
    (EMFILE); the connection limits only protect it if the process may hold that many.
    """
    need = fd_budget(config)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(
            "max_connections",
            f"{config.max_connections} connections on the data port and the local socket need "
            f"{need} file descriptors, but RLIMIT_NOFILE allows {hard} (hard limit); lower "
            "max_connections or raise the limit (ulimit -n, LimitNOFILE=, docker --ulimit)",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    log.info("raised the soft RLIMIT_NOFILE from %d to %d (for max_connections)", soft, need)


#: The variable of the ``advertise_host`` setting: the host consumers dial.
ADVERTISE_HOST_ENV = env_var_name("advertise_host")


def advertised_host(config: DaemonConfig) -> str:
    """The host remote consumers dial: ``advertise_host``, else the bind address, else (a
    wildcard bind) this host's name when it resolves to an address that is not loopback.

    A wildcard bind whose host name resolves to loopback only would tell consumers on other
    hosts to dial themselves: ConfigError naming the variable that fixes it.
    """
    if config.advertise_host is not None:
        return config.advertise_host
    if config.host not in WILDCARD_HOSTS:
        return config.host
    name = socket.getfqdn()
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        addresses, why = [], f"does not resolve ({exc})"
    else:
        addresses = sorted({str(info[4][0]) for info in infos})
        why = f"resolves to {', '.join(addresses)} only"
    if any(not ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        return name
    raise ConfigError(
        "advertise_host",
        f"the daemon binds {config.host} but this host's name {name!r} {why}: consumers on "
        f"other hosts would dial themselves. Set {ADVERTISE_HOST_ENV} (or --advertise-host) "
        "to a name or address they reach, or bind --host to that address",
    )
