"""Restoring a streaming job on local PySpark: state belongs to operators (uids), not to
tasks, whatever the chaining; state no operator claims is refused unless dropped; one live
driver per checkpoint directory; a torn newest checkpoint falls back to an older one; a
forged checkpoint file is refused when a secret keys them (issue 18 items 2, 4, 5; issue
19's checkpoint envelopes).

The pipeline is ``_streaming.py``'s with a map between the source and the key_by, so that
the parallelism of the map decides the chaining::

    gen (1) -> ident (m) -> key_by -> sums (s) -> sink (k)

m = s = k = 1: two tasks, [gen ident bykey] and [sums sink]; m = s = k = 2: three
vertices, [gen], [ident bykey] x2, [sums sink] x2: every vertex id after the source moves.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kit.modules import load_module

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

st: Any = load_module(
    "exchange_tests_streaming_pipeline", Path(__file__).with_name("_streaming.py")
)


@pytest.fixture(scope="module")
def spark(sx: ModuleType) -> Iterator[Any]:
    """local[5]: the rescaled job runs 5 tasks at once."""
    pytest.importorskip("pyspark")
    with st.session(sx, "local[5]", "exchange-streaming-restore") as session:
        yield session


_dirs = st.dirs


def _env(spark: Any, ckpt: str, **kw: Any) -> Any:
    return st.environment(spark, ckpt, "restore", **kw)


def _identity(value: Any) -> Any:
    return value


def _pipeline(
    env: Any,
    probes: Path,
    out: Path,
    n: int | None,
    *,
    p: int = 1,
    rate: float | None = None,
    sums_name: str = "sums",
    sums_uid: str | None = None,
    **sink: Any,
) -> None:
    pr, o = str(probes), str(out)
    sums = (
        env.add_source(lambda: st.ProbedGenerator(pr, n, rate), parallelism=1, name="gen")
        .map(_identity, name="ident", parallelism=p)
        .key_by(st.key_of, name="bykey")
        .process(st.RunningSum(), parallelism=p, name=sums_name)
    )
    if sums_uid is not None:
        sums.uid(sums_uid)
    sums.sink_to(lambda: st.ProbedSink(pr, o, **sink), name="sink", parallelism=p)


def _fail_with_pending_output(
    spark: Any, probes: Path, out: Path, ckpt: str, n: int, p: int = 1
) -> int:
    """Run the job at parallelism ``p`` until a sink's commit of checkpoint >= 3 fails:
    that checkpoint completed, its output is pending, the source is past it."""
    from client.streaming.checkpoint_storage import CheckpointStorage
    from client.streaming.environment import JobFailedError

    first = _env(spark, ckpt, retained_checkpoints=3)
    _pipeline(first, probes, out, n, p=p, rate=10_000.0, fail_commit=3)
    with pytest.raises(JobFailedError, match="SinkCommitError"):
        first.execute(restart_attempts=0)
    latest = CheckpointStorage(ckpt).latest_completed()
    assert latest is not None and latest.checkpoint_id >= 3
    assert sorted(latest.operators) == ["bykey", "gen", "ident", "sink", "sums"]
    assert any((out / ".pending").iterdir()), "the failed commit left pending files"
    assert 0 < len(st.committed(out)) < n
    return int(latest.checkpoint_id)


@pytest.mark.parametrize(
    ("before", "after", "tasks"),
    [(1, 2, ["v0-0", "v1-0", "v1-1", "v2-0", "v2-1"]), (2, 1, ["v0-0", "v1-0"])],
    ids=["breaks-chains", "forms-chains"],
)
def test_a_rescale_that_changes_chains_restores_every_operators_state(
    spark: Any, tmp_path: Path, before: int, after: int, tasks: list[str]
) -> None:
    """The first job fails right after checkpoint N completed, before its sink committed
    N's files. The second runs with another parallelism, which moves sums and the sink to
    another vertex (and splits or joins the source's chain): the generator resumes after
    N, the running sums (keyed state, redistributed by key group) go on from N, and the
    sink commits N's pending files: every event exactly once, every total chained."""
    probes, out, ckpt = _dirs(tmp_path)
    n = 30_000
    restored = _fail_with_pending_output(spark, probes, out, ckpt, n, p=before)

    second = _env(spark, ckpt)
    _pipeline(second, probes, out, n, p=after)
    result = second.execute(restart_attempts=0)
    assert result.restarts == 0 and result.checkpoints[0].checkpoint_id > restored
    assert sorted(result.records) == tasks
    assert list((out / ".pending").iterdir()) == []
    st.check_exactly_once(out, n)


def test_state_of_an_operator_the_job_lacks_is_refused_unless_dropped(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``sums`` renamed ``totals``: its state maps to no operator, NonRestoredStateError
    names it before anything runs. ``uid("sums")`` on the renamed operator restores it
    (exactly once, totals chained); ``allow_non_restored_state=True`` (on a copy of the
    same checkpoint) drops it with a warning: every event still once, the totals of the
    keys start again from 0."""
    from exchange.state import NonRestoredStateError

    probes, out, ckpt = _dirs(tmp_path)
    n = 30_000
    _fail_with_pending_output(spark, probes, out, ckpt, n)
    ckpt2, out2 = str(tmp_path / "ckpt2"), tmp_path / "out2"
    shutil.copytree(ckpt, ckpt2)
    shutil.copytree(out, out2)

    renamed = _env(spark, ckpt)
    _pipeline(renamed, probes, out, n, sums_name="totals")
    with pytest.raises(NonRestoredStateError, match=r"operator\(s\) sums that the job") as err:
        renamed.execute(restart_attempts=0)
    assert err.value.operators == ["sums"]
    assert len(st.pids(probes)) == 1  # nothing ran but the first job

    kept = _env(spark, ckpt)
    _pipeline(kept, probes, out, n, sums_name="totals", sums_uid="sums")
    kept.execute(restart_attempts=0)
    st.check_exactly_once(out, n)

    dropped = _env(spark, ckpt2)
    _pipeline(dropped, probes, out2, n, sums_name="totals")
    with caplog.at_level(logging.WARNING, "exchange.streaming.driver"):
        dropped.execute(restart_attempts=0, allow_non_restored_state=True)
    assert "dropping the state of operator(s) sums of checkpoint" in caplog.text
    rows = st.committed(out2)
    assert sorted(r[1] for r in rows) == [st.event(i) for i in range(n)]
    with pytest.raises(AssertionError, match="total"):
        st.check_running_sums(rows)  # the dropped sums restarted from 0


def test_a_second_live_driver_of_the_job_fails_loudly(spark: Any, tmp_path: Path) -> None:
    """While a driver runs the job, another driver on the same checkpoint directory is
    refused with CheckpointLeaseError naming the first; once the first ended, it runs."""
    from client.streaming.checkpoint_storage import CheckpointLeaseError, CheckpointStorage

    probes, out, ckpt = _dirs(tmp_path)
    first = _env(spark, ckpt)
    _pipeline(first, probes, out, None, rate=5_000.0)
    outcome: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: outcome.update(result=first.execute(restart_attempts=0)), daemon=True
    )
    thread.start()
    st.wait_for(lambda: os.path.exists(f"{ckpt}/_lease"), 60, "the first driver's lease")
    st.wait_for(
        lambda: CheckpointStorage(ckpt).completed_ids(), 120, "the first job's first checkpoint"
    )

    second = _env(spark, ckpt)
    _pipeline(second, probes, out, None, rate=5_000.0)
    with pytest.raises(CheckpointLeaseError, match="another driver of this job is running") as e:
        second.execute(restart_attempts=0)
    app = spark.sparkContext.applicationId
    assert f"Spark application {app}" in e.value.holder and f"pid {os.getpid()}" in e.value.holder
    assert thread.is_alive()  # the first one goes on

    first.cancel()  # a clean stop: final checkpoint, lease released
    thread.join(120)
    assert not thread.is_alive() and outcome["result"].stopped
    assert not os.path.exists(f"{ckpt}/_lease")
    st.check_running_sums(st.committed(out))


def test_a_torn_newest_checkpoint_falls_back_to_an_older_one(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The newest checkpoint's metadata is cut short (a machine crash mid-write without
    fsync): the new driver warns and restores the checkpoint before it; the newest one's
    pending output is deleted and replayed, so the output is still exactly once."""
    from client.streaming.checkpoint_storage import CheckpointStorage

    probes, out, ckpt = _dirs(tmp_path)
    n = 30_000
    torn = _fail_with_pending_output(spark, probes, out, ckpt, n)
    older = CheckpointStorage(ckpt).completed_ids()[-2]
    meta = Path(ckpt) / f"chk-{torn}" / "_metadata"
    meta.write_bytes(meta.read_bytes()[:-10])

    second = _env(spark, ckpt)
    _pipeline(second, probes, out, n)
    with caplog.at_level(logging.WARNING, "exchange.streaming.checkpoints"):
        result = second.execute(restart_attempts=0)
    assert f"checkpoint {torn} is not whole" in caplog.text
    assert f"restoring from checkpoint {older} instead" in caplog.text
    assert result.checkpoints[0].checkpoint_id > torn  # ids never reused
    st.check_exactly_once(out, n)


class _Pwn:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


def _forgery(marker: Path, size: int) -> bytes:
    """An unkeyed TASK_STATE envelope of ``size`` bytes whose pickle would create
    ``marker``: the same size as the file it replaces, so only the MAC can catch it."""
    from exchange.state import SnapshotKind, encode_snapshot

    for pad in range(size):
        data = encode_snapshot(
            SnapshotKind.TASK_STATE, {"operators": _Pwn(str(marker)), "": "x" * pad}
        )
        if len(data) == size:
            return data
    raise AssertionError(f"no forgery of {size} bytes")


def test_with_a_secret_a_forged_checkpoint_file_is_refused(spark: Any, tmp_path: Path) -> None:
    """With a secret, every checkpoint file carries an HMAC: a state file replaced by a
    pickle of the attacker's (who can write the directory, not read the secret; same size,
    so the metadata's sizes do not catch it) fails the task before it is unpickled, and a
    forged metadata file fails ``execute`` at once, never skipped for an older one."""
    from client.spark import get_embedded_daemon, stop_embedded_daemon

    probes, out, ckpt = _dirs(tmp_path)
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32).hex().encode())
    secret.chmod(0o600)
    # The secret is the daemons' (tasks authenticate with the application's credential
    # minted from it) and keys the checkpoint files: the embedded daemon holds it too.
    stop_embedded_daemon()
    get_embedded_daemon(["--secret-file", str(secret)])
    try:
        _secret_runs(spark, tmp_path, probes, out, ckpt, secret)
    finally:
        stop_embedded_daemon()


