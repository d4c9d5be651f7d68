#!/usr/bin/env bash
# tests/ops/test_prometheus.py runs a real Prometheus (Debian's package: prometheus and
# promtool). Install it when absent and this runs as root with apt-get; otherwise say so
# (the test then fails, naming what to install: it never skips).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ensure-prometheus: installing Debian's prometheus (without recommends)" >&2
    apt-get update -qq || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus \
        >/dev/null || echo "ensure-prometheus: apt-get install prometheus failed" >&2
else
    echo "ensure-prometheus: no prometheus on PATH; install it (apt-get install prometheus):" \
        "tests/ops/test_prometheus.py fails without it" >&2
fi
