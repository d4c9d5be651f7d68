"""The main job: a streaming clickstream pipeline, exactly once through a SIGKILL, checked.

Writes generated click events (Zipf-distributed users) as JSON-lines files into a work
directory, then runs a streaming job on local Spark and the embedded exchange daemon::

    files -> parse -> key_by(user) -> running totals (keyed state) -> two-phase-commit files

with exactly-once checkpoints every second. Midway it SIGKILLs the Python worker of one
``totals`` task (``--no-kill``: not) and the job restarts from its last completed
checkpoint. The first attempt's sources hold their input at the kill point (``--kill-at``
of each source subtask's events) until that kill, so it lands mid-stream however fast or
loaded the machine is; the restarted attempt reads on. At the end it checks the committed
output against Spark's DataFrame ``groupBy`` over the same input files: per user exactly
one output line per event, with running counts 1..n and final sums equal to Spark's
(nothing lost, nothing twice). It prints progress, checkpoints, the restart, back
pressure per task and the verdict; exit status 0 only if the check passed. ``--linger``
keeps the dashboard up until Ctrl-C.

    python -m client.main_job [--events 500000] [--parallelism 2] [--no-kill] [--linger]
    python -m client.main_job --job shuffle [...]   # the batch exchange job
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Sequence
from functools import partial
from typing import Any

from client.shuffle_job import EVENT_TYPES, generate_events
from client.streaming.connectors import FileSource
from exchange.best_effort import best_effort

__all__ = [
    "HeldFileSource",
    "RunningTotals",
    "check_output",
    "main",
    "output_equals",
    "parse_click",
]

log = logging.getLogger("exchange.client.main_job")


def _log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


class _Since(logging.Formatter):
    """The driver's log lines in the job's own format: seconds since the start."""

    def __init__(self, t0: float) -> None:
        super().__init__()
        self.wall0 = time.time() - (time.monotonic() - t0)

    def format(self, record: logging.LogRecord) -> str:
        return f"[{record.created - self.wall0:6.1f}s] {record.getMessage()}"


def _speak(t0: float) -> logging.Handler:
    """Show the streaming runtime's log (attempts, restores, checkpoints, restarts) on
    stdout, interleaved with the job's own lines."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Since(t0))
    logger = logging.getLogger("exchange.streaming")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return handler


# -- the pipeline's functions (pickled into the Spark tasks) -----------------------------


def parse_click(record: Any) -> tuple[int, int, int]:
    """A click event (a JSON object) -> (user, duration, bytes); anything else raises."""
    if not isinstance(record, dict):
        raise ValueError(f"a click event is a JSON object, got {type(record).__name__}")
    user, duration, nbytes = record["user"], record["duration"], record["bytes"]
    if record.get("type") not in EVENT_TYPES:
        raise ValueError(f"unknown event type {record.get('type')!r}")
    for v in (user, duration, nbytes):
        if type(v) is not int or v < 0:
            raise ValueError(f"bad click event {record!r:.200}")
    return user, duration, nbytes


class RunningTotals:
    """Per user: events, total duration and total bytes so far, in keyed state; emits the
    running totals for every event. ``open`` leaves the worker's pid in ``pid_dir`` (the
    job's chaos hook: the driver kills that process)."""

    def __init__(self, pid_dir: str | None = None) -> None:
        self.pid_dir = pid_dir

    def open(self, rc: Any) -> None:
        self.totals = rc.value_state("totals", None)
        if self.pid_dir is not None:
            ctx = rc.operator_context
            name = f"{ctx.attempt}-totals-{ctx.subtask_index}"
            tmp = os.path.join(self.pid_dir, "." + name)
            with open(tmp, "w") as f:
                f.write(str(os.getpid()))
            os.replace(tmp, os.path.join(self.pid_dir, name))

    def process_element(self, value: tuple[int, int, int], ctx: Any, out: Any) -> None:
        user, duration, nbytes = value
        t = self.totals.value()
        t = (1, duration, nbytes) if t is None else (t[0] + 1, t[1] + duration, t[2] + nbytes)
        self.totals.update(t)
        out.collect({"user": user, "n": t[0], "duration": t[1], "bytes": t[2]})