def _secret_runs(
    spark: Any, tmp_path: Path, probes: Path, out: Path, ckpt: str, secret: Path
) -> None:
    from client.streaming.checkpoint_storage import CheckpointStorage
    from client.streaming.environment import JobFailedError
    from exchange.state import SnapshotAuthenticationError

    n = 5_000
    first = _env(spark, ckpt, secret_file=str(secret), retained_checkpoints=2)
    _pipeline(first, probes, out, n)
    first.execute(restart_attempts=0)
    st.check_exactly_once(out, n)
    storage = CheckpointStorage(ckpt)
    latest = storage.completed_ids()[-1]
    meta_path = Path(storage.metadata_path(latest))
    assert meta_path.read_bytes()[4:6] == b"\x00\x02"  # the keyed envelope's version

    marker = tmp_path / "pwned"
    victim = next(Path(storage.checkpoint_dir(latest)).glob("v1-0-*.state"))
    forged = _forgery(marker, victim.stat().st_size)
    victim.unlink()
    victim.write_bytes(forged)
    second = _env(spark, ckpt, secret_file=str(secret))
    _pipeline(second, probes, out, n)
    with pytest.raises(JobFailedError, match="unauthenticated checkpoint file"):
        second.execute(restart_attempts=0)
    assert not marker.exists()

    original = meta_path.read_bytes()
    meta_path.unlink()
    meta_path.write_bytes(original[:4] + b"\x00\x01" + original[6:])  # "unkeyed"
    third = _env(spark, ckpt, secret_file=str(secret))
    _pipeline(third, probes, out, n)
    with pytest.raises(SnapshotAuthenticationError, match=f"chk-{latest}/_metadata"):
        third.execute(restart_attempts=0)
    assert not marker.exists()
