"""The driver's embedded daemon: flags asked for take effect or are refused, never ignored."""

from __future__ import annotations

import pytest

from client import spark as xs
from exchange.errors import UsageError


def test_flags_for_a_running_embedded_daemon_are_refused_not_ignored() -> None:
    xs.stop_embedded_daemon()
    try:
        d = xs.get_embedded_daemon(["--debloat"])
        assert d.extra_args == ("--debloat",)
        assert xs.get_embedded_daemon() is d  # no flags: whichever runs
        assert xs.get_embedded_daemon(["--debloat"]) is d
        with pytest.raises(UsageError, match="stop_embedded_daemon"):
            xs.get_embedded_daemon(["--network-memory", "64mb"])
        assert xs.get_embedded_daemon() is d  # the refusal changed nothing
    finally:
        assert xs.stop_embedded_daemon()
    d2 = xs.get_embedded_daemon(["--network-memory", "64mb"])
    try:
        assert d2 is not d and d2.extra_args == ("--network-memory", "64mb")
    finally:
        assert xs.stop_embedded_daemon()