# -- input -------------------------------------------------------------------------------


class _Counting:
    """A collector that counts what passes through it."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.n = 0

    def collect(self, record: Any) -> None:
        self.out.collect(record)
        self.n += 1


class HeldFileSource(FileSource):
    """The main job's input: a FileSource whose subtask k, in the job's first attempt (the
    one that restored no checkpoint), holds (idles like a source with nothing to read,
    still taking checkpoints) once it has emitted ``holds[k]`` records, until the driver's
    kill restarts the job. So the demo's SIGKILL always lands mid-stream; without a kill
    (``holds`` None) it is a plain FileSource."""

    def __init__(self, path: str, holds: Sequence[int] | None) -> None:
        super().__init__(path)
        self.holds = holds
        self._emitted = 0

    def _room(self) -> int | None:
        if self.holds is None or self.ctx.restored_checkpoint_id is not None:
            return None  # no kill asked for, or a restarted attempt: read on
        return max(0, self.holds[self.ctx.subtask_index] - self._emitted)

    def poll(self, out: Any, max_records: int) -> bool:
        room = self._room()
        if room is None:
            return super().poll(out, max_records)
        if room == 0:
            return True  # held: nothing now, more later
        counting = _Counting(out)
        more = super().poll(counting, min(max_records, room))
        self._emitted += counting.n
        return more

    def ready_in(self) -> float:
        if self._room() == 0:
            return 0.1
        return super().ready_in()


def event_counts(events: int, files: int) -> list[int]:
    """Events per input file, as ``write_events`` writes them."""
    per_file = [events // files] * files
    per_file[-1] += events - sum(per_file)
    return per_file


def hold_points(events: int, files: int, parallelism: int, kill_at: float) -> list[int]:
    """Per source subtask, the records it emits before the first attempt holds: the
    ``kill_at`` share of the files it owns (FileSource gives file i to subtask i % p)."""
    per_file = event_counts(events, files)
    owned = [sum(per_file[k::parallelism]) for k in range(parallelism)]
    return [int(n * kill_at) for n in owned]


def write_events(
    directory: str, events: int, files: int, users: int, skew: float, seed: int
) -> int:
    """``events`` click events as JSON lines in ``files`` files; returns the bytes written."""
    os.makedirs(directory, exist_ok=True)
    total = 0
    for i, n in enumerate(event_counts(events, files)):
        lines = [
            f'{{"user":{u},"ts":{ts},"type":"{kind}","page":{page},"duration":{d},"bytes":{b}}}\n'
            for u, ts, kind, page, d, b in generate_events(i, n, users, skew, seed)
        ]
        data = "".join(lines).encode()
        tmp = os.path.join(directory, f".clicks-{i:03d}.jsonl")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(directory, f"clicks-{i:03d}.jsonl"))  # whole files only
        total += len(data)
    return total


# -- watching the job ----------------------------------------------------------------------


class Watcher(threading.Thread):
    """Prints the job's progress every ``every`` seconds (from the driver's JobStatus and
    the daemon's /api/stats, the dashboard's own data), remembers the peak back pressure
    of each task, and kills one task's worker once when ``kill_after`` events were read."""

    def __init__(
        self,
        env: Any,
        t0: float,
        events: int,
        stats_url: str | None,
        pid_dir: str,
        kill_after: int | None,
        every: float = 2.0,
    ) -> None:
        super().__init__(daemon=True, name="job-watcher")
        self.env = env
        self.t0 = t0
        self.events = events
        self.stats_url = stats_url
        self.pid_dir = pid_dir
        self.kill_after = kill_after
        self.every = every
        self.stop_event = threading.Event()
        #: task -> (peak back-pressure ratio, its level)
        self.peak: dict[str, tuple[float, str]] = {}
        self.killed: dict[str, Any] | None = None
        self.restored_from: int | None = None
        self._next_print = 0.0

    def run(self) -> None:
        while not self.stop_event.wait(0.2):
            with best_effort(log, "watching the job"):  # watching never fails the job
                self.tick()

    def daemon_view(self) -> dict[str, Any] | None:
        if self.stats_url is None:
            return None
        with urllib.request.urlopen(self.stats_url, timeout=2) as resp:
            stats = json.load(resp)
        for job in stats.get("jobs", []):
            if job["job"] == self.env.job_id:
                return dict(job)
        return None

    def tick(self) -> None:
        tracker = self.env.status
        if tracker is None:
            return
        status = tracker.snapshot()
        sources = [t for t in status.tasks if not t.channels]
        read = sum(t.records_in for t in sources)
        if (
            self.killed is None
            and self.kill_after is not None
            and status.state == "RUNNING"
            and status.checkpoints_completed >= 2
            and read >= self.kill_after
        ):
            self.kill(status)
        if (
            self.killed is not None
            and self.restored_from is None
            and status.attempt != self.killed["attempt"]
        ):
            done = [c.checkpoint_id for c in status.checkpoints if c.status == "COMPLETED"]
            self.restored_from = max(done) if done else 0
        now = time.monotonic()
        if now < self._next_print:
            return
        self._next_print = now + self.every
        view = self.daemon_view()
        bp = []
        for t in view["tasks"] if view else []:
            level, ratio = t["back_pressure"], t["back_pressure_ratio"]
            if level is None:
                continue
            if ratio >= self.peak.get(t["task"], (-1.0, ""))[0]:
                self.peak[t["task"]] = (ratio, level)
            bp.append(f"{t['task']} {level} {100 * ratio:.0f}%")
        last = next((c for c in reversed(status.checkpoints) if c.status == "COMPLETED"), None)
        ck = f"checkpoints {status.checkpoints_completed}"
        if last is not None and last.duration is not None:
            ck += f" (#{last.checkpoint_id} took {1000 * last.duration:.0f} ms)"
        attempt = f"attempt {status.restarts + 1}"
        if status.state == "RUNNING" and read == 0:  # counts come with the first ack
            progress = f"{attempt} starting (tasks scheduled, registering, restoring)"
        else:
            progress = f"{attempt} read {read:,} of {self.events:,} events"
        pressure = f"; back pressure {', '.join(bp)}" if bp else ""
        _log(self.t0, f"{status.state.lower()}: {progress}, {ck}{pressure}")

    def kill(self, status: Any) -> None:
        victim = "totals-0"
        path = os.path.join(self.pid_dir, f"{status.attempt}-{victim}")
        if not os.path.exists(path):
            return
        with open(path) as f:
            pid = int(f.read())
        read = sum(t.records_in for t in status.tasks if not t.channels)
        os.kill(pid, signal.SIGKILL)
        self.killed = {
            "task": victim,
            "pid": pid,
            "at": time.monotonic() - self.t0,
            "read": read,
            "attempt": status.attempt,
            "checkpoints": status.checkpoints_completed,
        }
        _log(
            self.t0,
            f"SIGKILL to the Python worker of task {victim} (pid {pid}) after {read:,} events "
            f"and {status.checkpoints_completed} checkpoints",
        )


