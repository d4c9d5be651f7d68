"""StreamEnvironment's job settings are parsed and checked in the driver, up front."""

from __future__ import annotations

import pytest

from client.streaming.connectors import CollectSink
from client.streaming.environment import StreamEnvironment
from client.streaming.graph import JobGraph
from exchange.errors import ConfigError, UsageError


class _Context:
    """Stands for the SparkContext: settings are checked before Spark is used."""

    def parallelize(self, *args: object) -> None:
        raise AssertionError("no job runs here")


def test_buffer_timeout_takes_a_duration() -> None:
    env = StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", buffer_timeout="100ms")
    assert env.buffer_timeout == pytest.approx(0.1)
    assert StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt").buffer_timeout == 0.01


@pytest.mark.parametrize("bad", [-1, "soon", True])
def test_a_bad_buffer_timeout_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="buffer_timeout"):
        StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", buffer_timeout=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, "soon", True])
def test_a_bad_lease_timeout_is_refused(bad: object) -> None:
    with pytest.raises((ConfigError, UsageError), match="lease_timeout"):
        StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", lease_timeout=bad)  # type: ignore[arg-type]


def test_a_bad_secret_file_is_refused() -> None:
    with pytest.raises(UsageError, match="secret_file"):
        StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", secret_file="")


def _job(p: int) -> JobGraph:
    env = StreamEnvironment(None, checkpoint_dir="/tmp/ckpt")
    (
        env.from_generator(int, count=10, name="gen")
        .map(str, name="ident", parallelism=p)
        .key_by(len, name="bykey")
        .process(lambda v, ctx, out: None, name="sums", parallelism=p)
        .uid("totals")
        .sink_to(CollectSink, name="sink", uid="out")
    )
    return JobGraph.build(env._nodes, env.max_parallelism)


def test_operator_state_ids_do_not_depend_on_the_chaining() -> None:
    """The same operators at parallelism 1 (two chains) and 2 (three vertices): every
    operator keeps its state id (uid, else name); only the tasks running it change."""
    one, two = _job(1).operator_tasks(), _job(2).operator_tasks()
    assert list(one) == list(two) == ["gen", "ident", "bykey", "totals", "out"]
    assert one["totals"] == ["v1-0"] and two["totals"] == ["v2-0", "v2-1"]
    assert one["gen"] == two["gen"] == ["v0-0"] and two["ident"] == ["v1-0", "v1-1"]


@pytest.mark.parametrize("bad", ["", "a/b", "x" * 65, 7])
def test_a_bad_uid_is_refused_when_given(bad: object) -> None:
    env = StreamEnvironment(None, checkpoint_dir="/tmp/ckpt")
    stream = env.from_generator(int, count=1)
    with pytest.raises(UsageError, match="uid"):
        stream.uid(bad)  # type: ignore[arg-type]


def test_uids_must_be_unique() -> None:
    env = StreamEnvironment(None, checkpoint_dir="/tmp/ckpt")
    env.from_generator(int, count=1, name="a").map(str, name="b").uid("a")
    with pytest.raises(UsageError, match="state id 'a'"):
        JobGraph.build(env._nodes, env.max_parallelism)


def test_allow_non_restored_state_must_be_a_bool() -> None:
    env = StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt")
    with pytest.raises(UsageError, match="allow_non_restored_state"):
        env.execute(allow_non_restored_state="yes")  # type: ignore[arg-type]


def test_alignment_settings_are_parsed_up_front() -> None:
    from exchange.checkpointing import AlignmentMode

    env = StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt")
    assert env.alignment is AlignmentMode.BLOCK_UPSTREAM and env.alignment_limit is None
    env = StreamEnvironment(
        _Context(),
        checkpoint_dir="/tmp/ckpt",
        alignment="spill",
        alignment_limit="4mb",
        alignment_spill_dir="/tmp/x",
    )
    assert env.alignment is AlignmentMode.SPILL and env.alignment_limit == 4 * 2**20
    assert env.alignment_spill_dir == "/tmp/x"


@pytest.mark.parametrize(
    ("kwargs", "setting"),
    [
        ({"alignment": "blocking"}, "alignment"),
        ({"alignment": None}, "alignment"),
        ({"alignment": "buffer", "mode": "at_least_once"}, "alignment"),
        ({"alignment_limit": "lots"}, "alignment_limit"),
        ({"alignment_limit": -1}, "alignment_limit"),
        ({"alignment_spill_dir": ""}, "alignment_spill_dir"),
    ],
)
def test_bad_alignment_settings_are_config_errors(kwargs: dict[str, object], setting: str) -> None:
    with pytest.raises(ConfigError, match=setting):
        StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", **kwargs)  # type: ignore[arg-type]
