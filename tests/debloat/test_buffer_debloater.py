"""BufferSizeEMA and BufferDebloater against values computed by hand.

Most cases use samples=3, so alpha = 2 / (3 + 1) = 0.5 and every step is plain arithmetic:
new = last + 0.5 * (min(desired_total / buffers, 2 * last) - last), clamped to [min, max].
"""

from __future__ import annotations

import pytest

from exchange.debloat import BufferDebloater, BufferDebloaterStats, BufferSizeEMA, DebloatConfig
from exchange.errors import UsageError


def _config(**changes: object) -> DebloatConfig:
    base: dict[str, object] = {
        "enabled": True,
        "samples": 3,
        "threshold_percent": 25,
        "min_buffer_size": 256,
        "max_buffer_size": 32768,
        "initial_buffer_size": 1024,
        "target": 1.0,
    }
    base.update(changes)
    return DebloatConfig(**base)  # type: ignore[arg-type]


# --- BufferSizeEMA -----------------------------------------------------------------------


def test_ema_shrinks_by_half_steps_and_stops_at_the_minimum() -> None:
    ema = BufferSizeEMA(starting_size=200, max_size=200, min_size=10, samples=3)
    # 200 -> 100 -> 50 -> 25 -> 12.5 (rounds half up to 13) -> 6.25 clamped to 10
    assert [ema.calculate_buffer_size(0, 1) for _ in range(6)] == [100, 50, 25, 13, 10, 10]


def test_ema_growth_is_capped_at_twice_the_average() -> None:
    ema = BufferSizeEMA(starting_size=10, max_size=1000, min_size=10, samples=3)
    # desired 10000 per buffer, capped at 2 * last each step:
    # 10 -> 10 + 0.5 * (20 - 10) = 15 -> 22.5 -> 33.75 -> 50.625 -> 75.9375
    sizes = [ema.calculate_buffer_size(10_000, 1) for _ in range(5)]
    assert sizes == [15, 23, 34, 51, 76]  # 22.5 rounds half up, as Java's Math.round
    assert ema.value == pytest.approx(75.9375)


def test_ema_cannot_exceed_the_maximum() -> None:
    ema = BufferSizeEMA(starting_size=200, max_size=200, min_size=10, samples=3)
    assert ema.calculate_buffer_size(0, 1) == 100
    # 100 -> 100 + 0.5 * (200 - 100) = 150 -> 150 + 0.5 * (300 - 150) = 225 clamped to 200
    assert [ema.calculate_buffer_size(1000, 1) for _ in range(3)] == [150, 200, 200]


def test_ema_divides_the_total_over_the_buffers() -> None:
    ema = BufferSizeEMA(starting_size=1000, max_size=4000, min_size=10, samples=3)
    # 6000 bytes over 4 buffers = 1500 each: 1000 + 0.5 * 500 = 1250
    assert ema.calculate_buffer_size(6000, 4) == 1250


def test_ema_with_flinks_default_samples() -> None:
    ema = BufferSizeEMA(starting_size=1024, max_size=32768, min_size=256, samples=20)
    # alpha = 2/21; desired 10000 capped at 2048: 1024 + 1024 * 2/21 = 1121.52...
    assert ema.calculate_buffer_size(1_000_000, 100) == 1122
    # then 1121.52 + (2243.05 - 1121.52) * 2/21 = 1228.34...
    assert ema.calculate_buffer_size(1_000_000, 100) == 1228


@pytest.mark.parametrize(
    ("total", "buffers"), [(-1, 1), (1, 0), (1, -1)], ids=["negative-total", "zero", "neg"]
)
def test_ema_refuses_bad_arguments(total: int, buffers: int) -> None:
    ema = BufferSizeEMA(starting_size=100, max_size=200, min_size=10, samples=2)
    with pytest.raises(UsageError):
        ema.calculate_buffer_size(total, buffers)


@pytest.mark.parametrize(
    ("start", "max_size", "min_size", "samples"),
    [(5, 200, 10, 3), (300, 200, 10, 3), (100, 200, 0, 3), (100, 200, 10, 0)],
)
def test_ema_refuses_bad_construction(
    start: int, max_size: int, min_size: int, samples: int
) -> None:
    with pytest.raises(UsageError):
        BufferSizeEMA(start, max_size, min_size, samples)


# --- BufferDebloater ---------------------------------------------------------------------


def test_starts_at_the_configured_size_and_announces_nothing_before_a_period() -> None:
    debloater = BufferDebloater(_config(initial_buffer_size=4096))
    assert debloater.buffer_size == 4096
    assert debloater.stats() == BufferDebloaterStats(4096, 4096, 0, 0, 0, 0.0)


