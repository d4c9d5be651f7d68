#!/usr/bin/env bash
# PySpark needs a Java runtime (17 or 21). Install one from Debian's packages when absent.
set -euo pipefail
if command -v java >/dev/null 2>&1; then
    exit 0
fi
echo "ensure-java: no java on PATH; installing openjdk-17-jre-headless" >&2
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openjdk-17-jre-headless >/dev/null
else
    echo "ensure-java: install a Java 17 runtime (e.g. openjdk-17-jre-headless) and retry" >&2
    exit 1
fi