# -- the check -----------------------------------------------------------------------------


def check_output(spark: Any, in_glob: str, out_dir: str) -> dict[str, int]:
    """Compare the committed running totals with Spark's DataFrame groupBy of the input.

    Per user the committed files must hold exactly one line per input event: ``n`` lines
    whose running counts are the distinct values 1..n and whose final sums are Spark's
    sums. Returns the users, the users that differ, events, lines, duplicate lines and
    missing events.
    """
    from pyspark.sql import functions as F

    clicks = spark.read.schema("user long, duration long, bytes long").json(in_glob)
    expected = {
        r["user"]: (r["n"], r["d"], r["b"])
        for r in clicks.groupBy("user")
        .agg(F.count("*").alias("n"), F.sum("duration").alias("d"), F.sum("bytes").alias("b"))
        .collect()
    }
    seen: dict[int, set[int]] = {}
    final: dict[int, tuple[int, int, int]] = {}
    lines = duplicates = 0
    for name in sorted(os.listdir(out_dir)):
        if name.startswith((".", "_")):
            continue  # in-progress and pending files: never committed
        with open(os.path.join(out_dir, name), "rb") as f:
            for line in f:
                r = json.loads(line)
                user, n = r["user"], r["n"]
                lines += 1
                counts = seen.setdefault(user, set())
                if n in counts:
                    duplicates += 1
                counts.add(n)
                if n > final.get(user, (0, 0, 0))[0]:
                    final[user] = (n, r["duration"], r["bytes"])
    bad = missing = 0
    for user in expected.keys() | final.keys():
        want = expected.get(user, (0, 0, 0))
        counts = seen.get(user, set())
        missing += max(0, want[0] - len(counts))
        if final.get(user) != want or counts != set(range(1, want[0] + 1)):
            bad += 1
    return {
        "users": len(expected),
        "bad_users": bad,
        "events": sum(v[0] for v in expected.values()),
        "lines": lines,
        "duplicates": duplicates,
        "missing": missing,
    }