def test_several_steps_with_threshold_skipping() -> None:
    debloater = BufferDebloater(_config())
    # 8192 B/s x 1 s over 4 buffers = 2048 per buffer (= 2 x 1024, not capped):
    # 1024 -> 1536; |1536 - 1024| = 512 >= 25 % of 1024 = 256: announced
    assert debloater.recalculate(8192, 4) == 1536
    assert debloater.stats() == BufferDebloaterStats(
        buffer_size=1536,
        computed_buffer_size=1536,
        throughput=8192,
        buffers_in_use=4,
        desired_total_bytes=8192,
        estimated_time_to_consume=1536 * 4 / 8192,
    )
    # 1536 -> 1792; |1792 - 1536| = 256 < 25 % of 1536 = 384: skipped
    assert debloater.recalculate(8192, 4) is None
    assert debloater.buffer_size == 1536
    assert debloater.stats().computed_buffer_size == 1792
    # 1792 -> 1920; |1920 - 1536| = 384, exactly the threshold: announced
    assert debloater.recalculate(8192, 4) == 1920
    assert debloater.buffer_size == 1920
    # 1920 -> 1984, 2016, 2032: within 25 % of 1920 (480)
    assert [debloater.recalculate(8192, 4) for _ in range(3)] == [None, None, None]
    assert debloater.stats().computed_buffer_size == 2032
    assert debloater.buffer_size == 1920


def test_threshold_zero_announces_every_change_but_not_a_repeat() -> None:
    debloater = BufferDebloater(_config(threshold_percent=0))
    assert debloater.recalculate(4096, 2) == 1536  # 2048 per buffer: 1024 -> 1536
    assert debloater.recalculate(4096, 2) == 1792
    # A desired size equal to the current one changes nothing and announces nothing.
    steady = BufferDebloater(_config(threshold_percent=0))
    assert steady.recalculate(2048, 2) is None
    assert steady.buffer_size == 1024


def test_shrinking_to_the_minimum_is_announced_even_below_the_threshold() -> None:
    debloater = BufferDebloater(_config(threshold_percent=100))
    # no throughput: 1024 -> 512, a change of 50 % < 100 %: skipped
    assert debloater.recalculate(0, 1) is None
    # 512 -> 256 = min: announced although |256 - 1024| < 1024
    assert debloater.recalculate(0, 1) == 256
    # already at the minimum: nothing more to say
    assert debloater.recalculate(0, 1) is None
    assert debloater.buffer_size == 256


def test_growing_to_the_maximum_is_announced_even_below_the_threshold() -> None:
    debloater = BufferDebloater(_config(threshold_percent=100, max_buffer_size=4096))
    big = 10**9
    # capped growth 1024 -> 1536: |512| < 100 % of 1024, skipped
    assert debloater.recalculate(big, 1) is None
    # 1536 -> 2304: |1280| >= 1024, announced
    assert debloater.recalculate(big, 1) == 2304
    # 2304 -> 3456: |1152| < 2304, skipped
    assert debloater.recalculate(big, 1) is None
    # 3456 + 0.5 * (6912 - 3456) = 5184, clamped to 4096 = max: |1792| < 2304, yet announced
    assert debloater.recalculate(big, 1) == 4096
    assert debloater.recalculate(big, 1) is None
    assert debloater.buffer_size == 4096


def test_zero_buffers_in_use_counts_as_one() -> None:
    debloater = BufferDebloater(_config())
    # 2048 B/s over max(1, 0) = 1 buffer: 1024 -> 1536
    assert debloater.recalculate(2048, 0) == 1536
    stats = debloater.stats()
    assert stats.buffers_in_use == 0
    assert stats.estimated_time_to_consume == pytest.approx(1536 / 2048)


def test_zero_throughput_estimates_against_one_byte_per_second() -> None:
    debloater = BufferDebloater(_config())
    assert debloater.recalculate(0, 3) == 512  # 1024 -> 512
    # Flink divides by max(1, throughput): 512 bytes x 3 buffers at 1 B/s
    assert debloater.estimated_time_to_consume == 512 * 3


def test_fractional_target_uses_exact_integer_bytes() -> None:
    # 0.7 s x 1290 B/s is 903 bytes, although 1290 * 0.7 == 902.9999999999999 in floats.
    debloater = BufferDebloater(_config(target=0.7, initial_buffer_size=600))
    debloater.recalculate(1290, 1)
    assert debloater.stats().desired_total_bytes == 903
    assert debloater.stats().computed_buffer_size == 752  # 600 + 0.5 * (903 - 600), half up


def test_target_scales_the_desired_total() -> None:
    debloater = BufferDebloater(_config(target=0.25))
    # 16384 B/s x 0.25 s = 4096 bytes over 2 buffers = 2048: 1024 -> 1536
    assert debloater.recalculate(16384, 2) == 1536
    assert debloater.stats().desired_total_bytes == 4096


@pytest.mark.parametrize(("throughput", "buffers"), [(-1, 1), (1, -1)])
def test_refuses_negative_inputs(throughput: int, buffers: int) -> None:
    debloater = BufferDebloater(_config())
    with pytest.raises(UsageError):
        debloater.recalculate(throughput, buffers)
    assert debloater.stats().throughput == 0  # nothing was recorded
