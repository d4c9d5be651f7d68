"""PySpark integration: daemon discovery, the embedded default, ``exchange_shuffle``.

Discovery, on each executor: the Spark conf ``spark.exchange.daemon.address`` (a local
socket path, the same on every host) if the driver set it; else ``$EXCHANGE_DAEMON`` as
the executor's environment gives it (per worker: the way to point each executor at its
own daemon); else the embedded daemon of a ``local[*]`` run; else the default socket.

``exchange_shuffle(rdd, n, partition_func, mode)`` moves an RDD of ``(key, value)`` pairs
through the daemons so that output partition *i* holds exactly the pairs
``rdd.partitionBy(n, partition_func)`` puts there:

* ``mode="blocking"``: lazy, one Spark job per action, as ``partitionBy``. Its map stage
  writes one BLOCKING partition per input partition (identified by its
  ``taskAttemptId()``) and hands Spark's shuffle a marker per reader naming it; readers
  read the partitions their markers name, so only the attempts whose map output Spark
  committed are read, never a retried task's other attempt. Later actions skip the map
  stage and read again. ``release_exchange`` frees them (a time to live frees forgotten
  ones).
* ``mode="pipelined"``: one stage of ``n`` tasks; task *i* writes its input (from a
  background thread) while it reads output partition *i*, so data streams between running
  tasks with bounded memory. The tasks find each other through a rendezvous service on
  the driver (``client.rendezvous``; ``allGather`` costs about a second), in a round per
  run of the stage (each action runs it anew, as a new stage); each task creates its
  partition before it meets the others, so no reader asks for one not there yet. The
  cluster needs ``n`` task slots. With ``n`` input partitions the stage is a barrier
  stage (Spark starts its tasks together and re-runs it whole). With another count it
  cannot be: Spark's barrier mode refuses a stage whose RDD chain holds an RDD of
  another partition count than its task count
  (``DAGScheduler.checkBarrierStageWithRDDChainPattern``: ``coalesce``, ``union``), so
  it is an ordinary stage over the input coalesced to ``n`` partitions (task *i* writes
  a group of input partitions one after the other) or padded with empty ones (those
  tasks only read). Spark starts an ordinary stage's tasks as slots free up
  and retries them one by one; the rendezvous makes that safe: a run whose tasks do not
  all start within ``PIPELINED_START_TIMEOUT`` fails with ``SchedulingError`` (never a
  silent wait), a job running only some of its tasks (``take``) is refused at once
  (``UsageError``), a task run again alone (a retry) fails its job at once
  (``SchedulingError``), and ``spark.speculation`` is refused up front.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, cast

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import (
    abandon_subpartition,
    fetch_daemon_info,
    mint_app_credential,
    release_dataset,
    resolve_daemon_socket,
)
from client.options import ReaderOptions, WriterOptions
from client.producer import PartitionWriter
from client.rendezvous import RendezvousServer, TaskLocation, rendezvous, report_abort
from client.runtime import get_runtime
from exchange.errors import ExchangeError, TransportError, UsageError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.serialization.record_codec import RecordCodec, default_codec
from exchange.writer.hashing import deterministic_hash
from exchange.writer.routing import register_int_value_hash, register_str_hash

log = logging.getLogger("exchange.client.spark")

if TYPE_CHECKING:
    from pyspark import RDD, SparkContext
    from pyspark.accumulators import Accumulator, AccumulatorParam

__all__ = [
    "CONF_DAEMON_ADDRESS",
    "EmbeddedDaemon",
    "exchange_hash",
    "exchange_shuffle",
    "get_embedded_daemon",
    "release_exchange",
]

CONF_DAEMON_ADDRESS: Final = "spark.exchange.daemon.address"
MODES: Final = ("blocking", "pipelined")
#: How long a task of a pipelined exchange in an ordinary stage (``n_in != n``) waits
#: for the others to start (seconds): Spark starts such a stage's tasks as slots free
#: up, so a run short of free slots fails with a ``SchedulingError`` after this.
PIPELINED_START_TIMEOUT: Final = 60.0


def exchange_hash(key: Any) -> int:
    """The exchange's own key hash (stable across processes without ``PYTHONHASHSEED``).

    ``exchange_shuffle(rdd, n, exchange_hash)`` places every key where
    ``rdd.partitionBy(n, exchange_hash)`` does, and hashes integer keys inline (the
    fastest choice); the default of both is PySpark's ``portable_hash``.
    """
    return deterministic_hash(key)


def _writer_partition_func(
    partition_func: Callable[[Any], int],
) -> Callable[[Any], int] | None:
    """What the task's writer is given: None for the exchange's own hash (its default,
    hashed inline), else the function itself. Called in the task, it tells the writer
    that ``portable_hash`` of an int is the int (Python's hash: routed inline), and of a
    str or bytes Python's hash when ``PYTHONHASHSEED`` is set (hashed in C)."""
    from pyspark.rdd import portable_hash

    if partition_func is portable_hash:
        register_int_value_hash(portable_hash)
        register_str_hash(portable_hash, "PYTHONHASHSEED")
    if partition_func is exchange_hash or partition_func is deterministic_hash:
        return None
    return partition_func


# -- the embedded daemon -------------------------------------------------------------------


class EmbeddedDaemon:
    """A daemon subprocess started for a local Spark run, stopped at exit."""

    def __init__(self, extra_args: Iterable[str] = (), spill_dir: str | None = None) -> None:
        self.extra_args = tuple(extra_args)
        self._own_spill_dir = spill_dir is None
        self.spill_dir = spill_dir or tempfile.mkdtemp(prefix="exchange-embedded-")
        self.socket = os.path.join(self.spill_dir, "exchange-daemon.sock")
        cmd = [
            sys.executable,
            "-m",
            "server",
            "--host",
            "127.0.0.1",
            "--data-port",
            "0",
            "--http-port",
            "0",
            "--spill-dir",
            self.spill_dir,
            "--local-socket",
            self.socket,
            "--log-level",
            "WARNING",
            *self.extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        try:
            self.info: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError:
            self.proc.kill()
            raise TransportError(
                f"the embedded exchange daemon did not start (exit {self.proc.wait()})"
            ) from None
        self.data_address: str = self.info["data"]
        self.http_address: str = self.info["http"]
        self.daemon_id: str = self.info["daemon_id"]
        atexit.register(self.stop)

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.http_address}/"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.http_address}/metrics"

    def stop(self, timeout: float = 15.0) -> bool:
        """SIGTERM the daemon; True if it reported every segment back in its pool.

        A spill directory it made itself is deleted: a daemon keeps finished blocking
        partitions on disk for its successor, and no daemon succeeds an embedded one."""
        if self.proc.poll() is not None:
            return False
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False
        finally:
            if self._own_spill_dir and self.proc.poll() is not None:
                shutil.rmtree(self.spill_dir, ignore_errors=True)
        with contextlib.suppress(ValueError):
            for line in out.splitlines():
                msg = json.loads(line)
                if msg.get("event") == "stopped":
                    return bool(msg.get("pool_whole"))
        return False


_embedded: EmbeddedDaemon | None = None
_embedded_lock = threading.Lock()


def get_embedded_daemon(extra_args: Iterable[str] = ()) -> EmbeddedDaemon:
    """The driver's embedded daemon, started on first use.

    ``extra_args``: daemon flags for the one this call starts. Asking for flags while a
    daemon started with others runs is a ``UsageError`` (the flags would not take
    effect): ``stop_embedded_daemon()`` first. No flags: whichever daemon runs.
    """
    global _embedded
    args = tuple(extra_args)
    with _embedded_lock:
        if _embedded is None or _embedded.proc.poll() is not None:
            _embedded = EmbeddedDaemon(args)
        elif args and args != _embedded.extra_args:
            raise UsageError(
                f"the embedded daemon runs with {list(_embedded.extra_args)}, not {list(args)}:"
                " call stop_embedded_daemon() first"
            )
        return _embedded


def stop_embedded_daemon() -> bool:
    global _embedded
    with _embedded_lock:
        d, _embedded = _embedded, None
    return d.stop() if d is not None else True


def embedded_dashboard_url(socket: str | None) -> str | None:
    """The embedded daemon's dashboard URL, if it runs and listens on ``socket``."""
    d = _embedded
    if d is None or socket is None or d.proc.poll() is not None:
        return None
    return d.dashboard_url if os.path.realpath(socket) == os.path.realpath(d.socket) else None


def _daemon_hint(sc: SparkContext) -> str | None:
    """The daemon address tasks should use, as decided on the driver (None: their env)."""
    conf = sc.getConf().get(CONF_DAEMON_ADDRESS, None)
    if conf:
        return str(conf)
    master = sc.master or ""
    if master.startswith("local") and not os.environ.get("EXCHANGE_DAEMON"):
        return get_embedded_daemon().socket
    return None


def _slots(sc: SparkContext) -> int:
    m = re.fullmatch(r"local\[(\d+|\*)(?:,\s*\d+)?\]", sc.master or "")
    if m:
        return os.cpu_count() or 1 if m.group(1) == "*" else int(m.group(1))
    if sc.master == "local":
        return 1
    return int(sc.defaultParallelism)


_rendezvous: dict[str, RendezvousServer] = {}


def _rendezvous_server(sc: SparkContext) -> RendezvousServer:
    """The driver's rendezvous service for this application (started on first use)."""
    app = str(sc.applicationId)
    server = _rendezvous.get(app)
    if server is None:
        master = sc.master or ""
        host = "127.0.0.1"
        if not master.startswith("local"):
            host = str(sc.getConf().get("spark.driver.host", "127.0.0.1"))
        server = _rendezvous[app] = RendezvousServer(host=host)
    return server


_checked_apps: set[str] = set()


def check_executor_python(sc: SparkContext) -> None:
    """Fail fast, with the fix, when the executors' Python cannot import this package.

    Spark's Python workers run the ``python3`` on PATH unless ``PYSPARK_PYTHON`` is set;
    without the package there a task would die with a bare ``ModuleNotFoundError``. A
    one-task probe job (its function travels by value, so it runs even there) imports
    what tasks need and reports the interpreter. Checked once per application.

    In local mode the executors run on this machine, so the driver's own interpreter
    (which imports the package) can run them: the probe's failure then switches the
    application's workers to ``sys.executable`` (``sc.pythonExec``, read for every job),
    with a warning, and probes again. Elsewhere the failure is a ``UsageError``.
    """
    app = str(sc.applicationId)
    if app in _checked_apps:
        return
    error = _probe_executor_python(sc)
    master = str(sc.master or "")
    if error is not None and master.startswith("local") and sc.pythonExec != sys.executable:
        log.warning(
            "the executors' Python %s; this local run uses the driver's interpreter %s "
            "instead (set PYSPARK_PYTHON before the SparkSession is created to choose)",
            error,
            sys.executable,
        )
        sc.pythonExec = sys.executable
        error = _probe_executor_python(sc)
    if error is not None:
        raise UsageError(
            f"the executors' Python {error}. Install pyspark-exchange into that "
            "interpreter, or point Spark at one that has it: set PYSPARK_PYTHON (for "
            "example to sys.executable) before the SparkSession is created"
        )
    _checked_apps.add(app)


def _probe_executor_python(sc: SparkContext) -> str | None:
    """None if a task can import the client; else what failed, and where."""

    def probe(_: Iterable[Any]) -> Iterator[tuple[str, str | None]]:
        import sys as _sys

        try:
            import msgpack  # noqa: F401

            import client.spark  # noqa: F401
        except Exception as e:  # the report is the point: any import failure
            yield (_sys.executable, f"{type(e).__name__}: {e}")
            return
        yield (_sys.executable, None)

    for exe, error in sc.parallelize([0], 1).mapPartitions(probe).collect():
        if error is not None:
            where = f"{exe} (sc.pythonExec={sc.pythonExec!r})"
            return f"{where} cannot import the exchange client ({error})"
    return None


# -- task-side helpers -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Produced(TaskLocation):
    """Where a blocking map task wrote its partition, and how many records."""

    records: int = 0


_info_cache: dict[str, tuple[tuple[int, int], Any]] = {}


def _socket_identity(sock: str) -> tuple[int, int]:
    """Changes when a daemon (re)creates its socket file (a restart on the same path)."""
    try:
        st = os.stat(sock)
    except OSError:
        return (0, 0)
    return (st.st_ino, st.st_mtime_ns)


@dataclass(frozen=True, slots=True)
class _DaemonSpec:
    """How tasks reach their daemon: a socket hint (None: their environment), the Spark
    application the exchange belongs to and its credential, minted on the driver
    (``mint_app_credential``). Never the daemons' secret: a task can authenticate for its
    own application only."""

    hint: str | None
    credential: bytes | None
    app_id: str = ""

    @property
    def secret(self) -> bytes | None:
        """What tasks authenticate with: the credential the driver minted; without one
        (the driver holds no secret), what the executor's $EXCHANGE_SECRET_FILE holds."""
        if self.credential is not None:
            return self.credential
        return mint_app_credential(self.app_id)


def _local_daemon(spec: _DaemonSpec) -> tuple[str, Any]:
    """The local daemon's socket and DaemonInfo, cached per Python worker (workers are
    reused across tasks) for as long as the same daemon owns the socket."""
    sock = resolve_daemon_socket(spec.hint)
    identity = _socket_identity(sock)
    cached = _info_cache.get(sock)
    if cached is not None and cached[0] == identity:
        return sock, cached[1]
    info = get_runtime().run(fetch_daemon_info(sock, secret=spec.secret))
    _info_cache[sock] = (identity, info)
    return sock, info


def _open_writer(
    exchange_id: str,
    index: int,
    attempt: int,
    num_partitions: int,
    spec: _DaemonSpec,
    codec: RecordCodec,
    blocking: bool,
) -> PartitionWriter:
    """The writer of one input partition: the partition exists on the local daemon once
    this returns."""
    sock, info = _local_daemon(spec)
    pid = ResultPartitionID(exchange_id, index, attempt)
    # the daemon's buffer timeout; a blocking partition flushes only full buffers
    options = WriterOptions.from_daemon(
        info, blocking=blocking, daemon_socket=sock, codec=codec, secret=spec.secret
    )
    return PartitionWriter(pid, num_partitions, options)


def _write_all(
    writer: PartitionWriter, records: Iterable[Any], partition_func: Callable[[Any], int]
) -> int:
    """Write the records and finish the partition (fail it on an error)."""
    with writer:
        return writer.emit_all(records, _writer_partition_func(partition_func))


def _write_partition(
    exchange_id: str,
    index: int,
    attempt: int,
    records: Iterable[Any],
    num_partitions: int,
    partition_func: Callable[[Any], int],
    spec: _DaemonSpec,
    codec: RecordCodec,
    blocking: bool,
) -> _Produced:
    """Write one input partition."""
    writer = _open_writer(exchange_id, index, attempt, num_partitions, spec, codec, blocking)
    n = _write_all(writer, records, partition_func)
    sock, info = _local_daemon(spec)
    return _Produced(index, attempt, info.daemon_id, info.data_address, sock, info.segment_size, n)


def _open_reader(
    exchange_id: str,
    producers: Sequence[TaskLocation],
    subpartition: int,
    spec: _DaemonSpec,
    codec: RecordCodec,
) -> PartitionReader | None:
    """The reader of one output partition (None: no input partitions, nothing to read)."""
    if not producers:
        return None
    sock, info = _local_daemon(spec)
    locations = [
        PartitionLocation(
            ResultPartitionID(exchange_id, p.index, p.attempt),
            subpartition,
            p.data_address,
            p.daemon_id,
            p.local_socket,
        )
        for p in producers
    ]
    options = ReaderOptions.from_daemon(
        info,
        codec=codec,
        secret=spec.secret,
        metrics_socket=sock,
        task_name=f"{exchange_id}/{subpartition}",
        segment_size=producers[0].segment_size,
    )
    return PartitionReader(locations, options)


def _read_subpartition(
    exchange_id: str,
    producers: list[_Produced],
    subpartition: int,
    spec: _DaemonSpec,
    codec: RecordCodec,
) -> Iterator[Any]:
    """The records of one output partition, for Spark to iterate.

    ``PartitionReader.records()`` itself goes back to Spark: a chain over the decoded
    batches, walked in C, with no generator frame of ours per record. It closes the
    reader at its end, on an error, and when Spark drops it early (the generator under
    the chain is closed with it)."""
    reader = _open_reader(exchange_id, producers, subpartition, spec, codec)
    return iter(()) if reader is None else reader.records()


# -- exchange_shuffle --------------------------------------------------------------------


def exchange_shuffle(
    rdd: RDD[Any],
    num_partitions: int,
    partition_func: Callable[[Any], int] | None = None,
    mode: str = "blocking",
    *,
    codec: RecordCodec | None = None,
    secret_file: str | None = None,
) -> RDD[Any]:
    """Repartition an RDD of ``(key, value)`` pairs through the exchange daemons.

    Output partition ``i`` holds the pairs whose ``partition_func(key) % num_partitions``
    is ``i`` (default: PySpark's ``portable_hash``, ``partitionBy``'s default): the
    partitions ``rdd.partitionBy(num_partitions, partition_func)`` gives. Records come
    back exactly as ``partitionBy`` gives them (equal and of the same types: the default
    codec pickles batches of records); ``codec=MsgpackCodec()`` is the explicit choice for
    cross-language data. Like ``partitionBy``'s, the returned RDD carries its
    ``partitioner`` (``Partitioner(num_partitions, partition_func)``), so a
    ``reduceByKey``, ``groupByKey`` or ``partitionBy`` with the same partitioning does
    not shuffle again. It has an ``exchange_id`` attribute for ``release_exchange``.

    A record that is not a pair (``record[0]`` fails) is a ``NotAPairError`` naming it,
    raised by the task that meets it: the action on the result fails with it. A
    DataFrame is refused at once: pass ``df.rdd`` mapped to pairs.

    ``secret_file``: where the daemons' shared secret lies on the driver (default:
    ``$EXCHANGE_SECRET_FILE``); the driver mints the application's credential from it
    and only that travels to the tasks (executors need no secret). Without a secret on
    the driver, tasks use their own ``$EXCHANGE_SECRET_FILE``.
    """
    # the arguments first, the RDD last: a bad argument is named before Spark is touched
    if not isinstance(num_partitions, int) or isinstance(num_partitions, bool):
        raise UsageError(f"num_partitions must be an int, got {num_partitions!r}")
    if num_partitions <= 0:
        raise UsageError(f"num_partitions must be positive, got {num_partitions}")
    if not isinstance(mode, str) or mode not in MODES:
        raise UsageError(f"mode must be one of {MODES}, got {mode!r}")
    if partition_func is not None and not callable(partition_func):
        raise UsageError(f"partition_func must be callable, got {partition_func!r}")
    if codec is not None and not all(
        callable(getattr(codec, m, None)) for m in ("new_encoder", "new_decoder")
    ):
        raise UsageError(f"codec must be a RecordCodec, got {codec!r}")
    _check_secret_file(secret_file)
    _check_not_dataframe(rdd)
    sc = getattr(rdd, "context", None)
    if sc is None or not callable(getattr(rdd, "mapPartitionsWithIndex", None)):
        raise UsageError(f"rdd must be a PySpark RDD of (key, value) pairs, got {rdd!r}")
    from pyspark.rdd import Partitioner, portable_hash

    func: Callable[[Any], int] = portable_hash if partition_func is None else partition_func
    the_codec: RecordCodec = codec if codec is not None else default_codec()
    app_id = str(getattr(sc, "applicationId", "") or "")
    spec = _DaemonSpec(_daemon_hint(sc), mint_app_credential(app_id, secret_file), app_id)
    check_executor_python(sc)
    exchange_id = f"x-{uuid.uuid4().hex[:16]}"
    _known_exchanges.add(exchange_id)
    _exchange_apps[exchange_id] = app_id
    if mode == "blocking":
        out = _blocking(rdd, num_partitions, func, spec, exchange_id, the_codec)
    else:
        out = _pipelined(rdd, num_partitions, func, spec, exchange_id, the_codec)
    # what partitionBy sets: a later reduceByKey/groupByKey/partitionBy(n, func) sees its
    # partitioning already done (PipelinedRDD keeps it through preservesPartitioning)
    out.partitioner = Partitioner(num_partitions, func)
    out.exchange_id = exchange_id  # type: ignore[attr-defined]
    return out


def _check_not_dataframe(data: object) -> None:
    """A DataFrame (classic or Spark Connect) is refused with the way to an RDD of pairs."""
    cls = type(data)
    if cls.__name__ == "DataFrame" and cls.__module__.startswith("pyspark.sql"):
        raise UsageError(
            "exchange_shuffle takes an RDD of (key, value) pairs, got a DataFrame: pass "
            "its rows keyed, for example df.rdd.map(lambda row: (row['key'], row)) "
            "(df.rdd is an RDD of Rows), or use df.repartition(n, 'key') to stay in SQL"
        )


#: exchange id -> the accumulator of the data addresses its blocking partitions went to
_exchange_addresses: dict[str, Accumulator[set[str]]] = {}
#: Every exchange id this driver made (a release of another id is a mistake).
_known_exchanges: set[str] = set()
#: exchange id -> the Spark application that made it (its partitions are that app's)
_exchange_apps: dict[str, str] = {}


def _check_secret_file(secret_file: object) -> None:
    """A path (checked where it is read: on every host), or None."""
    if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
        raise UsageError(f"secret_file must be a path, got {secret_file!r}")


class _AddressSet:
    """The ``AccumulatorParam`` of the data addresses of the daemons an exchange wrote to
    (Spark merges the updates of successful tasks only)."""

    def zero(self, value: set[str]) -> set[str]:
        return set()

    def addInPlace(self, value1: set[str], value2: set[str]) -> set[str]:
        value1 |= value2
        return value1


def _route_by_reader(reader: int) -> int:
    """The partition function of the location shuffle: a marker's key is its reader."""
    return reader


def _blocking(
    rdd: RDD[Any],
    n: int,
    partition_func: Callable[[Any], int],
    spec: _DaemonSpec,
    exchange_id: str,
    codec: RecordCodec,
) -> RDD[Any]:
    """One Spark job per action, two stages: the map stage writes each input partition to
    its daemon and hands Spark, for every reader, a marker naming the partition written
    (``_Produced``); Spark's own shuffle carries the ``n_in * n`` markers to the readers.

    Spark registers the map output of one attempt per task (the one it committed), so a
    reader sees exactly one attempt per input partition, never a retried task's failed or
    duplicate attempt; Spark keeps the markers as it keeps any shuffle output, so a second
    action reads the daemons again without writing (its map stage is skipped)."""
    from pyspark import TaskContext

    sc = rdd.context
    param = cast("AccumulatorParam[set[str]]", _AddressSet())
    addresses: Accumulator[set[str]] = sc.accumulator(set(), param)
    _exchange_addresses[exchange_id] = addresses

    def write(index: int, records: Iterable[Any]) -> Iterator[tuple[int, _Produced]]:
        ctx = TaskContext.get()
        attempt = ctx.taskAttemptId() if ctx is not None else 0
        produced = _write_partition(
            exchange_id, index, attempt, records, n, partition_func, spec, codec, True
        )
        addresses.add({produced.data_address})
        return ((reader, produced) for reader in range(n))

    def read(index: int, markers: Iterable[tuple[int, _Produced]]) -> Iterator[Any]:
        produced = sorted((p for _, p in markers), key=lambda p: p.index)
        return _read_subpartition(exchange_id, produced, index, spec, codec)

    located = rdd.mapPartitionsWithIndex(write).partitionBy(n, _route_by_reader)
    # preservesPartitioning: the Partitioner set on the result passes on to what is
    # pipelined after it (the JVM side claims the location shuffle's partitioner: the same
    # count of partitions, each holding one output partition)
    return located.mapPartitionsWithIndex(read, preservesPartitioning=True)


def _run_dataset(exchange_id: str, stage: int) -> str:
    """The dataset of one run (Spark stage) of a pipelined exchange's barrier stage."""
    return f"{exchange_id}.s{stage}"


def _in_partitions(rdd: RDD[Any], n: int) -> RDD[Any]:
    """The input as ``n`` partitions without a shuffle: more are coalesced (task *t*
    writes a group of them, one after another, as one producer), fewer are padded with
    empty ones (those tasks write nothing and read)."""
    from pyspark.rdd import RDD

    n_in = rdd.getNumPartitions()
    if n_in > n:
        return rdd.coalesce(n)
    # an empty partition has no bytes to deserialize: the input's deserializer, so that
    # union joins the JVM RDDs as they are (different ones: a Python pass over the input)
    empty: RDD[Any] = rdd.context.parallelize([], n - n_in)
    return rdd.union(RDD(empty._jrdd, rdd.context, rdd._jrdd_deserializer))


def _check_no_speculation(sc: SparkContext, n_in: int, n: int) -> None:
    """A speculative copy of a task would meet the exchange as a second attempt of its
    index, which an ordinary stage's exchange refuses (failing the job)."""
    if str(sc.getConf().get("spark.speculation", "false")).strip().lower() == "true":
        raise UsageError(
            f"a pipelined exchange of {n_in} input partitions into {n} runs an ordinary Spark "
            "stage, and spark.speculation is on: a speculative copy of one of its tasks "
            "cannot join the exchange. Turn speculation off, give the input as many "
            "partitions as the output (a barrier stage: never speculated), or use "
            "mode='blocking'"
        )


def _stage_runs_every_task(sc: SparkContext, stage: int, n: int) -> str | None:
    """Why the run of an ordinary stage can never bring its ``n`` tasks together, or None:
    the job computes only some of its partitions (``take``, ``first``, ``lookup``).
    Asked of Spark's status tracker (on the driver) when the run's first task arrives."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + 10
    info = tracker.getStageInfo(stage)
    while info is None:  # the listener bus may not have told the status store yet
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
        info = tracker.getStageInfo(stage)
    if info.numTasks < n:
        return (
            f"the job runs {info.numTasks} of the {n} tasks of its pipelined exchange "
            "(take, first, lookup and the like compute some partitions only), and every "
            "output partition needs all of its writers running: use collect() (then "
            "[:k]), or mode='blocking'"
        )
    return None


def _pipelined(
    rdd: RDD[Any],
    n: int,
    partition_func: Callable[[Any], int],
    spec: _DaemonSpec,
    exchange_id: str,
    codec: RecordCodec,
) -> RDD[Any]:
    from pyspark import TaskContext

    sc = rdd.context
    slots = _slots(sc)
    if n > slots:
        raise UsageError(
            f"a pipelined exchange runs all its tasks at once: it needs {n} task slots but "
            f"only {slots} are available; use mode='blocking', fewer partitions, or more "
            "executor cores"
        )
    n_in = rdd.getNumPartitions()
    # n_in == n: a barrier stage (Spark starts its tasks together, re-runs it whole).
    # Otherwise an ordinary stage over the input brought to n partitions (Spark's barrier
    # mode refuses any RDD chain in the stage whose partition count differs from its
    # task count: coalesce, union), whose tasks meet at the rendezvous within a deadline.
    barrier = n_in == n
    if not barrier:
        _check_no_speculation(sc, n_in, n)
        rdd = _in_partitions(rdd, n)
    secret = spec.secret
    start_timeout = PIPELINED_START_TIMEOUT

    async def release_everywhere(stage: int, locations: list[TaskLocation]) -> None:
        """A task of the stage failed: release that run's pipelined partitions on every
        daemon, so nothing a killed task left behind keeps its segments."""
        for address in {loc.data_address for loc in locations}:
            with contextlib.suppress(ExchangeError):
                await release_dataset(address, _run_dataset(exchange_id, stage), secret=secret)

    async def check_round(stage: int) -> str | None:
        return await asyncio.get_running_loop().run_in_executor(
            None, _stage_runs_every_task, sc, stage, n
        )

    ticket = _rendezvous_server(sc).open_group(
        exchange_id,
        n,
        release_everywhere,
        whole_stage_retries=barrier,
        check_round=None if barrier else check_round,
    )

    async def abandon_everywhere(dataset: str, t: int, addresses: list[str]) -> None:
        """Task ``t`` left its input early: subpartition ``t`` of the run's partitions is
        abandoned on every producer's daemon, also for the partitions not created yet,
        whose producers would otherwise wait for a reader that will never ask."""
        for address in addresses:
            try:
                await abandon_subpartition(address, dataset, t, secret=secret)
            except ExchangeError as e:  # that daemon is gone: its partitions went with it
                log.info(
                    "task %d of %s: cannot abandon its input at %s: %s", t, dataset, address, e
                )

    def run(records: Iterable[Any]) -> Iterator[Any]:
        ctx = TaskContext.get()
        assert ctx is not None
        t = ctx.partitionId()
        attempt = ctx.taskAttemptId()
        # Each action on the result runs the barrier stage again, as a new stage: its
        # tasks meet only each other, and write partitions of their own dataset
        stage = ctx.stageId()
        dataset = _run_dataset(exchange_id, stage)
        sock, info = _local_daemon(spec)
        me = TaskLocation(t, attempt, info.daemon_id, info.data_address, sock, info.segment_size)
        # Every task creates its partition before it meets the others, so no reader of
        # the run ever asks for a partition that does not exist yet (no not-found
        # retries), and none is created after a reader left (its subpartition would wait)
        pw = _open_writer(dataset, t, attempt, n, spec, codec, False)
        try:
            if barrier:
                producers = rendezvous(ticket, me, round_id=stage)
            else:
                producers = rendezvous(ticket, me, round_id=stage, timeout=start_timeout)
        except BaseException as e:
            pw.fail(e)
            raise
        # the producers' daemons (our own: over its local socket)
        daemons = sorted(
            {p.local_socket if p.daemon_id == info.daemon_id else p.data_address for p in producers}
        )
        failure: list[BaseException] = []

        def produce() -> None:
            try:
                _write_all(pw, records, partition_func)
            except BaseException as e:
                failure.append(e)

        writer = threading.Thread(target=produce, name=f"exchange-writer-{t}", daemon=True)
        writer.start()

        def chunks() -> Iterator[list[Any]]:
            # The reader's lists of records (one per decoded buffer), chained for Spark:
            # this frame runs once per buffer, the records themselves are walked in C.
            reader: PartitionReader | None = None
            read_all = False
            try:
                try:
                    # started by run() up to here, so that the finally below runs however
                    # Spark drops the output: also never started (a downstream function
                    # that ignores its input), when a generator never started would be
                    # dropped without running any of its code
                    yield []
                    reader = _open_reader(dataset, producers, t, spec, codec)
                    if reader is not None:
                        yield from reader.record_lists()
                    read_all = True
                finally:
                    # closed first: a writer held back by an unread stream must end
                    if reader is not None:
                        reader.close()
                    if not read_all:
                        # This task left its input early (Spark stopped iterating or
                        # never started, or a read failed): the exchange cannot
                        # complete. Every producer's daemon learns that our
                        # subpartition is abandoned (a partition we never got to ask
                        # for, created now or later, must not keep it), and our
                        # writer, which may wait forever for a consumer that gave up
                        # before it ever asked for our partition, is failed.
                        get_runtime().run(abandon_everywhere(dataset, t, daemons))
                        pw.cancel(f"task {t} of exchange {dataset} left early")
                    writer.join()
                if failure:
                    raise failure[0]
            except Exception:
                report_abort(ticket, t, attempt, round_id=stage)
                raise

        lists = chunks()
        next(lists)  # into its try: from here on, dropping it leaves the exchange cleanly
        return itertools.chain.from_iterable(lists)

    out = rdd.barrier().mapPartitions(run) if barrier else rdd.mapPartitions(run)
    # Preserving partitioning passes the Partitioner set on the result on to what is
    # pipelined after it, and makes the stage's JVM RDD claim its JVM parent's
    # partitioner: right only when that parent (the input's first JVM RDD) has none.
    # Otherwise the Partitioner stays on the result alone.
    piped: Any = out  # a PipelinedRDD: its JVM parent and flag are not in RDD's stubs
    if piped._prev_jrdd.rdd().partitioner().isEmpty():
        piped.preservesPartitioning = True
    return out


def release_exchange(rdd_or_id: Any, *, secret_file: str | None = None) -> int:
    """Release the blocking partitions of an exchange on every daemon holding them."""
    exchange_id = getattr(rdd_or_id, "exchange_id", rdd_or_id)
    if not isinstance(exchange_id, str):
        raise UsageError(f"expected an exchanged RDD or an exchange id, got {rdd_or_id!r}")
    _check_secret_file(secret_file)
    if exchange_id not in _known_exchanges:
        raise UsageError(f"unknown exchange {exchange_id!r}: no exchange_shuffle of this driver")
    acc = _exchange_addresses.get(exchange_id)  # None: pipelined
    addresses = set(acc.value) if acc is not None else set()  # empty: never read
    rt = get_runtime()
    released = 0
    secret = mint_app_credential(_exchange_apps.get(exchange_id, ""), secret_file)
    for address in addresses:
        try:
            released += rt.run(release_dataset(address, exchange_id, secret=secret))
        except ExchangeError:
            continue  # that daemon is gone; its partitions went with it
    return released