def output_equals(verdict: dict[str, int], events: int) -> bool:
    """``check_output``'s verdict says the output equals the input's groupBy: every one of
    the ``events`` events once (one line each, none missing, none twice), no user
    differing."""
    return (
        verdict["bad_users"] == 0
        and verdict["duplicates"] == 0
        and verdict["missing"] == 0
        and verdict["events"] == events
        and verdict["lines"] == events
    )


# -- the command ---------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m client.main_job", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=int, default=500_000, help="click events to write")
    p.add_argument("--users", type=int, default=50_000, help="distinct users")
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent of user activity")
    p.add_argument("--files", type=int, default=8, help="input files")
    p.add_argument("--parallelism", type=int, default=2, help="subtasks per operator")
    p.add_argument("--master", default=None, help="Spark master (default local[2 x parallelism])")
    p.add_argument("--checkpoint-interval", type=float, default=1.0, help="seconds")
    p.add_argument(
        "--checkpointing",
        choices=("exactly_once", "unaligned"),
        default="exactly_once",
        help="exactly_once: aligned barriers; unaligned: barriers do not wait for the "
        "input ahead of them, which is persisted with the checkpoint (both exactly once)",
    )
    p.add_argument(
        "--aligned-checkpoint-timeout",
        type=float,
        default=None,
        help="with --checkpointing unaligned: seconds a checkpoint stays aligned first",
    )
    p.add_argument("--kill-at", type=float, default=0.4, help="kill after this share of events")
    p.add_argument("--no-kill", action="store_true", help="do not kill a task midway")
    p.add_argument("--linger", action="store_true", help="keep the dashboard up until Ctrl-C")
    p.add_argument("--workdir", default=None, help="input, output, checkpoints (default: temp)")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    for name in ("events", "users", "files", "parallelism"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.skew <= 0 or args.checkpoint_interval <= 0 or not 0 < args.kill_at < 1:
        p.error("--skew and --checkpoint-interval must be positive, --kill-at in (0, 1)")
    t = args.aligned_checkpoint_timeout
    if t is not None and (args.checkpointing != "unaligned" or not 0 <= t < float("inf")):
        p.error("--aligned-checkpoint-timeout takes seconds >= 0 with --checkpointing unaligned")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    chooser = argparse.ArgumentParser(add_help=False)
    chooser.add_argument("--job", choices=("clickstream", "shuffle"), default="clickstream")
    which, rest = chooser.parse_known_args(argv)
    if which.job == "shuffle":
        from client import shuffle_job

        return shuffle_job.main(rest)
    return run_clickstream(parse_args(rest))


def _mode_name(mode: str) -> str:
    return "exactly-once unaligned" if mode == "unaligned" else "exactly-once"


def run_clickstream(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    t0 = time.monotonic()
    speaking = _speak(t0)
    par = args.parallelism
    master = args.master or f"local[{2 * par}]"
    own_workdir = args.workdir is None
    work = args.workdir or tempfile.mkdtemp(prefix="clickstream-")
    in_dir, out_dir = os.path.join(work, "in"), os.path.join(work, "out")
    pid_dir = os.path.join(work, "pids")
    os.makedirs(pid_dir, exist_ok=True)
    in_glob = os.path.join(in_dir, "clicks-*.jsonl")

    _log(
        t0, f"writing {args.events:,} click events of {args.users:,} users into {args.files} files"
    )
    nbytes = write_events(in_dir, args.events, args.files, args.users, args.skew, args.seed)
    _log(t0, f"wrote {nbytes / 2**20:.1f} MiB to {in_dir}")

    _log(t0, f"starting Spark ({master}) and the embedded exchange daemon (debloating on)")
    from pyspark.sql import SparkSession

    from client.spark import get_embedded_daemon, stop_embedded_daemon
    from client.streaming.environment import JobFailedError, StreamEnvironment

    daemon = get_embedded_daemon(["--debloat"]) if master.startswith("local") else None
    spark = (
        SparkSession.builder.master(master)
        .appName("exchange-main-job")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(2 * par))
        .config("spark.driver.memory", "1g")
        .getOrCreate()
    )
    # A killed worker makes Spark log its task's failure at ERROR with a JVM stack trace;
    # the job reports failures and restarts itself (the "restarts" line has the cause).
    spark.sparkContext.setLogLevel("FATAL")
    if daemon is not None:
        _log(t0, f"dashboard {daemon.dashboard_url}  metrics {daemon.metrics_url}")
    ok = False
    watcher: Watcher | None = None
    try:
        env = StreamEnvironment(
            spark,
            checkpoint_dir=os.path.join(work, "checkpoints"),
            checkpoint_interval=args.checkpoint_interval,
            mode=args.checkpointing,
            aligned_checkpoint_timeout=args.aligned_checkpoint_timeout,
            job_id=f"clickstream-{os.getpid()}",
        )
        if not args.no_kill and daemon is None:
            _log(t0, "not a local master: the driver cannot kill a worker's process; --no-kill")
            args.no_kill = True
        holds = None if args.no_kill else hold_points(args.events, args.files, par, args.kill_at)
        (
            env.add_source(partial(HeldFileSource, in_glob, holds), parallelism=par, name="clicks")
            .map(parse_click, name="parse")
            .key_by(lambda e: e[0], name="by-user")
            .process(RunningTotals(pid_dir), parallelism=par, name="totals")
            .sink_to_files(out_dir, parallelism=par)
        )
        stats_url = daemon.dashboard_url.rstrip("/") + "/api/stats" if daemon else None
        kill_after = None if holds is None else sum(holds)
        watcher = Watcher(env, t0, args.events, stats_url, pid_dir, kill_after)
        watcher.start()
        _log(
            t0,
            f"streaming: files -> parse -> key_by(user) -> running totals -> two-phase-commit "
            f"files, parallelism {par}, {_mode_name(args.checkpointing)} checkpoints every "
            f"{args.checkpoint_interval:g} s",
        )
        t_job = time.monotonic()
        try:
            result = env.execute(restart_attempts=3, restart_backoff=0.5)
        except JobFailedError as e:
            _log(t0, f"the job failed: {e}")
            return 1
        job_s = time.monotonic() - t_job
        watcher.stop_event.set()
        watcher.join(5)
        if result.stopped:  # Ctrl-C: a clean stop at a final checkpoint, input left unread
            _log(
                t0,
                f"stopped after {job_s:.1f} s: the output is committed up to checkpoint "
                f"{result.last_checkpoint_id}; no check of a partial run",
            )
            return 130
        _log(t0, f"job finished in {job_s:.1f} s; checking against Spark's DataFrame groupBy")
        t_check = time.monotonic()
        verdict = check_output(spark, in_glob, out_dir)
        check_s = time.monotonic() - t_check
        committed = [n for n in os.listdir(out_dir) if n.startswith("part-")]

        print()
        print("=" * 78)
        print(
            f"pipeline         files -> parse -> key_by(user) -> running totals -> "
            f"2PC file sink (x{par})"
        )
        print(
            f"events           {args.events:,} in {args.files} files ({nbytes / 2**20:.1f} MiB), "
            f"{args.users:,} users"
        )
        rate = args.events / job_s if job_s > 0 else 0.0
        print(
            f"job              {job_s:.1f} s ({rate:,.0f} events/s incl. the restart), "
            f"{result.checkpoints_completed} checkpoints completed "
            f"({_mode_name(args.checkpointing)}, every {args.checkpoint_interval:g} s)"
        )
        if args.checkpointing == "unaligned":
            unaligned = [c for c in result.checkpoints if c.unaligned]
            persisted = [sum(c.persisted_bytes.values()) for c in unaligned]
            print(
                f"unaligned        {len(unaligned)} of {len(result.checkpoints)} checkpoints "
                f"triggered unaligned; in-flight input persisted: "
                f"{sum(persisted) / 1024:.0f} KiB in all, max "
                f"{max(persisted, default=0) / 1024:.0f} KiB per checkpoint"
            )
        if result.checkpoints:
            took = sorted(c.duration for c in result.checkpoints)
            print(
                f"checkpoints      duration median {1000 * took[len(took) // 2]:.0f} ms, "
                f"max {1000 * took[-1]:.0f} ms; longest alignment "
                f"{1000 * max(c.alignment for c in result.checkpoints):.0f} ms; last state "
                f"{result.checkpoints[-1].bytes / 1024:.0f} KiB"
            )
        k = watcher.killed
        if k is not None:
            print(
                f"kill             SIGKILL to task {k['task']}'s Python worker (pid {k['pid']}) "
                f"at {k['at']:.1f} s, after {k['read']:,} events and {k['checkpoints']} checkpoints"
            )
        restored = watcher.restored_from
        print(
            f"restarts         {result.restarts}"
            + (f", from checkpoint {restored}" if restored is not None else "")
            + (f": {result.failures[0].splitlines()[0][:100]}" if result.failures else "")
        )
        peaks = ", ".join(
            f"{task} {level} {100 * ratio:.0f}%"
            for task, (ratio, level) in sorted(watcher.peak.items())
        )
        print(f"back pressure    peak per task: {peaks or 'not measured'}")
        print(
            f"committed        {verdict['lines']:,} running-total records in "
            f"{len(committed)} files; checked in {check_s:.1f} s"
        )
        equal = output_equals(verdict, args.events)
        restarted = args.no_kill or (k is not None and result.restarts >= 1)
        ok = equal and restarted
        if ok:
            print(
                f"verdict          PASSED: the committed output equals Spark's DataFrame "
                f"groupBy for all {verdict['users']:,} users (nothing lost, nothing twice)"
            )
        elif not equal:
            print(
                f"verdict          FAILED: {verdict['bad_users']:,} of {verdict['users']:,} users "
                f"differ; {verdict['lines']:,} lines for {verdict['events']:,} events, "
                f"{verdict['duplicates']:,} twice, {verdict['missing']:,} missing"
            )
        else:
            print(
                "verdict          FAILED: the output is right, but no restart was tested "
                "(the job ended before the kill, or the kill did not restart it): "
                "more --events, or --no-kill"
            )
        if daemon is not None:
            print(f"dashboard        {daemon.dashboard_url}")
        print("=" * 78)
        if args.linger and daemon is not None:
            _log(t0, f"lingering: the dashboard stays at {daemon.dashboard_url} until Ctrl-C")
            with contextlib.suppress(KeyboardInterrupt):
                threading.Event().wait()
    finally:
        if watcher is not None:
            watcher.stop_event.set()
        spark.stop()
        whole = stop_embedded_daemon()
        _log(t0, f"daemon stopped; network buffer pool whole: {whole}")
        if own_workdir:
            shutil.rmtree(work, ignore_errors=True)
        logging.getLogger("exchange.streaming").removeHandler(speaking)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
