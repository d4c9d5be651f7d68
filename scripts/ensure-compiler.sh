#!/usr/bin/env bash
# The data plane is compiled at install (Cython, setup.py): it needs a C compiler and the
# headers of the Python that builds it. Install Debian's build-essential when absent.
set -euo pipefail
PYTHON=${1:-python3}
include=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
have_cc() { command -v "${CC:-cc}" >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1; }
if have_cc && [ -f "$include/Python.h" ]; then
    exit 0
fi
pkgs=()
have_cc || pkgs+=(build-essential)
# Debian's own interpreter keeps its headers in python3-dev; another one (pyenv, a
# docker python image) ships them itself.
if [ ! -f "$include/Python.h" ] && [ "${include#/usr/include/}" != "$include" ]; then
    pkgs+=("python$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-dev")
fi
if [ ${#pkgs[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure-compiler: installing ${pkgs[*]}" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${pkgs[@]}" >/dev/null
fi
if have_cc && [ -f "$include/Python.h" ]; then
    exit 0
fi
echo "ensure-compiler: the data plane is compiled at install and needs a C compiler and" \
    "$include/Python.h; install them (Debian/Ubuntu: apt-get install build-essential" \
    "python3-dev) and retry" >&2
exit 1
