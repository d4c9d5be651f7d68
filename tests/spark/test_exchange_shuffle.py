"""``exchange_shuffle`` in PySpark local mode equals ``rdd.partitionBy(n)``.

One ``local[2]`` session for the module (the ``spark`` fixture, with the embedded daemon).
Every dataset goes through both modes and is compared with ``partitionBy`` partition by
partition: the same records, equal (``==``) and of the same types all the way down.
Pipelined runs all its ``n`` tasks at once, so there ``n`` is 2 (``local[2]`` has 2
slots), from the dataset's 2 or 3 input partitions (2: one barrier stage; any other
count: an ordinary stage over the input coalesced or padded to ``n`` partitions). The
retry test runs ``local[2,2]`` in a process of its own (``tests/kit/spark_retry_job.py``).
"""

from __future__ import annotations

import collections
import datetime
import decimal
import fractions
import json
import operator
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from py4j.protocol import Py4JJavaError
from pyspark.errors import PythonException

from tests.kit.polling import wait_for
from tests.kit.spark_retry_job import run_job

pytest.importorskip("pyspark")

from client.spark import (
    exchange_hash,
    exchange_shuffle,
    get_embedded_daemon,
    release_exchange,
)
from exchange.errors import NotAPairError, UsageError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

MiB = 1024 * 1024


def _zipf_keys(count: int, num_keys: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1.0 / (rank**s) for rank in range(1, num_keys + 1)]
    return rng.choices(range(num_keys), weights=weights, k=count)


