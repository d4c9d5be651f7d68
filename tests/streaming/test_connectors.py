"""Connectors driven by hand through the runtime's call order, with crashes.

Each test plays the runtime: open -> poll/process -> snapshot_state(N) -> (complete: notify)
-> crash (drop the objects, sometimes after close) -> new objects whose operator state is
restored from the backends' snapshot bytes of the latest completed checkpoint -> open ->
continue. Exactly-once means: the records a source emitted up to each restored checkpoint,
plus everything of the last attempt, are the expected records, each once; a sink's
committed output is exactly the records of completed checkpoints.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import json
import logging
import math
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from client.streaming.connectors import (
    CollectSink,
    FileSink,
    FileSource,
    GeneratorSource,
    SinkCommitError,
    SourceFormatError,
)
from client.streaming.functions import Operator, OperatorContext, Source
from exchange.errors import ConfigError, UsageError
from exchange.state import CorruptSnapshotError, OperatorStateBackend


class ListCollector:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def collect(self, record: Any) -> None:
        self.records.append(record)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def op_ctx(
    k: int,
    p: int,
    snaps: list[bytes] | None = None,
    attempt: int = 0,
    op_id: str = "op",
    restored: int | None = None,
) -> OperatorContext:
    backend = OperatorStateBackend(k, p)
    if snaps is not None:
        backend.restore(snaps)
    return OperatorContext("job", op_id, k, p, attempt, backend, restored_checkpoint_id=restored)


def open_all(
    make: Callable[[], Operator], p: int, snaps: list[bytes] | None, attempt: int, op_id: str
) -> list[tuple[Any, OperatorContext]]:
    subs = []
    for k in range(p):
        op, ctx = make(), op_ctx(k, p, snaps, attempt, op_id)
        op.open(ctx)
        subs.append((op, ctx))
    return subs


def snapshot_all(subs: list[tuple[Any, OperatorContext]], cid: int) -> list[bytes]:
    for op, _ in subs:
        op.snapshot_state(cid)
    return [ctx.operator_state.snapshot() for _, ctx in subs]


def run_source_with_crashes(
    make: Callable[[], Source], parallelisms: list[int], rng: random.Random
) -> list[list[list[Any]]]:
    """Runs attempts with the given parallelisms, crashing all but the last at a random
    point; returns per attempt, per subtask, the records that count (emitted before the
    checkpoint the next attempt restores from; everything in the last attempt)."""
    snaps: list[bytes] | None = None
    cid = 0
    kept: list[list[list[Any]]] = []
    for attempt, p in enumerate(parallelisms):
        subs = open_all(make, p, snaps, attempt, "src")
        outs = [ListCollector() for _ in range(p)]
        at_checkpoint = [0] * p
        last = attempt == len(parallelisms) - 1
        if not last:
            for _ in range(rng.randrange(3, 40)):
                if rng.random() < 0.2:
                    cid += 1
                    snaps = snapshot_all(subs, cid)
                    at_checkpoint = [len(o.records) for o in outs]
                else:
                    k = rng.randrange(p)
                    subs[k][0].poll(outs[k], rng.randrange(1, 25))
            kept.append([o.records[:n] for o, n in zip(outs, at_checkpoint, strict=True)])
            for op, _ in subs:  # crash: some get closed, some just vanish
                if rng.random() < 0.5:
                    op.close()
            continue
        running = set(range(p))
        for _ in range(100_000):
            if not running:
                break
            k = rng.choice(sorted(running))
            if not subs[k][0].poll(outs[k], rng.randrange(1, 60)):
                running.discard(k)
        assert not running, "a bounded source never ended"
        for op, _ in subs:
            op.close()
        kept.append([o.records for o in outs])
    return kept


def per_subtask(kept: list[list[list[Any]]]) -> list[list[Any]]:
    p = len(kept[0])
    assert all(len(a) == p for a in kept)
    return [[r for attempt in kept for r in attempt[k]] for k in range(p)]


def flat(kept: list[list[list[Any]]]) -> list[Any]:
    return [r for attempt in kept for sub in attempt for r in sub]


# -- generator --------------------------------------------------------------------------------


def gen_record(i: int) -> dict[str, int]:
    return {"i": i, "v": i * 7 % 13}


@pytest.mark.parametrize("seed", range(6))
def test_generator_exactly_once_across_crashes(seed: int) -> None:
    rng = random.Random(seed)
    count, p = 500, 2
    kept = run_source_with_crashes(
        lambda: GeneratorSource(gen_record, count=count), [p, p, p, p], rng
    )
    for k, records in enumerate(per_subtask(kept)):
        assert records == [gen_record(i) for i in range(k, count, p)]


@pytest.mark.parametrize("parallelisms", [[2, 3, 3], [3, 2, 1], [2, 1, 4, 2], [1, 3]])
def test_generator_rescale_keeps_every_index_once(parallelisms: list[int]) -> None:
    for seed in range(4):
        rng = random.Random(seed)
        count = 300
        kept = run_source_with_crashes(
            lambda: GeneratorSource(gen_record, count=300), parallelisms, rng
        )
        got = sorted(r["i"] for r in flat(kept))
        assert got == list(range(count))


def test_generator_unbounded_and_empty() -> None:
    src = GeneratorSource(lambda i: i)
    assert not src.bounded
    src.open(op_ctx(0, 1))
    out0 = ListCollector()
    src.poll(out0, 3)
    ctx = src.ctx
    src.snapshot_state(1)
    src = GeneratorSource(lambda i: i)
    src.open(op_ctx(1, 3))
    out = ListCollector()
    assert src.poll(out, 4) is True
    assert out.records == [1, 4, 7, 10]
    empty = GeneratorSource(lambda i: i, count=0)
    empty.open(op_ctx(0, 1))
    assert empty.poll(out, 10) is False
    # restored with more subtasks than splits: the extra unbounded one idles for good
    snap = [ctx.operator_state.snapshot()]
    idle = GeneratorSource(lambda i: i)
    idle.open(op_ctx(1, 2, snap, attempt=1))
    assert idle.poll(out, 10) is True
    assert idle.ready_in() == math.inf
    # a subtask with nothing to do (index 2 of 3, count 2) ends at once
    short = GeneratorSource(lambda i: i, count=2)
    short.open(op_ctx(2, 3))
    assert short.poll(out, 10) is False


def test_generator_rate_limit_on_a_fake_clock() -> None:
    clock = FakeClock()
    subs = []
    for k in range(2):
        src = GeneratorSource(lambda i: i, rate=200.0, clock=clock)  # 100/s per subtask
        src.open(op_ctx(k, 2))
        subs.append(src)
    out = ListCollector()
    assert subs[0].poll(out, 1000) is True
    assert out.records == [0]  # one token to start with
    assert subs[0].poll(out, 1000) is True  # nothing due: returns at once, no sleep
    assert out.records == [0]
    assert subs[0].ready_in() == pytest.approx(0.01)
    clock.now += 0.055
    subs[0].poll(out, 1000)
    assert out.records == [0, 2, 4, 6, 8, 10]
    clock.now += 60  # a backpressured minute: at most 100 ms worth in one burst
    out.records.clear()
    subs[0].poll(out, 1000)
    assert len(out.records) == 10
    assert subs[0].ready_in() > 0
    clock.now += 0.5
    out.records.clear()
    subs[1].poll(out, 3)  # max_records still bounds a poll
    assert out.records == [1, 3, 5]


def test_generator_bad_arguments() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"count": -1}, "count"),
        ({"count": 1.5}, "count"),
        ({"rate": 0}, "rate"),
        ({"rate": float("inf")}, "rate"),
        ({"rate": True}, "rate"),
    ]
    for kwargs, setting in cases:
        with pytest.raises(ConfigError) as info:
            GeneratorSource(lambda i: i, **kwargs)
        assert info.value.setting == setting
    with pytest.raises(ConfigError):
        GeneratorSource(42)  # type: ignore[arg-type]


def test_generator_corrupt_split_table_is_rejected() -> None:
    ctx = op_ctx(0, 1)
    ctx.operator_state.union_list_state("op", "generator-started").update([True])
    ctx.operator_state.union_list_state("op", "generator-splits").update([(0, 2, 4)])
    with pytest.raises(CorruptSnapshotError, match="progression"):
        GeneratorSource(lambda i: i, count=10).open(ctx)


# -- file source ------------------------------------------------------------------------------


def write_inputs(root: str, fmt: str, files: int, rows: int, seed: int) -> list[list[Any]]:
    """Input files ``in-<j>.<fmt>`` under ``root`` (an fsspec URL); their records, by file."""
    rng = random.Random(seed)
    fs, base = fsspec.core.url_to_fs(root)
    fs.makedirs(base, exist_ok=True)
    all_records = []
    for j in range(files):
        n = rng.randrange(0, rows) if j else rows  # some files are short or empty
        records = [{"f": str(j), "n": str(i), "w": "x" * rng.randrange(0, 30)} for i in range(n)]
        path = f"{base}/in-{j:02d}.{fmt}"
        if fmt == "jsonl":
            with fs.open(path, "wb") as f:
                for r in records:
                    f.write(json.dumps(r).encode() + b"\n")
                    if rng.random() < 0.1:
                        f.write(b"\n")  # blank lines are skipped
        elif fmt == "csv":
            with fs.open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, ["f", "n", "w"])
                writer.writeheader()
                writer.writerows(records)
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            table = pa.Table.from_pylist(records, schema=_schema())
            with fs.open(path, "wb") as f:
                pq.write_table(table, f, row_group_size=7)
        all_records.append(records)
    return all_records


def _schema() -> Any:
    import pyarrow as pa

    return pa.schema([("f", pa.string()), ("n", pa.string()), ("w", pa.string())])


@pytest.fixture
def memory_root() -> Iterator[str]:
    root = f"/src-{uuid.uuid4().hex}"
    yield f"memory://{root}"
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
@pytest.mark.parametrize("seed", range(3))
def test_file_source_exactly_once_across_crashes(tmp_path: Path, fmt: str, seed: int) -> None:
    by_file = write_inputs(str(tmp_path / "in"), fmt, files=5, rows=60, seed=seed)
    (tmp_path / "in" / "_SUCCESS").write_text("")  # hidden by its name
    (tmp_path / "in" / ".tmp.jsonl").write_text("{broken\n")
    p = 2
    kept = run_source_with_crashes(
        lambda: FileSource(str(tmp_path / "in"), format=fmt), [p] * 4, random.Random(seed)
    )
    for k, records in enumerate(per_subtask(kept)):
        want = [r for j, recs in enumerate(by_file) if j % p == k for r in recs]
        assert records == want


def test_file_source_on_memory_fs_with_a_glob(memory_root: str) -> None:
    by_file = write_inputs(memory_root, "jsonl", files=4, rows=50, seed=11)
    fs = fsspec.filesystem("memory")
    fs.pipe(memory_root.removeprefix("memory://") + "/other.txt", b"not matched\n")
    kept = run_source_with_crashes(
        lambda: FileSource(f"{memory_root}/in-*.jsonl"), [3, 3, 3], random.Random(5)
    )
    for k, records in enumerate(per_subtask(kept)):
        assert records == [r for j, recs in enumerate(by_file) if j % 3 == k for r in recs]


@pytest.mark.parametrize("parallelisms", [[2, 3], [3, 1, 2], [1, 4, 2]])
def test_file_source_rescale_reads_every_record_once(
    tmp_path: Path, parallelisms: list[int]
) -> None:
    for seed in range(3):
        root = tmp_path / f"in{seed}"
        by_file = write_inputs(str(root), "jsonl", files=6, rows=40, seed=seed)
        kept = run_source_with_crashes(
            functools.partial(FileSource, str(root)), parallelisms, random.Random(seed)
        )
        want = Counter(json.dumps(r) for recs in by_file for r in recs)
        assert Counter(json.dumps(r) for r in flat(kept)) == want


def test_file_source_single_file_and_last_line_without_newline(tmp_path: Path) -> None:
    path = tmp_path / "one.jsonl"
    path.write_bytes(b'{"a": 1}\n\n{"a": 2}\n{"a": 3}')
    src = FileSource(f"file://{path}")
    ctx = op_ctx(0, 1)
    src.open(ctx)
    out = ListCollector()
    assert src.poll(out, 2) is True
    assert out.records == [{"a": 1}, {"a": 2}]
    src.snapshot_state(1)
    snap = ctx.operator_state.snapshot()
    assert src.positions == {str(path): (len(b'{"a": 1}\n\n{"a": 2}\n'), False)}
    src2 = FileSource(f"file://{path}")
    src2.open(op_ctx(0, 1, [snap], attempt=1))
    out2 = ListCollector()
    assert src2.poll(out2, 10) is False
    assert out2.records == [{"a": 3}]
    src.close()
    src2.close()


def test_file_source_bad_line_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"a": 1}\n{oops\n')
    src = FileSource(str(path))
    src.open(op_ctx(0, 1))
    with pytest.raises(SourceFormatError) as info:
        src.poll(ListCollector(), 10)
    assert info.value.path == str(path)
    assert info.value.position == 9
    src.close()
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("a,b\n1,2\n1,2,3\n")
    src = FileSource(str(bad_csv), format="csv")
    src.open(op_ctx(0, 1))
    out = ListCollector()
    with pytest.raises(SourceFormatError, match="3 fields"):
        src.poll(out, 10)
    assert out.records == [{"a": "1", "b": "2"}]
    src.close()
    not_parquet = tmp_path / "x.parquet"
    not_parquet.write_bytes(b"not parquet at all")
    src = FileSource(str(not_parquet), format="parquet")
    src.open(op_ctx(0, 1))
    with pytest.raises(SourceFormatError, match="Parquet"):
        src.poll(out, 10)


def test_file_source_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        FileSource(str(tmp_path), format="xml")
    assert info.value.setting == "format"
    with pytest.raises(ConfigError):
        FileSource("")
    with pytest.raises(ConfigError):
        FileSource(str(tmp_path), watch=True, watch_interval=0)


def test_file_source_missing_directory_is_a_typed_error_unless_watched(tmp_path: Path) -> None:
    """A bounded source with no file would read nothing and its job "succeed" with no
    output: its first start raises SourceNotFoundError; a watching source waits for files."""
    from client.streaming.connectors import SourceNotFoundError

    with pytest.raises(SourceNotFoundError, match="nothing"):
        FileSource(str(tmp_path / "nothing")).open(op_ctx(0, 1))
    with pytest.raises(SourceNotFoundError):
        FileSource(str(tmp_path / "nothing")).check_input()
    watching = FileSource(str(tmp_path / "nothing"), watch=True)
    watching.open(op_ctx(0, 1))
    assert watching.poll(ListCollector(), 10) is True


def put_file(directory: Path, name: str, records: list[Any]) -> None:
    """Written under a hidden name, then moved in whole (as a watched source requires)."""
    tmp = directory / f".{name}.tmp"
    tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
    tmp.rename(directory / name)


def test_file_source_watch_picks_up_new_files_exactly_once(tmp_path: Path) -> None:
    d = tmp_path / "watched"
    d.mkdir()
    clock = FakeClock()
    put_file(d, "a.jsonl", [{"x": i} for i in range(10)])
    p = 2

    def make() -> FileSource:
        return FileSource(str(d), watch=True, watch_interval=1.0, clock=clock)

    subs = open_all(make, p, None, 0, "src")
    assert all(not op.bounded for op, _ in subs)
    outs = [ListCollector() for _ in range(p)]

    def drain() -> None:
        for _ in range(3):
            for k in range(p):
                assert subs[k][0].poll(outs[k], 100) is True  # unbounded: never False

    drain()
    assert sorted(r["x"] for o in outs for r in o.records) == list(range(10))
    assert all(op.ready_in() == pytest.approx(1.0) for op, _ in subs)
    put_file(d, "b.jsonl", [{"x": i} for i in range(10, 20)])
    drain()  # not listed before the interval
    assert sum(len(o.records) for o in outs) == 10
    clock.now += 1.0
    drain()
    assert sorted(r["x"] for o in outs for r in o.records) == list(range(20))
    snaps = snapshot_all(subs, 1)
    at_checkpoint = [len(o.records) for o in outs]
    # after the checkpoint: c arrives and is read, then the job dies
    put_file(d, "c.jsonl", [{"x": i} for i in range(20, 30)])
    clock.now += 1.0
    drain()
    assert sum(len(o.records) for o in outs) == 30
    kept = [o.records[:n] for o, n in zip(outs, at_checkpoint, strict=True)]
    for new_p in (2, 3):  # same parallelism, and a rescale
        subs = open_all(make, new_p, snaps, 1, "src")
        outs = [ListCollector() for _ in range(new_p)]
        p = new_p
        drain()
        put_file(d, f"d{new_p}.jsonl", [{"x": i} for i in range(30, 35)])
        clock.now += 1.0
        drain()
        got = sorted(r["x"] for r in [*flat([kept]), *flat([[o.records for o in outs]])])
        assert got == list(range(35))
        (d / f"d{new_p}.jsonl").unlink()
        for op, _ in subs:
            op.close()


# -- file sink --------------------------------------------------------------------------------


class Crash(Exception):
    pass


def visible_files(url: str) -> dict[str, bytes]:
    fs, base = fsspec.core.url_to_fs(url)
    if not fs.exists(base):
        return {}
    return {
        p.rsplit("/", 1)[-1]: fs.cat_file(p)
        for p in fs.ls(base, detail=False)
        if not p.rsplit("/", 1)[-1].startswith(".") and fs.isfile(p)
    }


def committed_indices(url: str) -> list[int]:
    return [
        json.loads(line)["i"]
        for data in visible_files(url).values()
        for line in data.splitlines()
        if line
    ]


def run_pipeline(
    make_sink: Callable[[], Operator],
    n: int,
    rng: random.Random,
    *,
    rescale: bool,
    on_attempt_end: Callable[[], None] = lambda: None,
    zombies: bool = True,
) -> list[Any]:
    """generator (p=1) -> sink (p sinks, records routed by index): attempts crash at random
    points (mid-records, after a snapshot, mid-notification); the last one runs to the
    final checkpoint. Returns the sinks of the last attempt."""
    src_snaps: list[bytes] | None = None
    sink_snaps: list[bytes] | None = None
    cid = 0
    zombie: Any = None
    for attempt in range(100):
        sp = rng.choice([1, 2, 3]) if rescale else 2
        src = GeneratorSource(lambda i: {"i": i}, count=n)
        src_ctx = op_ctx(0, 1, src_snaps, attempt, "src")
        src.open(src_ctx)
        sinks = open_all(make_sink, sp, sink_snaps, attempt, "sink")
        if zombie is not None:
            # a task of the dead attempt still running: writes and pre-commits
            with contextlib.suppress(OSError):
                for i in range(n, n + 5):
                    zombie.process({"i": i}, ListCollector())
                zombie.snapshot_state(10_000 + attempt)
            zombie = None
        crash_at = rng.randrange(1, 60) if attempt < 5 else None
        try:
            for step in range(1, 10_000):
                if step == crash_at:
                    raise Crash
                if rng.random() < 0.2:
                    cid += 1
                    src.snapshot_state(cid)
                    s_snap = [src_ctx.operator_state.snapshot()]
                    k_snaps = snapshot_all(sinks, cid)
                    outcome = rng.random()
                    if outcome < 0.15:
                        for op, _ in sinks:
                            op.notify_checkpoint_aborted(cid)
                    elif outcome < 0.25:
                        pass  # never completes; a later one subsumes it
                    else:
                        src_snaps, sink_snaps = s_snap, k_snaps
                        for op, _ in rng.sample(sinks, len(sinks)):
                            if crash_at is not None and rng.random() < 0.15:
                                raise Crash  # mid-notification
                            op.notify_checkpoint_complete(cid)
                    continue
                out = ListCollector()
                more = src.poll(out, rng.randrange(1, 30))
                for rec in out.records:
                    sinks[rec["i"] % sp][0].process(rec, ListCollector())
                if not more:
                    for op, _ in sinks:
                        op.end_input(ListCollector())
                    cid += 1
                    snapshot_all(sinks, cid)
                    for op, _ in sinks:
                        op.notify_checkpoint_complete(cid)
                    for op, _ in sinks:
                        op.close()
                    on_attempt_end()
                    return [op for op, _ in sinks]
            raise AssertionError("the job never ended")
        except Crash:
            for op, _ in sinks:
                if rng.random() < 0.5:
                    op.close()
            if zombies and rng.random() < 0.5:
                zombie = rng.choice(sinks)[0]
            on_attempt_end()
    raise AssertionError("unreachable")


@pytest.mark.parametrize("seed", range(8))
def test_file_sink_exactly_once_across_crashes(tmp_path: Path, seed: int) -> None:
    url = str(tmp_path / "out")
    history: dict[str, bytes] = {}

    def never_rewritten() -> None:
        files = visible_files(url)
        for name, data in history.items():
            assert files.get(name) == data, f"committed file {name} changed or vanished"
        history.update(files)

    n = 400
    run_pipeline(
        lambda: FileSink(url),
        n,
        random.Random(seed),
        rescale=seed % 2 == 1,
        on_attempt_end=never_rewritten,
    )
    got = committed_indices(url)
    assert len(got) == n
    assert sorted(got) == list(range(n))  # nothing lost, nothing twice, no zombie record
    assert all(name.startswith("part-") for name in visible_files(url))


def test_file_sink_exactly_once_on_memory_fs(memory_root: str) -> None:
    url = f"{memory_root}/out"
    run_pipeline(lambda: FileSink(url), 300, random.Random(3), rescale=True)
    got = committed_indices(url)
    assert sorted(got) == list(range(300))


def restored_sink(
    url: str,
    snaps: list[bytes] | None,
    attempt: int,
    k: int = 0,
    p: int = 1,
    restored: int | None = None,
) -> Any:
    sink = FileSink(url)
    sink.open(op_ctx(k, p, snaps, attempt, "sink", restored))
    return sink


def test_file_sink_two_phases_and_idempotent_commit(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    out = ListCollector()
    sink = FileSink(url)
    ctx = op_ctx(0, 1, None, 0, "sink")
    sink.open(ctx)
    for i in range(3):
        sink.process({"i": i}, out)
    assert visible_files(url) == {}
    assert [p.name for p in (tmp_path / "out" / ".inprogress").iterdir()] == ["part-0-0-0.jsonl"]
    sink.snapshot_state(1)
    snap1 = [ctx.operator_state.snapshot()]
    assert [p.name for p in (tmp_path / "out" / ".pending").iterdir()] == ["part-0-0-0.jsonl-chk-1"]
    assert visible_files(url) == {}  # pre-committed only
    sink.process({"i": 3}, out)
    sink.snapshot_state(2)
    sink.notify_checkpoint_aborted(2)
    assert visible_files(url) == {}
    # crash before any notification; checkpoint 1 completed
    sink2 = restored_sink(url, snap1, 1)
    assert committed_indices(url) == [0, 1, 2]
    committed = visible_files(url)
    # the file of the uncompleted checkpoint 2 is gone, nothing in flight remains
    assert list((tmp_path / "out" / ".pending").iterdir()) == []
    sink2.process({"i": 3}, out)  # an in-progress file of attempt 1, then a crash again
    assert [p.name for p in (tmp_path / "out" / ".inprogress").iterdir()] == ["part-0-1-0.jsonl"]
    sink2.close()
    # restoring the same checkpoint again: committing twice must not duplicate
    sink3 = restored_sink(url, snap1, 2)
    assert visible_files(url) == committed
    assert list((tmp_path / "out" / ".inprogress").iterdir()) == []
    # a commit interrupted after the copy (object stores): pending and final both there
    sink3.process({"i": 3}, out)
    sink3.snapshot_state(3)
    snap3 = [sink3.ctx.operator_state.snapshot()]
    final = tmp_path / "out" / "part-0-2-0.jsonl"
    final.write_bytes((tmp_path / "out" / ".pending" / "part-0-2-0.jsonl-chk-3").read_bytes())
    restored_sink(url, snap3, 3)
    assert sorted(committed_indices(url)) == [0, 1, 2, 3]
    assert list((tmp_path / "out" / ".pending").iterdir()) == []


def test_file_sink_zombie_files_never_become_visible(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    old = FileSink(url)
    ctx = op_ctx(0, 1, None, 0, "sink")
    old.open(ctx)
    old.process({"i": 0}, ListCollector())
    old.snapshot_state(1)
    snap = [ctx.operator_state.snapshot()]
    old.notify_checkpoint_complete(1)
    old.process({"i": 1}, ListCollector())  # after checkpoint 1: must be dropped
    new = restored_sink(url, snap, 1)
    # the zombie keeps going: a new in-progress file and a pre-commit of its own
    with pytest.raises(FileNotFoundError):  # its in-progress file was deleted by the new attempt
        old.snapshot_state(2)
    old.process({"i": 2}, ListCollector())
    old.snapshot_state(3)
    old.close()
    assert committed_indices(url) == [0]
    new.process({"i": 1}, ListCollector())
    new.snapshot_state(2)
    new.notify_checkpoint_complete(2)
    assert sorted(committed_indices(url)) == [0, 1]
    assert (tmp_path / "out" / ".pending" / "part-0-0-2.jsonl-chk-3").exists()
    # the next restore cleans the zombie's leftovers
    restored_sink(url, [new.ctx.operator_state.snapshot()], 2)
    assert list((tmp_path / "out" / ".pending").iterdir()) == []
    assert sorted(committed_indices(url)) == [0, 1]


def test_file_sink_never_deletes_pending_files_of_a_completed_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Restored from checkpoint 2 with no state naming them (state lost or dropped): the
    pending files of checkpoints <= 2 may belong to a completed checkpoint and stay (with a
    warning); the in-progress file and the pending file of checkpoint 3 (never completed)
    go."""
    url = str(tmp_path / "out")
    sink = FileSink(url)
    sink.open(op_ctx(0, 1, None, 0, "sink"))
    for cid in (1, 2, 3):
        sink.process({"i": cid}, ListCollector())
        sink.snapshot_state(cid)
    sink.process({"i": 4}, ListCollector())
    pending = tmp_path / "out" / ".pending"
    assert sorted(p.name for p in pending.iterdir()) == [
        "part-0-0-0.jsonl-chk-1",
        "part-0-0-1.jsonl-chk-2",
        "part-0-0-2.jsonl-chk-3",
    ]
    with caplog.at_level(logging.WARNING, "exchange.streaming.connectors"):
        restored_sink(url, None, 1, restored=2)
    assert sorted(p.name for p in pending.iterdir()) == [
        "part-0-0-0.jsonl-chk-1",
        "part-0-0-1.jsonl-chk-2",
    ]
    assert list((tmp_path / "out" / ".inprogress").iterdir()) == []
    assert "not in the restored state; left in place" in caplog.text
    assert visible_files(url) == {}


