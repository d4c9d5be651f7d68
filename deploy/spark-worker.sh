#!/usr/bin/env bash
# Starts a Spark worker whose executors use the exchange daemon on the shared socket.
set -euo pipefail
SPARK_HOME=$(python3 -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')
export SPARK_HOME EXCHANGE_DAEMON=/run/exchange/daemon.sock
for _ in $(seq 1 100); do [ -S "$EXCHANGE_DAEMON" ] && break; sleep 0.2; done
exec "$SPARK_HOME/bin/spark-class" org.apache.spark.deploy.worker.Worker \
    --cores "${WORKER_CORES:-2}" --memory "${WORKER_MEMORY:-2g}" "${SPARK_MASTER:-spark://master:7077}"