def _sizes() -> list[tuple[Any, bytes]]:
    sizes = [0, 1, 2, 100, 32 * 1024 - 1, 32 * 1024, 32 * 1024 + 1, 100_000, MiB, 2 * MiB, 3 * MiB]
    return [(f"k{i}", bytes([i % 251]) * n) for i, n in enumerate(sizes)] + [
        (i, bytes(range(256)) * (n // 256)) for i, n in enumerate(sizes)
    ]


def _odd_keys() -> list[tuple[Any, Any]]:
    keys: list[Any] = [
        "",
        "ascii",
        "ключ",
        "键",
        "😀 emoji",
        "a\x00b",
        "e\u0301",  # combining accent: not the same key as "é"
        "é",
        b"",
        b"\x00",
        b"\xff\xfe\x00binary",
        bytes(range(256)),
        0,
        -1,
        2**63 - 1,
        -(2**63),
        1.5,
        None,
        True,
        (1, "tuple"),
    ]
    return [(k, (i, repr(k))) for i, k in enumerate(keys) for _ in range(3)]


Point = collections.namedtuple("Point", "x y")  # pyspark makes namedtuples picklable


def _mixed_types() -> list[tuple[Any, Any]]:
    """Real-world values a new user's records hold; ``partitionBy`` gives each back exactly."""
    from pyspark.sql import Row

    berlin = datetime.timezone(datetime.timedelta(hours=1), "CET")
    values: list[Any] = [
        (1, [2, [3, 4]]),
        [1, (2, 3)],
        Row(user="u1", clicks=3, tags=["a", "b"]),
        Point(1, [2]),
        datetime.datetime(2026, 11, 23, 9, 30, 15, 123456, tzinfo=datetime.UTC),
        datetime.datetime(2026, 3, 29, 2, 30, tzinfo=berlin),
        datetime.datetime(2026, 1, 1),
        datetime.date(1999, 12, 31),
        datetime.time(23, 59, 59, 999, tzinfo=datetime.UTC),
        datetime.timedelta(days=-1, microseconds=5),
        decimal.Decimal("3.14159265358979323846264338327950288"),
        decimal.Decimal("-0E-7"),
        {1, 2, 3},
        frozenset({"a", ("b", 1)}),
        b"\x00\xff",
        bytearray(b"mutable"),
        2**100,
        -(2**70),
        float("nan"),
        float("inf"),
        float("-inf"),
        -0.0,
        {"nested": {"list": [1, {"set": {1}}], "tuple": (None, True)}},
        fractions.Fraction(22, 7),
        complex(1, -2),
        "",
        [],
        (),
        True,
        0,
    ]
    keys: list[Any] = ["k", 7, 2**64 + 1, ("t", 1), b"b", None, 3.5]
    return [(keys[i % len(keys)], v) for i, v in enumerate(values * 3)]


# name -> (records, input partitions and output partitions for blocking mode)
DATASETS: dict[str, tuple[Callable[[], list[Any]], int, int]] = {
    "empty": (lambda: [], 2, 3),
    "one-record": (lambda: [("only", 1)], 2, 3),
    "200k": (lambda: [(i % 7919, (i, i * 0.5)) for i in range(200_000)], 2, 4),
    "zipf-skew": (
        lambda: [(k, i) for i, k in enumerate(_zipf_keys(50_000, 2000, 1.3, seed=11))],
        3,
        4,
    ),
    "value-sizes-0-to-3MiB": (_sizes, 2, 3),
    "unicode-and-binary-keys": (_odd_keys, 2, 5),
    # equal in Python (1 == True == 1.0): portable_hash puts them together
    "equal-keys-of-different-types": (
        lambda: (
            [(k, i) for i in range(4) for k in (1, True, 1.0, 0, False, 0.0, (1, 2), (True, 2))]
            + [(k, -i) for i in range(4) for k in (0.0, False, 0, (True, 2), (1, 2), 1.0, True, 1)]
        ),
        2,
        4,
    ),
    "none-values": (lambda: [(i % 10, None) for i in range(1000)] + [(None, None)], 2, 3),
    "more-partitions-than-records": (lambda: [(k, k) for k in ("a", "b", "c")], 3, 8),
    "mixed-types": (_mixed_types, 2, 3),
}

_records_cache: dict[str, list[Any]] = {}
_reference_cache: dict[tuple[str, int, int], list[list[Any]]] = {}


def records_of(name: str) -> list[Any]:
    if name not in _records_cache:
        _records_cache[name] = DATASETS[name][0]()
    return _records_cache[name]


def reference(spark: Any, name: str, slices: int, n: int) -> list[list[Any]]:
    key = (name, slices, n)
    if key not in _reference_cache:
        rdd = spark.sparkContext.parallelize(records_of(name), slices)
        _reference_cache[key] = rdd.partitionBy(n).glom().collect()
    return _reference_cache[key]


def wait_until_daemon_holds_nothing_of(exchange_id: str, timeout: float = 60) -> None:
    """Poll the embedded daemon until its pool is whole and no partition of the exchange
    is left. After ``timeout`` seconds: AssertionError with what it held, once the
    exchange's datasets are released there (the next tests start with a daemon whole,
    not failing on what this one left)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = daemon_stats()
        net = stats["network"]
        left = [p for p in stats["partitions"]["items"] if exchange_id in str(p)]
        if net["available_segments"] == net["total_segments"] and not left:
            break
        if time.monotonic() >= deadline:
            _release_datasets({exchange_id, *(p["dataset"] for p in left)}, exchange_id)
            raise AssertionError(
                f"the daemon still holds something of {exchange_id} after {timeout}s: "
                f"{stats['network']}, {stats['partitions']}"
            )
        time.sleep(0.1)


def _release_datasets(datasets: set[str], exchange_id: str) -> None:
    from client import spark as xs
    from client.local_connection import mint_app_credential, release_dataset
    from client.runtime import get_runtime

    secret = mint_app_credential(xs._exchange_apps.get(exchange_id, ""))
    address = get_embedded_daemon().data_address
    for ds in sorted(datasets):
        get_runtime().run(release_dataset(address, ds, secret=secret))


def daemon_stats() -> dict[str, Any]:
    from urllib.request import urlopen

    with urlopen(f"http://{get_embedded_daemon().http_address}/api/stats", timeout=10) as r:
        stats: dict[str, Any] = json.loads(r.read())
        return stats


@pytest.mark.parametrize("mode", ["blocking", "pipelined"])
@pytest.mark.parametrize("name", list(DATASETS))
def test_exchange_shuffle_equals_partition_by(
    spark: Any, sx: ModuleType, name: str, mode: str
) -> None:
    _, slices, n = DATASETS[name]
    if mode == "pipelined":
        n = 2  # from 2 input partitions or 3
    sc = spark.sparkContext
    rdd = sc.parallelize(records_of(name), slices)
    out = exchange_shuffle(rdd, n, mode=mode)
    assert out.getNumPartitions() == n
    got = out.glom().collect()
    sx.assert_exact_partitions(got, reference(spark, name, slices, n))
    if mode == "blocking":
        # a blocking exchange is read again, with the same result, until it is released
        sx.assert_exact_partitions(out.glom().collect(), got)
        assert release_exchange(out) == slices
    else:
        assert release_exchange(out) == 0  # pipelined partitions go once they are read


def test_values_come_back_exactly_as_written(spark: Any, sx: ModuleType) -> None:
    rows = [(1, [1, [2, 3]]), (2, {"a": [1]}), (3, b"\x00"), (4, "s"), (5, 1.0), (6, True)]
    out = exchange_shuffle(spark.sparkContext.parallelize(rows, 2), 2)
    got = sorted(out.collect())
    sx.assert_exact(got, rows)
    release_exchange(out)


def test_msgpack_stays_an_explicit_choice(spark: Any) -> None:
    from exchange.serialization.record_codec import MsgpackCodec

    rows = [(1, [1, [2, 3]]), (2, {"a": [1]})]
    out = exchange_shuffle(
        spark.sparkContext.parallelize(rows, 2), 2, codec=MsgpackCodec(tuples=True)
    )
    assert sorted(out.collect()) == [(1, (1, (2, 3))), (2, {"a": (1,)})]
    release_exchange(out)


def test_release_exchange_frees_partitions_and_rereading_fails_typed(spark: Any) -> None:
    sc = spark.sparkContext
    records = [(i % 31, f"r{i}") for i in range(5000)]
    out = exchange_shuffle(sc.parallelize(records, 3), 4, mode="blocking")
    assert sorted(out.collect()) == sorted(records)
    before = daemon_stats()
    ours = [p for p in before["partitions"]["items"] if out.exchange_id in str(p)]
    assert len(ours) == 3, before["partitions"]

    assert release_exchange(out) == 3
    assert release_exchange(out) == 0  # already released: nothing left, no error
    after = daemon_stats()
    assert not [p for p in after["partitions"]["items"] if out.exchange_id in str(p)]

    with pytest.raises(PythonException) as excinfo:  # a Python task of the job raised
        out.count()
    assert "PartitionReleasedError" in str(excinfo.value), str(excinfo.value)[-2000:]
    assert "exchange.errors" in str(excinfo.value)
    net = daemon_stats()["network"]
    assert net["available_segments"] == net["total_segments"], net


@pytest.mark.parametrize("n_in", [3, 2])
def test_pipelined_needs_as_many_slots_as_partitions(spark: Any, n_in: int) -> None:
    sc = spark.sparkContext
    with pytest.raises(UsageError) as excinfo:
        exchange_shuffle(sc.parallelize(range(30), n_in).map(lambda i: (i, i)), 3, mode="pipelined")
    msg = str(excinfo.value)
    assert "3 task slots" in msg and "only 2" in msg, msg
    assert "blocking" in msg  # says what to do instead


@pytest.mark.parametrize(
    "args",
    [(0, "blocking"), (-1, "blocking"), (2.0, "blocking"), (True, "blocking"), (2, "eager")],
)
def test_bad_arguments_are_usage_errors(spark: Any, args: tuple[Any, str]) -> None:
    rdd = spark.sparkContext.parallelize([(1, 1)], 1)
    with pytest.raises(UsageError):
        exchange_shuffle(rdd, args[0], mode=args[1])


@pytest.mark.parametrize("slices", [2, 3])
def test_failing_pipelined_producer_fails_the_job_never_a_short_result(
    spark: Any, slices: int
) -> None:
    """2 input partitions: a barrier stage; 3: an ordinary stage over the input coalesced
    to 2 partitions (Spark does not kill the other tasks there: they fail on their own)."""
    sc = spark.sparkContext

    def explode(index: int, it: Iterator[Any]) -> Iterator[Any]:
        for k, rec in enumerate(it):
            if index == 0 and k == 2000:
                raise RuntimeError("producer 0 breaks mid-stream")
            yield rec

    records = [(i % 13, i) for i in range(20_000)]
    rdd = sc.parallelize(records, slices).mapPartitionsWithIndex(explode)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    # the job failed: a Python task's error, or the barrier stage's (a JVM SparkException)
    with pytest.raises((PythonException, Py4JJavaError)) as excinfo:
        out.collect()
    text = str(excinfo.value)
    # Spark reports whichever task failed first: producer 0 itself, a reader of its
    # partition, or the other producer, told that a reader left its stream early.
    assert (
        "producer 0 breaks mid-stream" in text
        or "ProducerFailedError" in text
        or "released by its consumer before the end" in text
    ), text[-2000:]
    # the session is still usable and the daemon's memory came back
    assert sc.parallelize([1, 2], 2).sum() == 3
    # A killed barrier task's Python worker may hold its reader until Spark tears the
    # worker down; the memory must come back once it does.
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_retried_producer_task_leaves_no_duplicates(tmp_path: Path, sx: ModuleType) -> None:
    """local[2,2] in its own process: producer 0 fails its first attempt mid-partition."""
    result = run_job("raise", tmp_path, sx.child_env())
    marks = [p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir()]
    assert marks == ["raise-producer"], "no attempt failed once"
    assert result["equal"] == [True] * 4, result
    assert result["counts"] == result["expected_counts"]
    assert sum(result["counts"]) == 20_000
    # the failed attempt wrote a partition that the daemon failed; only 3 are read
    assert result["totals"]["partitions_failed"] == 1, result["totals"]
    assert result["totals"]["partitions_created"] == 4, result["totals"]
    assert result["released"] == 3
    assert result["pool_whole"] is True


@pytest.mark.parametrize("slices", [2, 3, 1])
def test_pipelined_consumer_stopping_early_ends_the_stage_and_frees_the_daemon(
    spark: Any, slices: int
) -> None:
    """Each task takes one record and drops its reader with ~150 MB (more than the daemon's
    64 MiB of buffers) still to come: the reader is closed before the task waits for its writer,
    so the writer (held back by an unread stream) is failed, never left blocked. From 2
    input partitions (a barrier stage), 3 (coalesced: a task writes two one after the
    other) and 1 (padded: task 1 writes nothing)."""
    sc = spark.sparkContext
    payload = b"x" * 1024

    def rows(i: int, _: Any) -> Iterator[tuple[int, bytes]]:
        return ((k, payload) for k in range(i, 150_000, slices))

    rdd = sc.parallelize(range(slices), slices).mapPartitionsWithIndex(rows)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    try:
        firsts = out.mapPartitions(lambda it: [type(next(it)[1]).__name__]).collect()
    except Exception as e:  # the stage fails: a reader left its stream early
        text = str(e)
        assert "released by its consumer before the end" in text or "ProducerFailedError" in text, (
            text[-2000:]
        )
    else:  # every writer had finished before its readers stopped
        assert firsts == ["bytes", "bytes"]
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_pipelined_consumer_leaving_before_a_producer_wrote_leaves_nothing_behind(
    spark: Any, tmp_path: Path
) -> None:
    """Task 0 reads one record of producer 0 and leaves while producer 1 has written
    nothing yet (its first record waits for a flag file task 0 writes once it left).
    Producer 1's partition exists already (every task creates its partition before the
    rendezvous, so none is created after a reader left, the race of issue 21); task 0's
    subpartition of it is released (its reader closed, or, had its request not reached
    the daemon, abandoned), so producer 1 is never left waiting for it and nothing of
    the exchange stays on the daemon."""
    sc = spark.sparkContext
    flag = tmp_path / "task-0-left"

    def rows(i: int, _: Any) -> Iterator[tuple[int, bytes]]:
        # a generator: producer 1's writer thread waits at its first record, once its
        # task has met the others (a function waiting when called would hold the task)
        if i == 1:  # producer 1 writes once task 0 has left
            deadline = time.monotonic() + 240
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
        yield from ((k, b"r" * 1000) for k in range(i * 100, i * 100 + 40))  # both subparts

    def consume(i: int, it: Iterator[Any]) -> Iterator[str]:
        if i == 1:
            yield f"read {sum(1 for _ in it)}"
            return
        next(it)  # a record of producer 0's partition: producer 1 has written none
        del it  # the reader goes: task 0 leaves its input early
        flag.touch()
        yield "left"

    rdd = sc.parallelize(range(2), 2).mapPartitionsWithIndex(rows)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    try:
        result = out.mapPartitionsWithIndex(consume).collect()
    except Exception as e:  # producer 1 (or 0) is told its subpartition 0 has no reader
        text = str(e)
        assert "released by its consumer before the end" in text or "ProducerFailedError" in text, (
            text[-2000:]
        )
    else:
        assert result == ["left", "read 40"], result
    assert flag.exists(), "task 0 never left"
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def _slot_holder(started: Path, release: Path) -> Callable[[Any], list[int]]:
    """A task function that holds its slot: it marks ``started``, then waits for
    ``release`` (at most 240 s)."""

    def hold(_: Any) -> list[int]:
        started.touch()
        deadline = time.monotonic() + 240
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return [1]

    return hold


def test_a_pipelined_run_short_of_a_slot_has_its_partitions_made_and_runs_once_it_frees(
    spark: Any, tmp_path: Path
) -> None:
    """Another job holds one of the 2 slots: the ordinary stage of a 1-into-2 exchange
    starts one task, which creates its partition on the daemon before it waits at the
    rendezvous (so no reader of a run ever asks for a partition not there yet); once
    the slot frees, within the start deadline, the run completes."""
    sc = spark.sparkContext
    started, release = tmp_path / "started", tmp_path / "release"
    hold = _slot_holder(started, release)

    records = [(i % 17, i) for i in range(2000)]
    out = exchange_shuffle(sc.parallelize(records, 1), 2, mode="pipelined")
    results: dict[str, Any] = {}

    def run(name: str, action: Callable[[], Any]) -> threading.Thread:
        def target() -> None:
            try:
                results[name] = action()
            except BaseException as e:  # the test fails below, naming it
                results[name] = e

        thread = threading.Thread(target=target, name=name)
        thread.start()
        return thread

    holder = run("hold", lambda: sc.parallelize([0], 1).mapPartitions(hold).collect())
    exchanging: threading.Thread | None = None
    try:
        wait_for(started.exists, 120, "the job holding a slot")
        exchanging = run("exchange", out.collect)
        wait_for(
            lambda: any(out.exchange_id in str(p) for p in daemon_stats()["partitions"]["items"]),
            50,  # within the 60 s start deadline
            "task 0's partition on the daemon while it waits for task 1",
        )
        assert "exchange" not in results, results  # still waiting for its second slot
    finally:
        release.touch()
        holder.join(240)
        if exchanging is not None:
            exchanging.join(240)
    assert results["hold"] == [1]
    assert sorted(results["exchange"]) == sorted(records), results["exchange"]
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def _writer_threads_in_workers(sc: Any) -> list[str]:
    """The writer threads of pipelined exchanges alive in the Python workers a small job
    runs on (workers are reused: a thread a task left behind is still there)."""

    def writers(_: Any) -> list[str]:
        import threading

        return [t.name for t in threading.enumerate() if t.name.startswith("exchange-writer-")]

    names: list[str] = sc.parallelize(range(2), 2).mapPartitions(writers).collect()
    return names


@pytest.mark.parametrize(
    ("task_1", "slices"),
    [("never starts either", 2), ("reads to the end", 2), ("never starts either", 3)],
)
def test_a_pipelined_output_spark_never_starts_leaves_no_writer_and_nothing_on_the_daemon(
    spark: Any, task_1: str, slices: int
) -> None:
    """The function after the exchange returns without ever iterating its input, so Spark
    drops task 0's output iterator unstarted, with ~100 MB written by the two producers
    (more than the daemon's 64 MiB of buffers). Task 0 leaves as a task stopping early
    does: its subpartition abandoned on every producer's daemon, its writer failed and
    joined before the task ends. Nothing of the run stays on the daemon and no writer
    thread is left in a worker. (Before: a generator never started runs none of its code
    when dropped; the job succeeded, the writers stayed blocked in the reused workers for
    ever and the daemon kept their partitions and buffers.)"""
    sc = spark.sparkContext
    payload = b"x" * 1024

    def rows(i: int, _: Any) -> Iterator[tuple[int, bytes]]:
        return ((k, payload) for k in range(i, 100_000, slices))

    reads = task_1 == "reads to the end"

    def consume(i: int, it: Iterator[Any]) -> list[str]:
        if i == 1 and reads:
            return [f"read {sum(1 for _ in it)}"]
        return ["never started"]

    rdd = sc.parallelize(range(slices), slices).mapPartitionsWithIndex(rows)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    try:
        result = out.mapPartitionsWithIndex(consume).collect()
    except Exception as e:  # task 1 read a partition whose writer task 0 failed
        assert reads, str(e)[-2000:]
        text = str(e)
        assert "released by its consumer before the end" in text or "ProducerFailedError" in text, (
            text[-2000:]
        )
    else:  # every writer had finished (task 1 reading: before task 0 left)
        assert result[0] == "never started" and len(result) == 2, result
    wait_until_daemon_holds_nothing_of(out.exchange_id)
    assert _writer_threads_in_workers(sc) == []


@pytest.mark.parametrize("slices", [2, 3])
def test_a_pipelined_job_cancelled_while_its_tasks_read_leaves_nothing_on_the_daemon(
    spark: Any, slices: int
) -> None:
    """The action is cancelled (its job tag, with interruption: a user's cancel, or the
    failure of a job it belongs to) while both tasks read slowly with ~100 MB to come.
    Spark kills the tasks' Python workers, whose ``finally`` blocks never run: the daemon
    frees the run when their connections close. (Main before this branch passed this
    too: recorded so that it stays so.)"""
    sc = spark.sparkContext
    payload = b"x" * 1024

    def rows(i: int, _: Any) -> Iterator[tuple[int, bytes]]:
        return ((k, payload) for k in range(i, 100_000, slices))

    def slow(it: Iterator[Any]) -> Iterator[int]:
        n = 0
        for _ in it:  # ~25 s for all: the job is cancelled long before
            n += 1
            if n % 100 == 0:
                time.sleep(0.05)
        yield n

    rdd = sc.parallelize(range(slices), slices).mapPartitionsWithIndex(rows)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    tag = f"cancel-{out.exchange_id}"
    cancelled: list[BaseException | None] = []

    def cancel_once_writing() -> None:
        try:
            wait_for(
                lambda: any(
                    out.exchange_id in str(p) for p in daemon_stats()["partitions"]["items"]
                ),
                120,
                "the run's partitions on the daemon",
            )
            sc.cancelJobsWithTag(tag)
            cancelled.append(None)
        except BaseException as e:  # the test fails below, naming it
            cancelled.append(e)

    sc.addJobTag(tag)
    sc.setInterruptOnCancel(True)
    canceller = threading.Thread(target=cancel_once_writing, name="cancel-job")
    canceller.start()
    try:
        with pytest.raises(Py4JJavaError, match=r"(?i)cancel"):
            out.mapPartitions(slow).collect()
    finally:
        sc.removeJobTag(tag)
        sc.setInterruptOnCancel(False)
        canceller.join()
    assert cancelled == [None], cancelled
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def _jobs_run(sc: Any, action: Callable[[], Any]) -> list[Any]:
    """The Spark jobs ``action`` ran (``SparkJobInfo``s, from the status tracker)."""
    group = f"count-jobs-{time.monotonic_ns()}"
    sc.setJobGroup(group, group)
    try:
        action()
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    tracker = sc.statusTracker()
    jobs = [tracker.getJobInfo(j) for j in tracker.getJobIdsForGroup(group)]
    assert all(j is not None for j in jobs), jobs
    return jobs


def _stages_run(sc: Any, action: Callable[[], Any]) -> int:
    """How many Spark stages ``action``'s jobs ran (a shuffle adds its map stage)."""
    jobs = _jobs_run(sc, action)
    assert jobs
    return sum(len(j.stageIds) for j in jobs)


@pytest.mark.parametrize(
    ("mode", "n_in"), [("blocking", 2), ("pipelined", 2), ("pipelined", 3), ("pipelined", 1)]
)
def test_the_next_by_key_operation_does_not_shuffle_again(spark: Any, mode: str, n_in: int) -> None:
    """The result carries ``partitionBy``'s ``Partitioner``: reduceByKey, groupByKey and
    partitionBy with the same partitioning run in the reading stage, with no shuffle of
    their own; so does a pipelined result from another count of input partitions (its
    ordinary stage coalesces or pads the input: no shuffle either).
    (A fresh exchange per action: a pipelined exchange runs again with each.)"""
    from pyspark.rdd import Partitioner, portable_hash

    sc = spark.sparkContext
    records = [(f"k{i % 97}", i) for i in range(20_000)]
    # a map in front: pipelined mode's barrier stage takes it in
    rdd = sc.parallelize(records, n_in).map(lambda r: r)
    sums: dict[str, int] = collections.Counter()
    for k, v in records:
        sums[k] += v
    exchanged: list[Any] = []

    def fresh() -> Any:
        exchanged.append(exchange_shuffle(rdd, 2, mode=mode))
        return exchanged[-1]

    assert fresh().partitioner == Partitioner(2, portable_hash) == rdd.partitionBy(2).partitioner
    add = operator.add
    # reading alone is one stage; a shuffle would add its map stage
    # (blocking: the exchange's own map stage runs in the action's job, before the reading)
    own = 2 if mode == "blocking" else 1
    got: list[Any] = []
    out = fresh()
    assert _stages_run(sc, lambda: got.extend(out.reduceByKey(add).collect())) == own
    assert dict(got) == sums
    grouped: list[Any] = []
    out = fresh()
    assert _stages_run(sc, lambda: grouped.extend(out.groupByKey().mapValues(sum).collect())) == own
    assert dict(grouped) == sums
    out = fresh()
    assert _stages_run(sc, lambda: out.partitionBy(2).count()) == own
    # another partitioning still shuffles, as after partitionBy
    out = fresh()
    assert _stages_run(sc, lambda: out.reduceByKey(add, 3).count()) == own + 1
    for out in exchanged:
        release_exchange(out)
        wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_exchange_hash_stays_a_choice(spark: Any, sx: ModuleType) -> None:
    from pyspark.rdd import Partitioner

    sc = spark.sparkContext
    records = [(k, i) for i, k in enumerate(_zipf_keys(5000, 300, 1.2, seed=3))] + [
        (f"s{i}", i) for i in range(500)
    ]
    rdd = sc.parallelize(records, 2)
    out = exchange_shuffle(rdd, 3, exchange_hash)
    assert out.partitioner == Partitioner(3, exchange_hash)
    sx.assert_exact_partitions(
        out.glom().collect(), rdd.partitionBy(3, exchange_hash).glom().collect()
    )
    release_exchange(out)


@pytest.mark.parametrize("bad", [7, None, (), "", {"no": "item 0"}])
def test_a_record_that_is_not_a_pair_fails_the_action_naming_it(spark: Any, bad: Any) -> None:
    sc = spark.sparkContext
    rdd = sc.parallelize([(i, i) for i in range(1000)] + [bad] + [(1, 1)], 2)
    out = exchange_shuffle(rdd, 3)  # lazy, as partitionBy: nothing ran yet
    with pytest.raises(PythonException) as excinfo:
        out.count()
    text = str(excinfo.value)
    assert "exchange.errors.NotAPairError: record" in text, text[-3000:]
    msg = f"record {bad!r} of type {type(bad).__name__} is not a (key, value) pair"
    assert msg in text, text[-3000:]
    assert "rdd.map(lambda r: (key_of(r), r))" in text, text[-3000:]  # the fix
    assert issubclass(NotAPairError, TypeError)  # what unpacking a non-pair raises
    # the partition the good task wrote is freed with the daemon's segments
    net = daemon_stats()["network"]
    deadline = time.monotonic() + 60
    while net["available_segments"] != net["total_segments"]:
        assert time.monotonic() < deadline, net
        time.sleep(0.1)
        net = daemon_stats()["network"]


def test_a_non_pair_in_a_pipelined_exchange_fails_its_job_naming_the_record(spark: Any) -> None:
    sc = spark.sparkContext
    rdd = sc.parallelize([(i, i) for i in range(1000)] + [42], 2)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    with pytest.raises(Exception) as excinfo:
        out.count()
    text = str(excinfo.value)
    # Spark reports whichever task of the barrier stage failed first: the producer's own
    # (NotAPairError) or a reader of its partition (ProducerFailedError quoting it), both
    # naming the record; or, under load, the other task's producer, whose subpartition
    # that failed reader released (ProducerFailedError saying so: a consequence)
    assert "NotAPairError" in text or "ProducerFailedError" in text, text[-3000:]
    assert (
        "record 42 of type int is not a (key, value) pair" in text
        or "was released by its consumer before the end" in text
    ), text[-3000:]
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_dataframe_is_refused_at_once_with_the_way_to_an_rdd(spark: Any) -> None:
    df = spark.createDataFrame([(1, "a"), (2, "b")], "key long, v string")
    with pytest.raises(UsageError) as excinfo:
        exchange_shuffle(df, 2)
    msg = str(excinfo.value)
    assert "got a DataFrame" in msg and "df.rdd.map(" in msg, msg
    out = exchange_shuffle(df.rdd.map(lambda row: (row["key"], row)), 2)
    assert sorted(k for k, _ in out.collect()) == [1, 2]
    release_exchange(out)


def test_a_blocking_exchange_is_one_spark_job_per_action(spark: Any, sx: ModuleType) -> None:
    """exchange_shuffle runs nothing (lazy, as partitionBy); an action runs one job whose
    map stage writes to the daemons; a second action reads them again in one job whose
    map stage Spark skips (the daemons still hold the partitions), with the same result."""
    sc = spark.sparkContext
    records = [(i % 53, f"v{i}") for i in range(6000)]
    rdd = sc.parallelize(records, 3)
    made: list[Any] = []
    assert _jobs_run(sc, lambda: made.append(exchange_shuffle(rdd, 4))) == []
    out = made[0]
    got: list[Any] = []
    jobs = _jobs_run(sc, lambda: got.extend(out.glom().collect()))
    assert len(jobs) == 1 and len(jobs[0].stageIds) == 2, jobs
    want = rdd.partitionBy(4).glom().collect()
    sx.assert_exact_partitions(got, want)
    written = daemon_stats()["totals"]["partitions_created"]
    again: list[Any] = []
    jobs = _jobs_run(sc, lambda: again.extend(out.glom().collect()))
    assert len(jobs) == 1, jobs
    sx.assert_exact_partitions(again, want)
    assert daemon_stats()["totals"]["partitions_created"] == written  # nothing written again
    assert release_exchange(out) == 3
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_finished_partition_of_another_attempt_is_never_read(spark: Any, sx: ModuleType) -> None:
    """Readers take the attempts whose map output Spark committed, never whatever the
    daemon holds under the exchange: a finished partition of input partition 0 written
    by another attempt (as a retried or speculative task leaves) changes nothing."""
    from pyspark.rdd import portable_hash

    from client import spark as xs
    from exchange.serialization.record_codec import default_codec

    sc = spark.sparkContext
    records = [(i % 41, i) for i in range(4000)]
    rdd = sc.parallelize(records, 2)
    out = exchange_shuffle(rdd, 3)
    want = rdd.partitionBy(3).glom().collect()
    sx.assert_exact_partitions(out.glom().collect(), want)
    app = str(sc.applicationId)
    spec = xs._DaemonSpec(get_embedded_daemon().socket, xs.mint_app_credential(app), app)
    stray = [(k, -1) for k in range(41)]
    produced = xs._write_partition(
        out.exchange_id, 0, 1 << 40, stray, 3, portable_hash, spec, default_codec(), True
    )
    assert produced.records == len(stray)
    ours = [p for p in daemon_stats()["partitions"]["items"] if out.exchange_id in str(p)]
    assert len(ours) == 3, ours  # two committed attempts and the stray one
    sx.assert_exact_partitions(out.glom().collect(), want)
    assert release_exchange(out) == 3
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_pipelined_exchange_runs_again_with_every_action(spark: Any, sx: ModuleType) -> None:
    """Regression: each action runs the barrier stage anew; its tasks met the previous
    run's registrations at the rendezvous and read its partitions, already released
    (PartitionReleasedError or ProducerFailedError, in about one action of three)."""
    sc = spark.sparkContext
    records = [(f"k{i % 71}", i) for i in range(30_000)]
    rdd = sc.parallelize(records, 2)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    want = rdd.partitionBy(2).glom().collect()
    # back to back: the runs' attempt ids are adjacent, as in the failures seen
    runs = [out.glom().collect() for _ in range(8)]
    for got in runs:
        sx.assert_exact_partitions(got, want)
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_join_of_two_blocking_exchanges_with_one_partitioning_does_not_shuffle(
    spark: Any,
) -> None:
    """Both results' JVM RDDs carry the partitioner of the location shuffle under them, so
    PySpark's join unions them partition by partition (``PartitionerAwareUnionRDD``) and
    groups in place: the job runs the two exchanges' map stages and one reading stage."""
    sc = spark.sparkContext
    left = sc.parallelize([(i % 13, i) for i in range(1000)], 2)
    right = sc.parallelize([(i % 13, -i) for i in range(1000)], 3)
    a, b = exchange_shuffle(left, 2), exchange_shuffle(right, 2)
    got: list[Any] = []
    assert _stages_run(sc, lambda: got.extend(a.join(b).collect())) == 3
    assert sorted(got) == sorted(left.join(right).collect())
    assert "PartitionerAwareUnionRDD" in a.join(b).toDebugString().decode()
    for out in (a, b):
        release_exchange(out)
        wait_until_daemon_holds_nothing_of(out.exchange_id)


@pytest.mark.parametrize(("n_in", "n"), [(4, 2), (1, 2), (5, 1), (0, 2)])
def test_a_pipelined_exchange_of_another_input_partition_count_equals_partition_by(
    spark: Any, sx: ModuleType, n_in: int, n: int
) -> None:
    """More input partitions than output (coalesced: a task writes several, one after the
    other, as one producer), fewer (padded with empty ones: those tasks only read), none:
    one job of one stage (an ordinary one: Spark's barrier mode refuses a stage whose RDD
    chain changes the partition count), and partitionBy's partitions and partitioner."""
    sc = spark.sparkContext
    rdd = sc.parallelize(records_of("mixed-types"), n_in) if n_in else sc.emptyRDD()
    out = exchange_shuffle(rdd, n, mode="pipelined")
    assert out.getNumPartitions() == n
    assert out.partitioner == rdd.partitionBy(n).partitioner
    got: list[Any] = []
    jobs = _jobs_run(sc, lambda: got.extend(out.glom().collect()))
    assert len(jobs) == 1 and len(jobs[0].stageIds) == 1, jobs
    sx.assert_exact_partitions(got, rdd.partitionBy(n).glom().collect())
    wait_until_daemon_holds_nothing_of(out.exchange_id)


@pytest.mark.parametrize("n_in", [4, 1])
def test_a_pipelined_exchange_of_another_input_partition_count_streams(
    spark: Any, n_in: int
) -> None:
    """~100 MB (more than the daemon's 64 MiB of buffers) from 4 input partitions or 1
    into 2: pipelined partitions hold no more than their buffers, so the writers can end
    only while the readers of the same run read (a task's writer and reader at once)."""
    sc = spark.sparkContext
    payload = b"x" * 1024
    count = 100_000

    def rows(i: int, _: Any) -> Iterator[tuple[int, bytes]]:
        return ((k, payload) for k in range(i, count, n_in))

    def summary(i: int, it: Iterator[Any]) -> Iterator[tuple[int, int, int, int]]:
        records = total = wrong = 0
        for k, v in it:
            records += 1
            total += k
            wrong += k % 2 != i or v != payload  # portable_hash of a small int is the int
        yield (i, records, total, wrong)

    out = exchange_shuffle(
        sc.parallelize(range(n_in), n_in).mapPartitionsWithIndex(rows), 2, mode="pipelined"
    )
    got = sorted(out.mapPartitionsWithIndex(summary).collect())
    assert got == [(i, count // 2, sum(range(i, count, 2)), 0) for i in range(2)]
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_take_of_a_pipelined_exchange_of_another_partition_count_is_refused_at_once(
    spark: Any,
) -> None:
    """take and first run a job over some partitions only: the ordinary stage's
    task that starts is told at once (the driver asks Spark how many tasks the stage
    runs) with a UsageError naming the way out, not left waiting for the others. (With
    as many input as output partitions Spark itself refuses them on a barrier stage.)"""
    sc = spark.sparkContext
    records = [(i % 11, i) for i in range(1000)]
    rdd = sc.parallelize(records, 3)
    out = exchange_shuffle(rdd, 2, mode="pipelined")
    for action in (lambda: out.take(1), out.first):
        with pytest.raises(PythonException) as excinfo:
            action()
        text = str(excinfo.value)
        assert "exchange.errors.UsageError" in text, text[-3000:]
        assert "the job runs 1 of the 2 tasks of its pipelined exchange" in text, text[-3000:]
        assert "use collect()" in text, text[-3000:]
    assert sorted(out.collect()) == sorted(records)
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_pipelined_exchange_short_of_free_slots_fails_typed_never_hangs(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another job holds one of the 2 slots: the ordinary stage of a 1-into-2 exchange
    starts one task, which waits for the other at the rendezvous until the start
    deadline and fails the job with a SchedulingError saying what it needs (no silent
    deadlock). Once the slot is free the same exchange runs."""
    from client import spark as xs

    monkeypatch.setattr(xs, "PIPELINED_START_TIMEOUT", 5.0)  # read by exchange_shuffle
    sc = spark.sparkContext
    started, release = tmp_path / "started", tmp_path / "release"
    hold = _slot_holder(started, release)

    held: list[Any] = []
    holder = threading.Thread(
        target=lambda: held.append(sc.parallelize([0], 1).mapPartitions(hold).collect()),
        name="hold-a-slot",
    )
    records = [(i % 17, i) for i in range(2000)]
    holder.start()
    try:
        wait_for(started.exists, 120, "the job holding a slot")
        out = exchange_shuffle(sc.parallelize(records, 1), 2, mode="pipelined")
        with pytest.raises(PythonException) as excinfo:
            out.collect()
    finally:
        release.touch()
        holder.join(240)
    text = str(excinfo.value)
    assert "exchange.errors.SchedulingError" in text, text[-3000:]
    assert "waited 5s for the other 1 tasks" in text and "needs 2 free task slots" in text, text[
        -3000:
    ]
    assert held == [[1]]
    assert sorted(out.collect()) == sorted(records)
    wait_until_daemon_holds_nothing_of(out.exchange_id)


def test_a_pipelined_task_retried_alone_fails_its_job_typed_never_hangs(
    tmp_path: Path, sx: ModuleType
) -> None:
    """local[2,2] in its own process: a task of a 3-into-2 pipelined exchange (an
    ordinary stage) fails on its first attempt; Spark retries it alone, which cannot
    complete a pipelined exchange: the retry is refused at once at the rendezvous and the
    job fails with a SchedulingError naming the way out; the daemon is left whole."""
    result = run_job("pipelined-retry", tmp_path, sx.child_env())
    marks = [p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir()]
    assert marks == ["pipelined-retry-producer"], "no attempt failed once"
    text = result["error"]
    assert "exchange.errors.SchedulingError" in text, text[-3000:]
    assert "cannot run again alone" in text and "mode='blocking'" in text, text[-3000:]
    assert result["partitions_left"] == 0, result
    assert result["pool_whole"] is True


def test_a_pipelined_exchange_of_another_partition_count_refuses_speculation(
    spark: Any,
) -> None:
    """A speculative copy of a task would meet the exchange as a second attempt of its
    index: refused at the call (the live conf is changed here: only the check reads it)."""
    sc = spark.sparkContext
    conf = sc._conf
    conf.set("spark.speculation", "true")
    try:
        with pytest.raises(UsageError) as excinfo:
            exchange_shuffle(sc.parallelize([(1, 1)], 3), 2, mode="pipelined")
        msg = str(excinfo.value)
        assert "spark.speculation is on" in msg and "mode='blocking'" in msg, msg
        # a barrier stage is never speculated: as many input as output partitions go on
        exchange_shuffle(sc.parallelize([(1, 1)], 2), 2, mode="pipelined")
    finally:
        conf.set("spark.speculation", "false")


def test_a_lost_daemon_fails_the_read_typed_naming_it(spark: Any) -> None:
    """The daemon holding an exchange's partitions dies between two actions: the next
    read fails with the exchange's TransportError naming that daemon. (Last in the
    module: the embedded daemon is killed; the next exchange starts another.)"""
    sc = spark.sparkContext
    out = exchange_shuffle(sc.parallelize([(i % 7, i) for i in range(2000)], 2), 2)
    assert out.count() == 2000
    daemon = get_embedded_daemon()
    daemon.proc.kill()
    daemon.proc.wait()
    with pytest.raises(PythonException) as excinfo:
        out.count()
    text = str(excinfo.value)
    assert "exchange.errors.TransportError: cannot reach daemon at" in text, text[-3000:]
    assert daemon.socket in text, text[-3000:]
    # the session goes on with a new embedded daemon
    again = exchange_shuffle(sc.parallelize([(1, 1), (2, 2)], 2), 2)
    assert sorted(again.collect()) == [(1, 1), (2, 2)]
    release_exchange(again)
