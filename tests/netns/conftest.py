"""Two hosts on one machine: two network namespaces joined by a veth pair, each with its
own exchange daemon (``tests/daemon/_daemon.py``).

* ``two_hosts``: ``(a, b)``, two :class:`Host` objects. Each owns a network namespace and a
  thread inside it (``setns``): ``host.run(fn, *args)`` calls ``fn`` on that thread, so a
  process it starts (a daemon, a consumer task) and a connection it opens (``/api/stats``)
  live in the namespace. Both veth ends are inside the namespaces, so no packet of these
  tests leaves them. At teardown the namespaces (and the veth pair and any tc/nft rules in
  them) are deleted.
* ``start_daemon(*flags)`` (``tests/conftest.py``): call it through ``host.run``.

Where namespaces cannot be created (not root, no ``ip``, no permission) the tests are
skipped, saying why.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def ip(*cmd: str, netns: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (``ip ...``, ``tc ...``, ``nft ...``), inside ``netns`` when given."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return subprocess.run([*prefix, *cmd], capture_output=True, text=True, timeout=30)


def _enter_netns(name: str) -> None:
    """Move the calling thread into network namespace ``name`` (setns acts per thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass
class Host:
    """One namespace: its name, veth device and address, and a thread inside it."""

    netns: str
    device: str
    address: str
    thread: concurrent.futures.ThreadPoolExecutor

    def run(self, fn: Callable[..., T], *args: Any, timeout: float = 120.0) -> T:
        return self.thread.submit(fn, *args).result(timeout)

    def sh(self, *args: str) -> subprocess.CompletedProcess[str]:
        """A command inside the namespace (``ip netns exec``)."""
        return ip(*args, netns=self.netns)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return (
            f"creating network namespaces needs root (ip netns add); running as uid {os.geteuid()}"
        )
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed (.ci/run installs iproute2 when it runs as root)"
    return None


@pytest.fixture
def two_hosts() -> Iterator[tuple[Host, Host]]:
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    tag = f"x{os.getpid() % 100000}"
    names = (f"{tag}a", f"{tag}b")
    subnet = f"10.231.{os.getpid() % 250}"
    created: list[str] = []
    threads: list[concurrent.futures.ThreadPoolExecutor] = []
    try:
        for name in names:
            out = ip("ip", "netns", "add", name)
            if out.returncode != 0:
                pytest.skip(
                    f"cannot create a network namespace (ip netns add): {out.stderr.strip()}"
                )
            created.append(name)
        devs = (f"{tag}va", f"{tag}vb")
        veth = ("ip", "link", "add", devs[0], "netns", names[0], "type", "veth")
        out = ip(*veth, "peer", "name", devs[1], "netns", names[1])
        if out.returncode != 0:
            pytest.skip(f"cannot create a veth pair between namespaces: {out.stderr.strip()}")
        hosts = []
        for i, (name, dev) in enumerate(zip(names, devs, strict=True)):
            addr = f"{subnet}.{i + 1}"
            for cmd in (
                ("ip", "link", "set", "lo", "up"),
                ("ip", "addr", "add", f"{addr}/24", "dev", dev),
                ("ip", "link", "set", dev, "up"),
            ):
                out = ip(*cmd, netns=name)
                assert out.returncode == 0, (cmd, out.stderr)
            pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix=f"netns-{name}", initializer=_enter_netns, initargs=(name,)
            )
            threads.append(pool)
            hosts.append(Host(name, dev, addr, pool))
        a, b = hosts
        ping = a.sh("ping", "-c", "1", "-W", "5", b.address) if shutil.which("ping") else None
        assert ping is None or ping.returncode == 0, ping.stdout + ping.stderr if ping else ""
        yield a, b
    finally:
        for pool in threads:
            pool.shutdown(wait=True)
        for name in created:
            ip("ip", "netns", "del", name)
