"""ReaderOptions / WriterOptions (client/options.py): validated once when built, with a
ConfigError naming the option; ``from_daemon`` takes what a real daemon's settings decide,
overrides win; the public constructors take an options object, keywords, or both."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.local_connection import fetch_daemon_info, release_dataset
from client.options import ReaderOptions, WriterOptions
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.checkpointing import CheckpointingMode
from exchange.debloat.config import DebloatConfig
from exchange.errors import ConfigError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.serialization import MsgpackCodec


class _Listener:
    def trigger_checkpoint(self, *args: Any) -> None:
        pass

    def abort_checkpoint(self, *args: Any) -> None:
        pass


BAD_READER_OPTIONS: list[tuple[str, Any]] = [
    ("local_daemon_id", 7),
    ("codec", "msgpack"),
    ("codec", MsgpackCodec),  # the class, not an instance
    ("secret", "text"),
    ("segment_size", 100),
    ("segment_size", 1 << 40),
    ("segment_size", 32768.0),
    ("num_exclusive", 0),
    ("num_floating", -1),
    ("num_floating", True),
    ("backoff_initial", 0),
    ("backoff_max", math.nan),
    ("event_handler", "print"),
    ("auto_resume_barriers", 1),
    ("checkpoint_listener", object()),
    ("checkpointing_mode", "exactly-twice"),
    ("checkpoint_alignment_limit", -1),
    ("checkpoint_alignment_limit", 1.5),
    ("debloat", {"enabled": True}),
    ("debloat", DebloatConfig(max_buffer_size=64 * 1024)),  # above the 32 KiB segment
    ("metrics_socket", ""),
    ("task_name", "x" * 257),
    ("no_such_option", 1),
]


@pytest.mark.parametrize(("name", "value"), BAD_READER_OPTIONS)
def test_reader_options_refuse_a_bad_value_naming_the_option(name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        ReaderOptions.of(None, {name: value})
    assert info.value.setting == name
    assert repr(name) in str(info.value)


def test_reader_options_check_backoff_order() -> None:
    with pytest.raises(ConfigError) as info:
        ReaderOptions(backoff_initial=1.0, backoff_max=0.5)
    assert info.value.setting == "backoff_max"


BAD_WRITER_OPTIONS: list[tuple[str, Any]] = [
    ("blocking", "yes"),
    ("daemon_socket", b"/tmp/x.sock"),
    ("codec", "pickle"),
    ("selector", lambda r: 0),
    ("secret", "s"),
    ("buffer_timeout", -5),
    ("buffer_timeout", math.nan),
    ("buffer_timeout", True),
    ("window", 4),  # the facade's argument, not an option
]


@pytest.mark.parametrize(("name", "value"), BAD_WRITER_OPTIONS)
def test_writer_options_refuse_a_bad_value_naming_the_option(name: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        WriterOptions.of(None, {name: value})
    assert info.value.setting == name


def test_options_are_frozen_and_replace_validates_again() -> None:
    opts = ReaderOptions(checkpointing_mode="at_least_once")
    assert opts.checkpointing_mode is CheckpointingMode.AT_LEAST_ONCE  # stored as the enum
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.num_exclusive = 3  # type: ignore[misc]
    more = opts.replace(num_exclusive=3)
    assert (more.num_exclusive, opts.num_exclusive) == (3, 2)
    assert more.checkpointing_mode is CheckpointingMode.AT_LEAST_ONCE
    with pytest.raises(ConfigError, match="'num_exclusive'"):
        opts.replace(num_exclusive=0)
    with pytest.raises(ConfigError, match="'num_exclusve'"):
        opts.replace(num_exclusve=3)
    # an options object plus keywords: the keywords win, validated
    assert ReaderOptions.of(more, {"num_floating": 0}).num_floating == 0
    with pytest.raises(ConfigError, match="'options'"):
        ReaderOptions.of(WriterOptions(), {})  # type: ignore[arg-type]


def test_the_secret_stays_out_of_the_repr() -> None:
    for opts in (ReaderOptions(secret=b"s3cr3t-key"), WriterOptions(secret=b"s3cr3t-key")):
        assert opts.secret == b"s3cr3t-key"
        assert "s3cr3t" not in repr(opts)


def test_public_constructors_refuse_a_bad_option_object_before_connecting() -> None:
    loc = PartitionLocation(ResultPartitionID("opts", 0), 0, "127.0.0.1:1")
    with pytest.raises(ConfigError, match="'options'"):
        PartitionReader([loc], WriterOptions())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="'window'"):
        PartitionReader([loc], ReaderOptions(), window=0)
    with pytest.raises(ConfigError, match="'codec'"):
        PartitionWriter(ResultPartitionID("opts", 0), 1, WriterOptions(), codec="pickle")


FLAGS = (
    "--exclusive-buffers-per-channel=3",
    "--floating-buffers-per-gate=5",
    "--partition-request-backoff-initial=20ms",
    "--partition-request-backoff-max=400ms",
    "--buffer-timeout=250ms",
    "--debloat",
    "--debloat-min-buffer-size=2k",
    "--checkpoint-alignment-limit=1mb",
)


def test_from_daemon_takes_the_daemon_settings_and_overrides_win(start_daemon: Any) -> None:
    d = start_daemon(*FLAGS)
    info = get_runtime().run(fetch_daemon_info(d.local_socket))
    r = ReaderOptions.from_daemon(info)
    assert (r.local_daemon_id, r.segment_size) == (d.daemon_id, d.segment_size)
    assert (r.num_exclusive, r.num_floating) == (3, 5)
    assert (r.backoff_initial, r.backoff_max) == (pytest.approx(0.02), pytest.approx(0.4))
    assert r.debloat is not None and r.debloat.enabled
    assert (r.debloat.min_buffer_size, r.debloat.max_buffer_size) == (2048, d.segment_size)
    assert r.checkpoint_alignment_limit is None  # no listener: the limit means nothing
    listener = _Listener()
    c = ReaderOptions.from_daemon(info, checkpoint_listener=listener, num_exclusive=1)
    assert (c.checkpoint_alignment_limit, c.num_exclusive) == (1 << 20, 1)
    assert c.checkpoint_listener is listener
    # a smaller segment size sizes the debloat config with it
    small = ReaderOptions.from_daemon(info, segment_size=8192)
    assert small.debloat is not None and small.debloat.max_buffer_size == 8192
    with pytest.raises(ConfigError, match="'num_floating'"):
        ReaderOptions.from_daemon(info, num_floating=-1)

    w = WriterOptions.from_daemon(info, daemon_socket=d.local_socket)
    assert (w.buffer_timeout, w.blocking) == (pytest.approx(0.25), False)
    # a blocking partition is read once written: only full buffers, unless told otherwise
    assert WriterOptions.from_daemon(info, blocking=True).buffer_timeout == -1
    assert WriterOptions.from_daemon(info, blocking=True, buffer_timeout=0).buffer_timeout == 0


def test_options_objects_drive_a_real_exchange(start_daemon: Any) -> None:
    """A writer and a reader built from the daemon's options move every record; the
    reader's pool is sized by the daemon's buffers (3 per channel + 5 floating)."""
    d = start_daemon(*FLAGS)
    info = get_runtime().run(fetch_daemon_info(d.local_socket))
    pids = [ResultPartitionID("options-e2e", i, 0) for i in range(2)]
    wopts = WriterOptions.from_daemon(info, blocking=True, daemon_socket=d.local_socket)
    for pid in pids:
        with PartitionWriter(pid, 2, wopts, window=2) as w:
            for i in range(500):
                w.emit_to((pid.partition_index, i), i % 2)
    locs = [PartitionLocation(pid, 1, d.data_address, d.daemon_id, d.local_socket) for pid in pids]
    ropts = ReaderOptions.from_daemon(info, backoff_max=0.1)
    with PartitionReader(locs, ropts, window=2) as reader:
        assert reader._core.pool.total_segments == 2 * 3 + 5
        # the daemon's readers debloat (--debloat): credit by Flink's rule, no share
        assert [ch.floating_share for ch in reader._core.gate.channels] == [0, 0]
        got = sorted(reader.records())
    assert got == sorted((p, i) for p in range(2) for i in range(1, 500, 2))

    async def read_async() -> list[Any]:
        # without debloating each channel keeps its share of the floating buffers free
        # whatever the backlog (here all 5: one channel)
        core = await AsyncPartitionReader.open(locs[:1], ropts, codec=reader.codec, debloat=None)
        try:
            assert [ch.floating_share for ch in core.gate.channels] == [5]
            return await core.read_all()
        finally:
            await core.close()

    assert sorted(get_runtime().run(read_async())) == [(0, i) for i in range(1, 500, 2)]
    get_runtime().run(release_dataset(d.local_socket, "options-e2e"))
    d.wait_pool_whole()


def test_reader_alignment_option_is_validated() -> None:
    from client.options import ReaderOptions
    from exchange.checkpointing import AlignmentMode
    from exchange.errors import ConfigError

    assert ReaderOptions().alignment is AlignmentMode.BLOCK_UPSTREAM
    assert ReaderOptions(alignment="buffer").alignment is AlignmentMode.BUFFER
    with pytest.raises(ConfigError, match="alignment"):
        ReaderOptions(alignment="park")
    with pytest.raises(ConfigError, match="alignment_spill_dir"):
        ReaderOptions(alignment="spill", alignment_spill_dir=3)  # type: ignore[arg-type]


def test_floating_buffers_default_by_the_readers_kind(start_daemon: Any) -> None:
    """A daemon that does not set ``floating_buffers_per_gate`` leaves it to the reader:
    32 for a batch reader, 8 (Flink's) for a streaming one (a checkpoint listener), also
    in the synchronous reader, whose core reads without the listener; a value set by the
    reader or by the daemon wins. The pools are sized by it and every record arrives."""
    d = start_daemon()
    info = get_runtime().run(fetch_daemon_info(d.local_socket))
    assert info.settings.get("floating_buffers_per_gate") is None
    batch = ReaderOptions.from_daemon(info)
    streaming = ReaderOptions.from_daemon(info, checkpoint_listener=_Listener())
    assert (batch.num_floating, batch.floating_buffers) == (None, 32)
    assert (streaming.num_floating, streaming.floating_buffers) == (None, 8)
    assert batch.replace(num_floating=4).floating_buffers == 4
    assert streaming.replace(num_floating=16).floating_buffers == 16
    pid = ResultPartitionID("floating-default", 0, 0)
    wopts = WriterOptions.from_daemon(info, blocking=True, daemon_socket=d.local_socket)
    with PartitionWriter(pid, 1, wopts) as w:
        w.emit_all(((i, i) for i in range(300)), lambda k: 0)
    locs = [PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)]
    for opts, floating in ((batch, 32), (streaming, 8), (batch.replace(num_floating=4), 4)):
        with PartitionReader(locs, opts) as reader:
            assert reader._core.pool.total_segments == 2 + floating
            assert list(reader.records()) == [(i, i) for i in range(300)]
    get_runtime().run(release_dataset(d.local_socket, "floating-default"))
    d.wait_pool_whole()
    # the daemon's setting, when given, is every reader's
    d5 = start_daemon("--floating-buffers-per-gate=5")
    info5 = get_runtime().run(fetch_daemon_info(d5.local_socket))
    assert ReaderOptions.from_daemon(info5).floating_buffers == 5
    assert ReaderOptions.from_daemon(info5, checkpoint_listener=_Listener()).floating_buffers == 5