def test_file_sink_lost_pending_file_is_a_commit_error(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    sink = FileSink(url)
    ctx = op_ctx(0, 1, None, 0, "sink")
    sink.open(ctx)
    sink.process({"i": 0}, ListCollector())
    sink.snapshot_state(1)
    snap = [ctx.operator_state.snapshot()]
    (tmp_path / "out" / ".pending" / "part-0-0-0.jsonl-chk-1").unlink()
    with pytest.raises(SinkCommitError, match="chk-1"):
        restored_sink(url, snap, 1)


def test_file_sink_names_stay_unique_when_an_attempt_number_repeats(tmp_path: Path) -> None:
    url = str(tmp_path / "out")
    for _ in range(2):  # two drivers, both starting at attempt 0, no checkpoint restored
        sink = FileSink(url)
        ctx = op_ctx(0, 1, None, 0, "sink")
        sink.open(ctx)
        sink.process({"i": 0}, ListCollector())
        sink.snapshot_state(1)
        sink.notify_checkpoint_complete(1)
        sink.close()
    assert sorted(visible_files(url)) == ["part-0-0-0.jsonl", "part-0-0-1.jsonl"]


def test_file_sink_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        FileSink(str(tmp_path), format="parquet")
    sink = FileSink(str(tmp_path / "out"))
    sink.open(op_ctx(0, 1))
    with pytest.raises(UsageError, match="not JSON"):
        sink.process({1, 2}, ListCollector())
    sink.close()


# -- collect sink -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_collect_sink_exactly_once_across_crashes(seed: int) -> None:
    n = 300
    sinks = run_pipeline(CollectSink, n, random.Random(seed), rescale=seed % 2 == 1, zombies=False)
    got = [r["i"] for s in sinks for r in s.results()]
    assert len(got) == n
    assert sorted(got) == list(range(n))


def test_collect_sink_holds_back_until_complete() -> None:
    sink = CollectSink()
    ctx = op_ctx(0, 1)
    sink.open(ctx)
    for i in range(3):
        sink.process(i, ListCollector())
    assert sink.results() == []
    sink.snapshot_state(1)
    sink.process(3, ListCollector())
    sink.snapshot_state(2)
    assert sink.results() == []
    sink.notify_checkpoint_complete(1)
    assert sink.results() == [0, 1, 2]
    sink.notify_checkpoint_complete(2)
    assert sink.results() == [0, 1, 2, 3]
