"""``exchange-daemon`` / ``python -m server``: run one exchange daemon."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from exchange.errors import ExchangeError
from server.config import DaemonConfig, load_config

__all__ = ["main"]


async def _run(config: DaemonConfig) -> int:
    from server.daemon import ExchangeDaemon

    daemon = ExchangeDaemon(config)
    info = await daemon.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, daemon.request_stop)
    print(json.dumps(info), flush=True)
    logging.getLogger("exchange.server").info(
        "exchange daemon %s ready: data %s, http %s, local %s",
        daemon.daemon_id,
        info["data"],
        info["http"],
        info["local_socket"],
    )
    await daemon.wait_stopped()
    whole = await daemon.shutdown()
    # Stopped: a SIGTERM / SIGINT from now on (a supervisor repeating its stop) must not
    # kill the exit under way with the signal's default action (exit -15 instead of 0
    # once the loop closed its handlers); the process ends in a moment either way.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
        signal.signal(sig, signal.SIG_IGN)
    print(json.dumps({"event": "stopped", "pool_whole": whole}), flush=True)
    return 0


def _event_loop_runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """uvloop where it is installed, else asyncio's default loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run
    return uvloop.run


def main(argv: Sequence[str] | None = None) -> int:
    # Logging first, so what loading the config warns about (an unknown EXCHANGE_*
    # variable) is printed like every other line; the level comes with the config.
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        config = load_config(argv)
    except ExchangeError as e:
        print(f"exchange-daemon: {e}", file=sys.stderr)
        return 2
    logging.getLogger().setLevel(config.log_level)
    try:
        return _event_loop_runner()(_run(config))
    except ExchangeError as e:
        print(f"exchange-daemon: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"exchange-daemon: cannot start: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
